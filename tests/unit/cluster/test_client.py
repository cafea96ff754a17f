"""A gateway's side of the cluster (``RayEngines``) over fake engine actors that
answer as Ray's do (awaitable calls; a dead actor's calls raise
``RayActorError``), on a fake clock: routing follows the reports, a dead
engine's request is re-routed and its models placed again, a late report is
not a death; the memory an engine reports goes to one gateway; and the
gateway's view of the repository and its engine, which charges the device
time an engine reported for a batch."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import RayActorError

from builders import write_fake_repository
from tessera.admission import TenantLimits
from tessera.clock import FakeClock
from tessera.cluster import DeviceReport, ModelLoad, Router, RoutingConfig
from tessera.cluster.client import RayEngines
from tessera.cluster.gateway import (
    CLUSTER_RUNTIME,
    ClusterLoader,
    gateway_config,
    gateway_repository,
)
from tessera.cluster.routing import drain_memory
from tessera.costs import CostLedger
from tessera.engine import Caller, Engine, EngineConfig, RequestTrace
from tessera.errors import ModelUnavailableError
from tessera.repository import ModelRepository
from tessera.runtimes.base import RemoteRun
from tessera.tasks.types import Task, TextInput


class _Method:
    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> Awaitable[Any]:
        return self._fn(*args)


class FakeActor:
    """An engine actor: holds ``models``, answers each item with (its name, the
    item), reporting ``device_s`` for the batch; its engine's ledger is
    ``costs``, drained by its reports."""

    def __init__(self, name: str, clock: FakeClock, models: set[str] | None = None) -> None:
        self.name = name
        self.clock = clock
        self.models = set(models or ())
        self.dead = False
        self.slow = False
        self.served: list[str] = []
        self.loaded: list[str] = []
        self.tenants: list[list[str] | None] = []
        self.device_s = 0.0
        self.costs = CostLedger()
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
        memory = drain_memory(self.costs)
        return DeviceReport(self.name, 0.0, 0.25, 1000, 100 * len(loads), loads, memory)

    async def _infer(
        self,
        model: str,
        task: Task,
        items: list[Any],
        timeout_s: Any,
        tenants: list[str] | None = None,
    ) -> RemoteRun:
        self._check()
        self.models.add(model)
        self.served.append(model)
        self.tenants.append(tenants)
        return RemoteRun([(self.name, item) for item in items], self.device_s)

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
            assert (await engines.infer("m", Task.EMBEDDING, ["x"])).outputs == [("a", "x")]
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
        assert (await engines.infer("m", Task.EMBEDDING, ["x"])).outputs == [("b", "x")]
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
        assert (await engines.infer("m", Task.EMBEDDING, ["x"])).outputs == [("a", "x")]
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


async def test_an_engines_memory_goes_to_the_one_gateway_whose_poll_drained_it() -> None:
    clock = FakeClock()
    actor = FakeActor("a", clock, {"m"})
    first, second = await engines_over(clock, [actor]), await engines_over(clock, [actor])
    try:
        actor.costs.batch_ran("m", 0.3, [("t", 3.0)], now=0.0)
        actor.costs.batch_ran("m", 0.1, [("u", 1.0)], now=0.0)
        actor.costs.held({"m": 100}, now=0.0)
        actor.costs.held({"m": 100}, now=10.0)
        await first.poll()
        await second.poll()  # nothing new since the first drained it
        actor.costs.held({"m": 100}, now=20.0)
        await second.poll()
        from_first, from_second = first.drain_memory(), second.drain_memory()
        assert from_first == pytest.approx({("t", "m"): 750.0, ("u", "m"): 250.0})
        assert from_second == pytest.approx({("t", "m"): 750.0, ("u", "m"): 250.0})
        assert first.drain_memory() == second.drain_memory() == {}  # written down once
        drained = sum(from_first.values()) + sum(from_second.values())
        assert drained == pytest.approx(actor.costs.byte_s)
    finally:
        await first.close()
        await second.close()


async def test_a_late_reports_memory_is_taken_though_it_routes_nothing() -> None:
    clock = FakeClock()
    actor = FakeActor("a", clock, {"m"})
    engines = await engines_over(clock, [actor])
    try:
        actor.costs.held({"m": 100}, now=0.0)
        actor.costs.held({"m": 100}, now=10.0)  # nobody used m: unattributed
        actor.slow = True
        await engines.poll()  # times out after 1 s of the clock's
        assert engines.drain_memory() == {}
        await clock.sleep(60)  # the report comes, too late to route by
        assert engines.drain_memory() == {("", "m"): 1000.0}
    finally:
        await engines.close()


async def test_the_gateway_charges_the_engines_device_time_not_its_wait(tmp_path: Path) -> None:
    batching = {"max_batch_size": 8, "max_wait_ms": 50}
    repository = ModelRepository.from_folders(
        [write_fake_repository(tmp_path, {"m": {"task": "embedding", "batching": batching}})]
    )
    actor = FakeActor("a", FakeClock(), {"m"})
    actor.device_s = 0.02  # what its batch ran there, whatever the call took here
    engines = RayEngines({"a": actor}, Router(RoutingConfig()))
    await engines.start()
    engine = Engine(
        gateway_repository(repository),
        gateway_config(EngineConfig(num_threads=2), 4),
        loaders={CLUSTER_RUNTIME: ClusterLoader(engines)},
    )
    try:
        traces = {"long": RequestTrace(), "short": RequestTrace()}
        texts = {"long": "one two three four five six", "short": "one"}
        await asyncio.gather(
            *(
                engine.infer(
                    "m",
                    Task.EMBEDDING,
                    [TextInput(texts[tenant])],
                    caller=Caller(TenantLimits(tenant)),
                    trace=trace,
                )
                for tenant, trace in traces.items()
            )
        )
    finally:
        await engine.close()
        await engines.close()
    assert actor.tenants == [["long", "short"]]  # one batch, each item's tenant with it
    charged = {t: trace.charge.device_s for t, trace in traces.items() if trace.charge}
    assert sum(charged.values()) == pytest.approx(0.02)  # the engine's, split by units
    units = {t: trace.units for t, trace in traces.items()}
    assert units["long"] > units["short"]
    assert charged["long"] / charged["short"] == pytest.approx(units["long"] / units["short"])
    assert engine.costs.device_s == pytest.approx(0.02)
