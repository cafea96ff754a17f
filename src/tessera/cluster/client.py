"""A gateway's way to the engine actors: reports in, requests out, through the Router.

Every ``report_interval_s`` it asks each engine actor for its report and feeds
the ``Router``, then carries out the router's decisions (load a replica, unload
a dropped one). ``infer`` routes a batch to a device, and when that device's
actor dies (its node gone) it tells the router, which places that device's
recent models again, and sends the batch elsewhere: a request is lost only
when every try failed so. Inference has no side effect on the engine, and the
gateway charges the tenant once whatever the tries, so a request that had
started on the dead device is simply run again.

What a tenant costs (``tessera.costs``): an engine answers a batch with the
device time its own batches ran for it, which the gateway's engine charges;
and each report carries the memory that engine attributed to tenants since
it last reported to any gateway, which this gateway keeps until its audit
log takes it (``drain_memory``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from tessera.clock import Clock, MonotonicClock
from tessera.cluster.routing import AddReplica, DeviceReport, Router
from tessera.errors import ModelUnavailableError
from tessera.runtimes.base import RemoteRun
from tessera.tasks.types import Task

log = logging.getLogger(__name__)


@dataclass
class RoutingCounts:
    """What this gateway routed: requests, those sent where the model was
    ready (by the device's last report), and tries re-routed from a dead device."""

    num_requests: int = 0
    num_resident: int = 0
    num_rerouted: int = 0
    num_lost: int = 0
    replicas_added: int = 0
    replicas_dropped: int = 0


class RayEngines:
    """The engine actors behind one gateway (see the module notes)."""

    def __init__(
        self,
        actors: dict[str, Any],
        router: Router,
        *,
        clock: Clock | None = None,
        max_tries: int = 3,
        report_timeout_s: float = 5.0,
        ready_timeout_s: float = 300.0,
    ) -> None:
        self._actors = dict(actors)
        self._dead: set[str] = set()
        self.router = router
        self._clock = clock or MonotonicClock()
        self._max_tries = max_tries
        self._report_timeout_s = report_timeout_s
        self._ready_timeout_s = ready_timeout_s
        self._reports: dict[str, DeviceReport] = {}
        self._bytes: dict[str, int] = {}
        self._memory: dict[tuple[str, str], float] = {}  # reported, not yet drained
        self._poller: asyncio.Task[None] | None = None
        self._background: set[asyncio.Future[Any]] = set()
        self.counts = RoutingCounts()
        self.loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Read every engine's report once, then keep reading them (on the
        running loop, which ``infer`` must be called on: ``loop``)."""
        self.loop = asyncio.get_running_loop()
        await self._clock.wait_for(
            asyncio.gather(*(actor.ready.remote() for actor in self._actors.values())),
            self._ready_timeout_s,
        )
        await self.poll()
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def report_of(self, device: str) -> DeviceReport | None:
        return self._reports.get(device)

    def stats(self) -> dict[str, Any]:
        """What ``/admin/cluster`` shows: each engine's last report, each model's
        replicas, and what this gateway routed."""
        now = self._clock.now()
        engines: list[dict[str, Any]] = []
        held: set[str] = set(self._bytes)
        for name in sorted(self._actors):
            report = self._reports.get(name)
            loads = report.models if report is not None else ()
            held.update(m.name for m in loads)
            engines.append(
                {
                    "name": name,
                    "alive": name not in self._dead,
                    "report_age_s": round(now - report.at, 3) if report else None,
                    "budget_bytes": report.budget_bytes if report else None,
                    "used_bytes": report.used_bytes if report else None,
                    "models": [dataclasses.asdict(m) for m in loads],
                }
            )
        models = sorted(held)
        counts = self.counts
        return {
            "engines": engines,
            "replicas": {m: sorted(self.router.replicas(m)) for m in models},
            "routing": dataclasses.asdict(counts),
            "resident_share": counts.num_resident / counts.num_requests
            if counts.num_requests
            else None,
        }

    async def poll(self) -> None:
        """One round: every engine's report, then the router's replicas."""
        names = list(self._actors)
        results = await asyncio.gather(
            *(self._report(name) for name in names), return_exceptions=True
        )
        now = self._clock.now()
        for name, result in zip(names, results, strict=True):
            if isinstance(result, DeviceReport):
                self._dead.discard(name)  # Ray restarted it
                report = dataclasses.replace(result, at=now)
                self._reports[name] = report
                for load in report.models:
                    if load.weights_bytes:
                        self._bytes[load.name] = load.weights_bytes
                self.router.report(report)
            elif isinstance(result, RayActorError):
                if name not in self._dead:
                    log.warning("engine %s is gone: %s", name, result)
                    self._lost(name)
            else:  # slow, not gone: its last report stands
                log.warning("engine %s gave no report: %r", name, result)
        for action in self.router.rebalance(now):
            actor = self._actors[action.device]
            if isinstance(action, AddReplica):
                self.counts.replicas_added += 1
                self._spawn(actor.load.remote(action.model))
            else:
                self.counts.replicas_dropped += 1
                self._spawn(actor.unload.remote(action.model))

    async def infer(
        self,
        model: str,
        task: Task,
        items: Sequence[Any],
        timeout_s: float | None = None,
        tenants: Sequence[str] | None = None,
    ) -> RemoteRun:
        """Run ``items`` (of ``tenants``, one per item) on ``model`` on the
        device the router picks: the outputs, and the device time they took there."""
        self.counts.num_requests += 1
        for _ in range(self._max_tries):
            device = self.router.route(model, self._bytes.get(model, 0), self._clock.now())
            if device is None:
                break
            if self._resident(device, model):
                self.counts.num_resident += 1
            try:
                answer: RemoteRun = await self._actors[device].infer.remote(
                    model, task, list(items), timeout_s, None if tenants is None else list(tenants)
                )
                return answer
            except RayActorError:
                self.counts.num_rerouted += 1
                self._lost(device)
            finally:
                self.router.answered(device)
        self.counts.num_lost += 1
        raise ModelUnavailableError(model, "no engine could serve it", retry_after_s=1.0)

    def drain_memory(self) -> dict[tuple[str, str], float]:
        """Byte-seconds per (tenant, model) the engines reported to this
        gateway since the last drain (each engine's byte-seconds go in one
        report, to one gateway: this one writes these down)."""
        drained, self._memory = self._memory, {}
        return drained

    # -- internals ----------------------------------------------------------

    async def _report(self, name: str) -> DeviceReport:
        # A report that comes after the timeout is too old to route by, but
        # the memory drained into it is taken all the same (``_take_memory``).
        answer: asyncio.Future[DeviceReport] = asyncio.ensure_future(
            self._actors[name].report.remote()
        )
        answer.add_done_callback(self._take_memory)
        self._background.add(answer)
        answer.add_done_callback(self._background.discard)
        return await self._clock.wait_for(asyncio.shield(answer), self._report_timeout_s)

    def _take_memory(self, answer: asyncio.Future[DeviceReport]) -> None:
        if answer.cancelled() or answer.exception() is not None:
            return
        report = answer.result()
        if not isinstance(report, DeviceReport):
            return
        for use in report.memory:
            key = (use.tenant, use.model)
            self._memory[key] = self._memory.get(key, 0.0) + use.byte_s

    async def _poll_forever(self) -> None:
        while True:
            await self._clock.sleep(self.router.config.report_interval_s)
            await self.poll()

    def _lost(self, device: str) -> None:
        if device in self._dead:
            return
        self._dead.add(device)
        self._reports.pop(device, None)
        for action in self.router.remove_device(device, self._clock.now()):
            self.counts.replicas_added += 1
            self._spawn(self._actors[action.device].load.remote(action.model))

    def _resident(self, device: str, model: str) -> bool:
        report = self._reports.get(device)
        return report is not None and any(
            m.name == model and m.state == "ready" for m in report.models
        )

    def _spawn(self, ref: Any) -> None:
        async def settle() -> None:
            try:
                await ref
            except Exception as e:  # a load that failed: the next report tells
                log.warning("a replica change failed: %s", e)

        task = asyncio.create_task(settle())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def connect(address: str | None = None) -> None:
    """Join a running Ray cluster (``auto``: the one this machine belongs to),
    or start a local one when ``address`` is None; usage stats off."""
    if ray.is_initialized():
        return
    ray.init(address=address, namespace="tessera", include_dashboard=False, log_to_driver=False)


def cluster_address() -> str:
    """The address other gateways join this Ray cluster by (its GCS, host:port)."""
    return str(ray.get_runtime_context().gcs_address)
