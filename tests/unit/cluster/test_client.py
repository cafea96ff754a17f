"""A gateway's side of the cluster (``RayEngines``) over fake engine actors that
answer as Ray's do (awaitable calls; a dead actor's calls raise
``RayActorError``), on a fake clock: routing follows the reports, a dead
engine's request is re-routed and its models placed again, a late report is
not a death; and the gateway's view of the repository and its engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import RayActorError

from builders import write_fake_repository
from tessera.clock import FakeClock
from tessera.cluster import DeviceReport, ModelLoad, Router, RoutingConfig
from tessera.cluster.client import RayEngines
from tessera.cluster.gateway import CLUSTER_RUNTIME, gateway_config, gateway_repository
from tessera.engine import EngineConfig
from tessera.errors import ModelUnavailableError
from tessera.repository import ModelRepository
from tessera.tasks.types import Task


class _Method:
    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> Awaitable[Any]:
        return self._fn(*args)


class FakeActor:
    """An engine actor: holds ``models``, answers each item with (its name, the item)."""

    def __init__(self, name: str, clock: FakeClock, models: set[str] | None = None) -> None:
        self.name = name
        self.clock = clock
        self.models = set(models or ())
        self.dead = False
        self.slow = False
        self.served: list[str] = []
        self.loaded: list[str] = []
        self.ready = _Method(self._ready)
        self.report = _Method(self._report)
        self.infer = _Method(self._infer)
        self.load = _Method(self._load)
        self.unload = _Method(self._unload)

    def _check(self) -> None:
        if self.dead:
            raise RayActorError()

    async def _ready(self) -> str:
        self._check()
        return self.name

    async def _report(self) -> DeviceReport:
        self._check()
        if self.slow:
            await self.clock.sleep(60)
        loads = tuple(ModelLoad(m, "ready", 100, 0) for m in sorted(self.models))
        return DeviceReport(self.name, 0.0, 0.25, 1000, 100 * len(loads), loads)

    async def _infer(self, model: str, task: Task, items: list[Any], timeout_s: Any) -> list[Any]:
        self._check()
        self.models.add(model)
        self.served.append(model)
        return [(self.name, item) for item in items]

    async def _load(self, model: str) -> None:
        self._check()
        self.loaded.append(model)
        self.models.add(model)

    async def _unload(self, model: str) -> bool:
        self.models.discard(model)
        return True


async def engines_over(clock: FakeClock, actors: list[FakeActor]) -> RayEngines:
    engines = RayEngines(
        {a.name: a for a in actors}, Router(RoutingConfig()), clock=clock, report_timeout_s=1.0
    )
    await engines.start()
    return engines


async def test_requests_go_to_the_engine_that_holds_the_model() -> None:
    clock = FakeClock()
    a, b = FakeActor("a", clock, {"m"}), FakeActor("b", clock)
    engines = await engines_over(clock, [a, b])
    try:
        for _ in range(5):
            assert await engines.infer("m", Task.EMBEDDING, ["x"]) == [("a", "x")]
        assert engines.counts.num_requests == engines.counts.num_resident == 5
        assert engines.stats()["replicas"]["m"] == ["a"]
    finally:
        await engines.close()


async def test_a_dead_engines_request_is_rerouted_and_its_models_placed_again() -> None:
    clock = FakeClock()
    a, b = FakeActor("a", clock, {"m"}), FakeActor("b", clock)
    engines = await engines_over(clock, [a, b])
    try:
        a.dead = True
        assert await engines.infer("m", Task.EMBEDDING, ["x"]) == [("b", "x")]
        assert engines.counts.num_rerouted == 1
        assert engines.counts.num_lost == 0
        stats = engines.stats()
        assert [(e["name"], e["alive"]) for e in stats["engines"]] == [("a", False), ("b", True)]
        await asyncio.sleep(0)  # the placement's load call
        assert b.loaded == ["m"]  # used a moment ago: placed again at once
    finally:
        await engines.close()


async def test_with_every_engine_dead_a_request_gets_503() -> None:
    clock = FakeClock()
    a = FakeActor("a", clock, {"m"})
    engines = await engines_over(clock, [a])
    try:
        a.dead = True
        with pytest.raises(ModelUnavailableError, match="no engine could serve it"):
            await engines.infer("m", Task.EMBEDDING, ["x"])
        assert engines.counts.num_lost == 1
    finally:
        await engines.close()


async def test_a_late_report_is_not_a_death() -> None:
    clock = FakeClock()
    a, b = FakeActor("a", clock, {"m"}), FakeActor("b", clock)
    engines = await engines_over(clock, [a, b])
    try:
        a.slow = True
        await engines.poll()  # a's report times out
        assert all(e["alive"] for e in engines.stats()["engines"])
        assert await engines.infer("m", Task.EMBEDDING, ["x"]) == [("a", "x")]
    finally:
        await engines.close()


def test_the_gateway_serves_every_version_through_the_cluster(tmp_path: Path) -> None:
    model = {"task": "embedding", "preload": True, "version_policy": {"all": {}}}
    root = write_fake_repository(tmp_path, {"m": model})
    for version in (1, 2):
        (root / "m" / str(version)).mkdir()
        (root / "m" / str(version) / "model.yaml").write_text("{}")
    repository = gateway_repository(ModelRepository.from_folders([root]))
    specs = repository.versions("m")
    assert [s.key for s in specs] == ["m@1", "m@2"]
    assert {(s.runtime, s.adapter, s.isolation, s.preload) for s in specs} == {
        (CLUSTER_RUNTIME, CLUSTER_RUNTIME, "inline", False)
    }


def test_the_gateways_engine_waits_rather_than_computes() -> None:
    config = gateway_config(EngineConfig(num_threads=2, memory_budget_bytes=1 << 30), 16)
    assert (config.num_threads, config.num_workers) == (16, 16)
    assert config.preload == ()
    assert config.long_batch_s is None
    assert config.device == "cpu"
