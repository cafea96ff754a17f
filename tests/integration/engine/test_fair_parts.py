"""Fairness at the grain of work, on an engine over a fake model that takes
real time per work unit: a request of more work than one fair quantum is
queued as parts, so another tenant's request runs after about one part (here
at once, beyond the slots the large requests hold), while a tenant alone
still gets its parts back in full batches."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from builders import fake_engine
from tessera.admission import TenantLimits
from tessera.engine import Caller, Engine
from tessera.tasks.types import Task, TextInput

LONG = TextInput("word " * 40)  # 50 units
SHORT = TextInput("hi")
MODELS: dict[str, dict[str, Any]] = {
    "embed": {
        "task": "embedding",
        # 50 units x 0.6 ms: 30 ms a long text, more than the 25 ms quantum.
        "options": {"unit_s": 0.0006},
        "batching": {"max_batch_size": 16, "max_wait_ms": 1},
        "max_inputs": 64,
    },
}
# The same model where the card fixes two batches at once (an in-process
# runtime that takes no more): nothing steps past its slots.
MODELS["fixed"] = {
    **MODELS["embed"],
    "batching": {"max_batch_size": 16, "max_wait_ms": 1, "max_concurrent_batches": 2},
}
# A model whose batches cost 20 ms whatever their size: parts hold enough
# work that the fixed cost is at most a fifth of their run.
MODELS["fixed-cost"] = {
    **MODELS["embed"],
    "options": {"run_s": 0.02, "unit_s": 0.0001},
}
FLOOD, QUIET = Caller(TenantLimits("flood")), Caller(TenantLimits("quiet"))


@asynccontextmanager
async def measured_engine(root: Path, warm: Caller = QUIET, **config: Any) -> AsyncIterator[Engine]:
    """An engine whose model has measured run times (the parts are sized from
    them), from requests of ``warm``."""
    async with fake_engine(root, MODELS, **config) as engine:
        for model in MODELS:
            for size in (1, 4, 2, 8):
                await engine.infer(model, Task.EMBEDDING, [LONG] * size, caller=warm)
        yield engine


async def quiet_answered_while_the_flood_runs(
    engine: Engine, model: str = "embed", flood_items: list[TextInput] | None = None
) -> bool:
    """Two flood requests (16 long texts each, or ``flood_items``) in flight
    (both worker slots), then one short quiet request: whether it is
    answered before either flood one."""
    items = flood_items if flood_items is not None else [LONG] * 16
    flood = [
        asyncio.ensure_future(engine.infer(model, Task.EMBEDDING, items, caller=FLOOD))
        for _ in range(2)
    ]
    await asyncio.sleep(0.05)  # both flood requests are running
    quiet = asyncio.ensure_future(engine.infer(model, Task.EMBEDDING, [SHORT], caller=QUIET))
    done, _ = await asyncio.wait([quiet, *flood], return_when=asyncio.FIRST_COMPLETED)
    await asyncio.gather(quiet, *flood)
    return quiet in done


async def test_a_quiet_request_runs_between_the_parts_of_large_ones(tmp_path: Path) -> None:
    async with measured_engine(tmp_path / "repo") as engine:
        assert await quiet_answered_while_the_flood_runs(engine)
        model = engine.snapshot().model("embed")
        assert model is not None
        # The flood ran in parts of about a quantum: one long text each while
        # the quiet tenant was active.
        assert 1 in [size for size, _ in model.recent_batches][-33:]


async def test_with_fair_parts_off_a_request_runs_whole_and_the_quiet_one_waits(
    tmp_path: Path,
) -> None:
    async with measured_engine(tmp_path / "repo", fair_parts=False) as engine:
        assert not await quiet_answered_while_the_flood_runs(engine)


async def test_a_tenant_alone_gets_its_parts_back_in_full_batches(tmp_path: Path) -> None:
    async with measured_engine(tmp_path / "repo", warm=FLOOD) as engine:
        outputs = await engine.infer("embed", Task.EMBEDDING, [LONG] * 16, caller=FLOOD)
        assert len(outputs) == 16
        model = engine.snapshot().model("embed")
        assert model is not None
        assert model.recent_batches[-1][0] == 16  # sixteen parts, one batch


async def test_a_quiet_request_runs_beside_parts_not_after_one_unless_the_card_fixes_slots(
    tmp_path: Path,
) -> None:
    """Flood requests of two 300 ms texts: parts of one text, holding both
    slots. The quiet tenant's batch starts beyond them and is the first to
    end; where the card fixes the slots for an in-process runtime, it waits
    for a part to end first."""
    longer = TextInput("word " * 400)

    async def first_to_end_is_quiet(engine: Engine, model: str) -> bool:
        stats = engine.snapshot().model(model)
        assert stats is not None
        before = len(stats.recent_batches)
        await quiet_answered_while_the_flood_runs(engine, model, [longer, longer])
        stats = engine.snapshot().model(model)
        assert stats is not None
        size, run_s = stats.recent_batches[before]
        return size == 1 and run_s < 0.1  # the short text's batch, not a 300 ms part

    async with measured_engine(tmp_path / "repo") as engine:
        assert await first_to_end_is_quiet(engine, "embed")
        assert not await first_to_end_is_quiet(engine, "fixed")


async def test_the_queue_bound_counts_a_request_not_its_parts(tmp_path: Path) -> None:
    async with measured_engine(tmp_path / "repo", max_queue=4) as engine:
        outputs = await engine.infer("embed", Task.EMBEDDING, [LONG] * 16, caller=QUIET)
        assert len(outputs) == 16


async def test_parts_hold_enough_work_to_pay_for_their_batch(tmp_path: Path) -> None:
    """Eight texts of 5 ms each beside 20 ms a batch: in quantum-sized parts
    (25 ms) a batch would spend as long on itself as on its work; one part."""
    async with measured_engine(tmp_path / "repo", warm=QUIET) as engine:
        outputs = await engine.infer("fixed-cost", Task.EMBEDDING, [LONG] * 8, caller=FLOOD)
        assert len(outputs) == 8
        stats = engine.snapshot().model("fixed-cost")
        assert stats is not None
        assert stats.recent_batches[-1][0] == 8
