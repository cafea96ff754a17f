"""One device's engine as a Ray actor, and the call that starts one per device.

Ray owns where actors run, their restarts and their health: ``start_engines``
asks for one actor per GPU (``num_gpus=1``) on GPU nodes and one with a CPU
share on the others, each preferring its node (soft affinity, so that Ray may
restart it elsewhere when the node dies). An actor serves ``infer`` (a
gateway's batch: its outputs and the device time they took here), ``load``,
``unload`` and ``report`` (its residency and load since the last report, and
the memory its engine attributed to tenants since then, drained) on its own
event loop; the gateways' ``RayEngines`` route to it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tessera.admission import TenantLimits
from tessera.cluster.routing import HELD_STATES, DeviceReport, ModelLoad, drain_memory
from tessera.engine import Caller, Engine, EngineConfig, RequestTrace
from tessera.repository import ModelRepository
from tessera.runtimes.base import RemoteRun
from tessera.tasks.types import Task

NAMESPACE = "tessera"
ACTOR_PREFIX = "tessera-engine-"


class _BusySink:
    """Sums each model's batch seconds between reports (a ``StatsSink``)."""

    def __init__(self) -> None:
        self.busy_s: dict[str, float] = {}

    def on_request(self, event: object) -> None:
        return

    def on_batch(self, model: str, size: int, run_s: float) -> None:
        self.busy_s[model] = self.busy_s.get(model, 0.0) + run_s

    def on_load(self, model: str, seconds: float, ok: bool) -> None:
        return


class EngineActor:
    """A tessera engine for one device (made a Ray actor by ``start_engines``)."""

    def __init__(self, device: str, repository: ModelRepository, config: EngineConfig) -> None:
        self._device = device
        if config.fill is None:  # the router places models: no device fills up with every one
            config = replace(config, fill=False)
        self._engine = Engine(repository, config)
        self._busy = _BusySink()
        self._engine.subscribe(self._busy)
        self._latencies: dict[str, list[float]] = {}
        self._reported_at = time.monotonic()
        self._preloaded: asyncio.Task[None] | None = None

    async def ready(self) -> str:
        """Once the models marked preload are loaded (the first call starts
        that): the engine's name."""
        if self._preloaded is None:
            self._preloaded = asyncio.create_task(self._engine.preload())
        await asyncio.shield(self._preloaded)
        return self._device

    async def infer(
        self,
        model: str,
        task: Task,
        items: Sequence[Any],
        timeout_s: float | None,
        tenants: Sequence[str] | None = None,
    ) -> RemoteRun:
        """Run a gateway's batch: the outputs, and the device-seconds this
        engine's batches ran for them (their share, ``tessera.costs``). Each
        run of consecutive items of one tenant (``tenants``, one per item;
        ``default`` without) is queued as a request of that tenant, so that
        this engine attributes its models' memory to the tenants that use them."""
        start = time.monotonic()
        calls: list[asyncio.Future[list[Any]]] = []
        traces: list[RequestTrace] = []
        for tenant, begin, end in tenant_runs(tenants or ("default",) * len(items)):
            trace = RequestTrace()
            caller = Caller(TenantLimits(tenant))
            call = self._engine.infer(
                model, task, items[begin:end], timeout_s=timeout_s, caller=caller, trace=trace
            )
            calls.append(asyncio.ensure_future(call))
            traces.append(trace)
        try:
            answers = await asyncio.gather(*calls)
        except BaseException:
            for running in calls:  # one failed: the batch fails whole, the rest stop
                running.cancel()
            raise
        self._latencies.setdefault(model, []).append(time.monotonic() - start)
        device_s = sum(t.charge.device_s for t in traces if t.charge is not None)
        return RemoteRun([output for answer in answers for output in answer], device_s)

    async def load(self, model: str) -> None:
        await self._engine.load(model)

    async def unload(self, model: str) -> bool:
        return await self._engine.unload(model)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def report(self) -> DeviceReport:
        """Residency and load since the last report (``at`` is the caller's to stamp)."""
        now = time.monotonic()
        window_s, self._reported_at = now - self._reported_at, now
        stats = self._engine.snapshot()
        models = []
        for model in stats.models:
            if model.state not in HELD_STATES and not model.queue_depth:
                continue
            latencies = sorted(self._latencies.get(model.name, ()))
            p99 = latencies[int(0.99 * (len(latencies) - 1))] if latencies else None
            models.append(
                ModelLoad(
                    model.name,
                    model.state,
                    model.weights_bytes,
                    model.queue_depth,
                    self._busy.busy_s.get(model.name, 0.0),
                    p99,
                )
            )
        self._busy.busy_s.clear()
        self._latencies.clear()
        # The memory accounted up to the snapshot above, drained: whichever
        # gateway asks gets it, and writes it down (each byte-second once).
        memory = drain_memory(self._engine.costs)
        return DeviceReport(
            self._device,
            0.0,
            window_s,
            stats.budget_bytes,
            stats.used_bytes,
            tuple(models),
            memory,
        )

    async def close(self) -> None:
        await self._engine.close()


