"""The HTTP app: routers, error handlers, and the engine's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.telemetry import TelemetryConfig

from tessera import __version__
from tessera.config import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from tessera.costs import CostLedger
from tessera.engine import PreloadProgress, ServingEngine
from tessera.gateway import (
    admin,
    dashboard,
    deepl_api,
    health,
    kserve,
    kserve_repository,
    ollama_api,
    openai_audio,
    openai_chat,
    openai_completions,
    openai_embeddings,
    openai_models,
    responses_api,
    tasks_api,
    tei_api,
    tenants_admin,
    websocket,
)
from tessera.gateway.common import BodyLimitMiddleware
from tessera.gateway.context import RequestContextMiddleware
from tessera.gateway.errors import UnexpectedErrorMiddleware, install_error_handlers
from tessera.gateway.fast import install_fast_routes
from tessera.gateway.forward import EngineAppForward
from tessera.gateway.observability import install_observability
from tessera.metrics import StatsSink
from tessera.repository import default_repository_path
from tessera.repository.watch import RepositoryWatcher
from tessera.scheduling import DEFAULT_TIERS, TierSpec
from tessera.tasks.image import RequestImageLimits
from tessera.tenants import AuditLog, TenantStore
from tessera.tenants.audit import MemoryRecord

if TYPE_CHECKING:
    from tessera.cluster.client import RayEngines
    from tessera.tenants.responses import ResponseStore

log = logging.getLogger(__name__)

# How long a stopping gRPC server lets its calls in flight finish.
GRPC_STOP_GRACE_S = 5.0


MEMORY_ROWS_INTERVAL_S = 10.0


def record_memory(engine: ServingEngine, costs: CostLedger, audit_log: AuditLog) -> None:
    """Audit rows of the memory each tenant's models held since the last call
    (``engine``'s ledger, ``costs``); the snapshot accounts it up to now."""
    engine.snapshot()
    write_memory(costs.drain_memory(), audit_log)


def record_cluster_memory(cluster: RayEngines, audit_log: AuditLog) -> None:
    """Audit rows of the memory the cluster's engines reported to this
    gateway since the last call (each engine's byte-seconds go to one gateway)."""
    write_memory(cluster.drain_memory(), audit_log)


def write_memory(byte_s: Mapping[tuple[str, str], float], audit_log: AuditLog) -> None:
    now = time.time()
    for (tenant, model), held in sorted(byte_s.items()):
        audit_log.record(MemoryRecord(now, tenant, model, held))


async def record_memory_every(
    record: Callable[[], None], interval_s: float = MEMORY_ROWS_INTERVAL_S
) -> None:
    while True:
        await asyncio.sleep(interval_s)
        record()


def create_app(
    engine: ServingEngine,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    image_limits: RequestImageLimits | None = None,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    tenant_store: TenantStore | None = None,
    audit_log: AuditLog | None = None,
    tiers: dict[str, TierSpec] | None = None,
    preload_progress: PreloadProgress | None = None,
    per_tenant_labels: bool = False,
    metrics_public: bool = False,
    watcher: RepositoryWatcher | None = None,
    watch_interval_s: float = 5.0,
    cluster: RayEngines | None = None,
    engine_app: Path | None = None,
    request_events: StatsSink | None = None,
    response_store: ResponseStore | None = None,
    model_roots: Sequence[Path] | None = None,
    admin_changes: bool = True,
) -> FastAPI:
    """An app serving ``engine``; preloading starts with the app and runs in the
    background, so liveness answers at once and readiness once it is done.
    With a ``tenant_store`` every route but the health probes (and the live
    page's static files, and ``/metrics`` if ``metrics_public``) needs an API key.
    With a ``watcher``, once preloading is over, the repository folders it
    watches are polled every ``watch_interval_s`` for new models and versions.
    With a ``cluster`` (the engine actors that ``engine``'s models run on),
    their reports are read from the start, and ``/admin/cluster`` shows them.
    A gateway process's app (``gateway/split.py``) passes ``engine_app``, the
    socket of the engine process's app, which answers ``/admin``, ``/metrics``
    and the live page, and ``request_events``, where its answered requests
    are counted instead of here. A ``response_store`` keeps Responses API
    answers (``tenants/responses.py``). ``POST /admin/models`` registers only
    from ``model_roots`` (default: the packaged models' folder); without
    ``admin_changes`` an app without a tenant store refuses admin changes.
    ``image_limits`` bound a request's images (pixels and pages) from their headers."""

    async def watch_after(preload: asyncio.Task[None], watcher: RepositoryWatcher) -> None:
        await asyncio.wait({preload})  # over, whatever its outcome
        await engine.watch_repository(watcher, watch_interval_s)

    async def start() -> None:
        # Ready once the cluster's engines answer (if it routes to one), then preloaded.
        if cluster is not None:
            await cluster.start()
        await engine.preload(preload_progress)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if audit_log is not None:
            await audit_log.start()
        preload = asyncio.create_task(start(), name="preload")
        tasks = [preload]
        # The process that holds the engine writes down the memory its models
        # held for each tenant (gateway processes hold a remote one: not
        # theirs); a gateway of a cluster, the memory its engines reported.
        ledger = getattr(engine, "costs", None)
        writers: list[Callable[[], None]] = []
        if isinstance(ledger, CostLedger) and audit_log is not None:
            writers.append(functools.partial(record_memory, engine, ledger, audit_log))
        if cluster is not None and audit_log is not None:
            writers.append(functools.partial(record_cluster_memory, cluster, audit_log))
        for writer in writers:
            tasks.append(asyncio.create_task(record_memory_every(writer), name="costs"))
        if watcher is not None:
            tasks.append(asyncio.create_task(watch_after(preload, watcher), name="watch"))
        # KServe v2 over gRPC beside HTTP, where the serving side has set an address.
        grpc_server = None
        if app.state.grpc_address is not None:
            from tessera.gateway.grpc_kserve import start_grpc

            grpc_server = await start_grpc(app, *app.state.grpc_address)
        try:
            yield
        finally:
            if grpc_server is not None:  # HTTP has drained: the calls in flight get a grace
                await grpc_server.stop(GRPC_STOP_GRACE_S)
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            try:
                for writer in writers:  # the last interval's, before the models go
                    writer()
                await engine.close()
                if cluster is not None:
                    await cluster.close()
            finally:
                # The audit is flushed even if stopping the engine failed.
                if audit_log is not None:
                    await audit_log.close()
                if tenant_store is not None:
                    tenant_store.close()
                if response_store is not None:
                    response_store.close()

    # tessera's metrics are Prometheus's (gateway/observability.py); FastAPI's own
    # OpenTelemetry looked for configured providers in the environment at every
    # request (about 3% of the app's time in a cProfile) to find none.
    no_telemetry: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="tessera", version=__version__, lifespan=lifespan, telemetry=no_telemetry)
    app.state.engine = engine
    app.state.grpc_address = None  # (host, port): set by whoever serves the app
    app.state.cluster = cluster
    app.state.tenant_store = tenant_store
    app.state.audit_log = audit_log
    app.state.response_store = response_store
    app.state.model_roots = tuple(model_roots or (default_repository_path(),))
    app.state.admin_changes = admin_changes
    app.state.tiers = tiers or dict(DEFAULT_TIERS)
    install_error_handlers(app)
    app.state.max_body_bytes = max_body_bytes  # the WebSocket's message bound too
    app.state.image_limits = image_limits or RequestImageLimits()
    app.state.header_timeout_s = header_timeout_s  # and a WebSocket's wait for its key
    routers = (
        health,
        openai_embeddings,
        openai_chat,
        openai_completions,
        openai_audio,
        openai_models,
        responses_api,
        tasks_api,
        tei_api,
        deepl_api,
        ollama_api,
        websocket,
        kserve_repository,
        kserve,
        admin,
        tenants_admin,
        dashboard,
    )
    for module in routers:
        app.include_router(module.router)
    install_observability(
        app, engine, per_tenant_labels=per_tenant_labels, metrics_public=metrics_public
    )
    # The request routes, served inside the middleware below (gateway/fast.py).
    hot = (
        openai_embeddings.embeddings,
        openai_chat.chat_completions,
        openai_audio.speech,
        kserve.infer,
    )
    tasks = (tasks_api.rerank, tasks_api.classify, tasks_api.translate, tasks_api.ocr)
    hot_routers = (
        openai_embeddings.router,
        openai_chat.router,
        openai_audio.router,
        tasks_api.router,
        kserve.router,
    )
    install_fast_routes(app, hot_routers, (*hot, *tasks))
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(UnexpectedErrorMiddleware)
    app.add_middleware(RequestContextMiddleware)
    if request_events is not None:
        app.state.stats = request_events
    if engine_app is not None:
        app.add_middleware(EngineAppForward, socket_path=engine_app)  # before the rest
    return app
