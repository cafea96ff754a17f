"""An engine actor's side of what a tenant costs, called directly (no Ray) over
an engine of fake models whose batches sleep: it answers a gateway's batch
with the device time its own batches ran for it (not the time the batch
queued there), queues each tenant's items as that tenant's, and its reports
drain the memory its engine attributed to them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from builders import make_queued, write_fake_repository
from harness.fake_models import FAKE_ADAPTERS
from tessera.cluster.actor import EngineActor, tenant_runs
from tessera.engine import EngineConfig
from tessera.repository import ModelRepository
from tessera.request import item_tenants, with_stops
from tessera.runtimes.base import RemoteRun
from tessera.tasks.types import Task, TextInput

RUN_S = 0.05


@pytest.fixture
async def actor(tmp_path: Path) -> AsyncIterator[EngineActor]:
    """One batch of one item at a time, each sleeping ``RUN_S``."""
    model = {
        "task": "embedding",
        "options": {"run_s": RUN_S},
        "batching": {"max_batch_size": 1, "max_wait_ms": 1},
    }
    repository = ModelRepository.from_folders([write_fake_repository(tmp_path, {"m": model})])
    config = EngineConfig(
        memory_budget_bytes=64 * 1024**2, device="cpu", num_threads=1, adapters=FAKE_ADAPTERS
    )
    engine_actor = EngineActor("engine-0", repository, config)
    await engine_actor.ready()
    await engine_actor.load("m")
    yield engine_actor
    await engine_actor.close()


async def test_a_busy_engine_answers_with_its_run_not_the_batchs_wait(actor: EngineActor) -> None:
    async def timed(tenant: str) -> tuple[RemoteRun, float]:
        started = time.monotonic()
        answer = await actor.infer("m", Task.EMBEDDING, [TextInput("x")], None, [tenant])
        return answer, time.monotonic() - started

    answers = await asyncio.gather(*(timed(t) for t in ("a", "b", "c", "d")))
    for answer, _ in answers:
        assert len(answer.outputs) == 1
        assert RUN_S <= answer.device_s < RUN_S + 0.05  # its batch's run, alone in it
    last, waited_s = max(answers, key=lambda a: a[1])
    assert waited_s >= 3 * RUN_S  # behind three others' batches
    assert last.device_s < waited_s / 2


async def test_each_tenants_items_are_its_own_and_reports_drain_their_memory(
    actor: EngineActor,
) -> None:
    answer = await actor.infer("m", Task.EMBEDDING, [TextInput("x")] * 3, None, ["a", "a", "b"])
    assert len(answer.outputs) == 3
    costs = actor._engine.costs
    totals = costs.totals()
    assert {t for t, _ in totals} >= {"a", "b"}
    assert answer.device_s == pytest.approx(costs.device_s)  # every batch it ran for them
    assert totals[("a", "m")].device_s > totals[("b", "m")].device_s > 0
    first = actor.report().memory
    await asyncio.sleep(0.05)
    second = actor.report().memory
    assert {(u.tenant, u.model) for u in second} >= {("a", "m"), ("b", "m")}
    byte_s = {u.tenant: u.byte_s for u in second}
    assert byte_s["a"] / byte_s["b"] == pytest.approx(
        totals[("a", "m")].device_s / totals[("b", "m")].device_s
    )
    # Drained: the two reports hold disjoint parts of all the engine accounted.
    assert sum(u.byte_s for u in first + second) == pytest.approx(costs.byte_s)


def test_a_batchs_items_go_as_runs_of_one_tenant() -> None:
    assert tenant_runs(["a", "a", "b", "a"]) == [("a", 0, 2), ("b", 2, 3), ("a", 3, 4)]
    assert tenant_runs(["a"]) == [("a", 0, 1)]
    assert tenant_runs([]) == []


def test_a_runs_items_tenants_are_in_view_while_it_runs() -> None:
    loop = asyncio.new_event_loop()
    try:
        requests = [make_queued(loop, "a", items=2), make_queued(loop, "b")]
        seen = with_stops(lambda items: list(item_tenants(len(items))), requests)(["x"] * 3)
    finally:
        loop.close()
    assert seen == ["a", "a", "b"]
    assert item_tenants(2) == ("default", "default")  # outside a run