def tenant_runs(tenants: Sequence[str]) -> list[tuple[str, int, int]]:
    """Each run of consecutive equal ``tenants``: (tenant, its first index,
    the index after its last)."""
    runs: list[tuple[str, int, int]] = []
    begin = 0
    for i in range(1, len(tenants) + 1):
        if i == len(tenants) or tenants[i] != tenants[begin]:
            runs.append((tenants[begin], begin, i))
            begin = i
    return runs


@dataclass(frozen=True, slots=True)
class EngineSlot:
    """Where one engine actor runs: a node and whether it takes a GPU there."""

    name: str
    node_id: str
    num_gpus: int
    num_cpus: float


def plan_slots(nodes: Sequence[dict[str, Any]], cpu_share: float) -> list[EngineSlot]:
    """One slot per GPU of each alive node, or one with ``cpu_share`` CPUs on a
    node without GPUs (``nodes`` as ``ray.nodes()`` returns them)."""
    slots: list[EngineSlot] = []
    for node in sorted(nodes, key=lambda n: str(n["NodeID"])):
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        num_gpus = int(resources.get("GPU", 0))
        for _ in range(max(1, num_gpus)):
            name = f"{ACTOR_PREFIX}{len(slots)}"
            if num_gpus:
                slots.append(EngineSlot(name, node["NodeID"], 1, 1.0))
            else:
                slots.append(EngineSlot(name, node["NodeID"], 0, cpu_share))
    return slots


def start_engines(
    repository: ModelRepository,
    config: EngineConfig,
    *,
    cpu_share: float = 1.0,
    detached: bool = False,
    max_restarts: int = -1,
) -> dict[str, Any]:
    """Start one engine actor per slot of the connected Ray cluster; returns
    their handles by name (named in the ``tessera`` namespace, so that gateways
    find them: ``find_engines``)."""
    handles: dict[str, Any] = {}
    remote = ray.remote(EngineActor)
    for slot in plan_slots(ray.nodes(), cpu_share):  # type: ignore[no-untyped-call]
        handles[slot.name] = remote.options(
            name=slot.name,
            namespace=NAMESPACE,
            lifetime="detached" if detached else None,
            num_gpus=slot.num_gpus,
            num_cpus=slot.num_cpus,
            max_restarts=max_restarts,
            max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(slot.node_id, soft=True),
        ).remote(slot.name, repository, config)
    return handles


def find_engines() -> dict[str, Any]:
    """The engine actors running in the connected cluster, by name."""
    names = [
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == NAMESPACE and entry["name"].startswith(ACTOR_PREFIX)
    ]
    return {name: ray.get_actor(name, namespace=NAMESPACE) for name in sorted(names)}
