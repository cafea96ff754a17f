"""A gateway in front of engines on Ray: a normal tessera gateway whose models run elsewhere.

The gateway keeps everything a tenant meets: authentication, admission (shared
across gateways through Redis and PostgreSQL when configured), the per-tenant
fair queue, batching, deadlines, audit and metrics. Each model's batches are
forwarded, whole, to the engine actor the ``Router`` picks (``RayEngines``):
its models are served by the ``cluster`` runtime below, which holds no bytes
here and whose ``run`` waits for the remote engine. The engine actors keep
their own residency, batching and budget for their device.

What a tenant costs (``tessera.costs``): a forwarded batch carries its items'
tenants, and the engine that ran it answers with the device time its own
batches ran for it (not the gateway's wait, which holds that engine's queue
and the network); the gateway's engine splits that among the batch's
requests by units, as it does a local batch's run. The engines attribute
their models' memory to those tenants, and the gateways write it down as
they poll the engines' reports (``RayEngines.drain_memory``).

So the gateway's own ``Engine`` is the single-device engine with one change of
runtime: ``gateway_repository`` rewrites each model's spec to run through the
cluster, and ``window`` batches of each model may be in flight at once (the
batcher's concurrency), since they wait on other machines, not on this one's
cores.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from tessera.cluster.client import RayEngines
from tessera.engine import EngineConfig
from tessera.errors import ModelUnavailableError
from tessera.footprint import Footprint
from tessera.repository import ModelRepository
from tessera.repository.spec import ModelSpec
from tessera.request import item_tenants
from tessera.runtimes.base import LoadContext, RemoteRun

CLUSTER_RUNTIME = "cluster"


class ClusterModel:
    """One model as a gateway sees it: a ``RemoteModel`` whose batches run on
    the engine actors (``run_remote`` is called on a compute thread; the
    routing runs on the gateway's event loop). Each batch goes with its
    items' tenants, and comes back with the device time it took there."""

    def __init__(self, engines: RayEngines, loop: asyncio.AbstractEventLoop, spec: ModelSpec):
        self._engines = engines
        self._loop = loop
        self._key = spec.key
        self._task = spec.task

    def run_remote(self, items: Sequence[Any]) -> RemoteRun:
        tenants = item_tenants(len(items))
        call = self._engines.infer(self._key, self._task, list(items), tenants=tenants)
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()

    def run(self, items: Sequence[Any]) -> list[Any]:
        return self.run_remote(items).outputs

    def memory(self) -> Footprint:
        return Footprint(0, method="remote")

    def unload(self) -> None:
        return


class ClusterLoader:
    """Loads the ``cluster`` runtime's models: nothing to read, nothing held here."""

    def __init__(self, engines: RayEngines) -> None:
        self._engines = engines

    def estimate_bytes(self, spec: ModelSpec) -> int:
        return 0

    def shared_keys(self, spec: ModelSpec) -> tuple[str, ...]:
        return ()

    def load(self, spec: ModelSpec, ctx: LoadContext) -> ClusterModel:
        if self._engines.loop is None:
            raise ModelUnavailableError(spec.key, "the cluster is not connected yet")
        return ClusterModel(self._engines, self._engines.loop, spec)


def gateway_repository(repository: ModelRepository) -> ModelRepository:
    """The same models, each served through the cluster runtime."""
    return ModelRepository(
        dataclasses.replace(
            spec,
            runtime=CLUSTER_RUNTIME,
            adapter=CLUSTER_RUNTIME,
            isolation="inline",
            preload=False,
        )
        for name in repository.names()
        for spec in repository.versions(name)
    )


def gateway_config(engines: EngineConfig, window: int) -> EngineConfig:
    """The gateway's own engine: the engines' queueing and scheduling settings,
    ``window`` batches of each model in flight (threads that wait, not compute),
    no budget of its own to speak of (its models hold nothing), nothing preloaded."""
    return dataclasses.replace(
        engines,
        device="cpu",
        num_threads=window,
        num_workers=window,
        memory_budget_bytes=None,
        preload=(),
        long_batch_s=None,
        cache_dir=None,
    )
