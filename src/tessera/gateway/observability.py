"""``GET /metrics``, ``/admin/stats`` and ``/admin/slo``, and the wiring that feeds them.

``install_observability`` builds the sinks (Prometheus and the rolling window),
hands them to the engine, and mounts this router. ``/metrics`` needs an admin
key when the app has a tenant store, unless ``metrics_public`` (the middleware
in ``gateway.context`` checks ``app.state.metrics_public``).
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from tessera.engine import ServingEngine
from tessera.errors import ModelNotFoundError
from tessera.gateway.common import engine_of
from tessera.gateway.errors import error_body
from tessera.metrics.prometheus import DEFAULT_MAX_TENANT_LABELS, PrometheusMetrics
from tessera.metrics.rolling import RollingStats
from tessera.metrics.stats import FanoutSink

DEFAULT_SLO_OBJECTIVE = 0.99

router = APIRouter()


def _not_enabled(what: str) -> JSONResponse:
    return JSONResponse(
        error_body(404, f"{what} is not enabled on this server", "not_found"),
        status_code=404,
    )


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus exposition (text, or OpenMetrics when asked for)."""
    sink: PrometheusMetrics | None = getattr(request.app.state, "metrics", None)
    if sink is None:
        return _not_enabled("/metrics")
    # Collected on the event loop: the engine's state is only touched from it.
    body, content_type = sink.exposition(request.headers.get("accept", ""))
    return Response(body, headers={"content-type": content_type})


@router.get("/admin/stats")
async def stats(request: Request) -> JSONResponse:
    """The last window of traffic, for the live page."""
    rolling: RollingStats | None = getattr(request.app.state, "rolling", None)
    if rolling is None:
        return _not_enabled("/admin/stats")
    return JSONResponse(rolling.snapshot().to_json())


@router.get("/admin/slo")
async def slo(request: Request) -> JSONResponse:
    """Per model: its latency target, and the share of the window's answers within it."""
    rolling: RollingStats | None = getattr(request.app.state, "rolling", None)
    if rolling is None:
        return _not_enabled("/admin/slo")
    objective: float = getattr(request.app.state, "slo_objective", DEFAULT_SLO_OBJECTIVE)
    engine = engine_of(request)
    targets = {n: engine.spec(n).latency_target_ms for n in engine.model_names()}
    models = [
        {
            "name": w.name,
            "target_ms": w.target_ms,
            "requests": w.requests,
            "within_target": w.within_target,
            "share_within": w.share_within,
            "p99_ms": w.p99_ms,
            "ok": w.ok,
        }
        for w in rolling.slo(targets, objective)
    ]
    return JSONResponse({"window_s": rolling.window_s, "objective": objective, "models": models})


class ServedNames:
    """The names a model label may take: the models and versions served now
    (models registered while serving are labelled too)."""

    def __init__(self, engine: ServingEngine) -> None:
        self._engine = engine

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self._engine.spec(name)
        except ModelNotFoundError:
            return False
        return True


def install_observability(
    app: FastAPI,
    engine: ServingEngine,
    *,
    per_tenant_labels: bool = False,
    max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS,
    metrics_public: bool = False,
    window_s: float = 60.0,
    slo_objective: float = DEFAULT_SLO_OBJECTIVE,
) -> PrometheusMetrics:
    """Feed Prometheus and the rolling window from ``engine`` and the gateway, and
    serve them. Call before the app starts (it mounts routes)."""
    specs = [engine.spec(name) for name in engine.model_names()]
    targets_s = {
        spec.name: spec.latency_target_ms / 1000.0
        for spec in specs
        if spec.latency_target_ms is not None
    }
    models = ServedNames(engine)
    prometheus = PrometheusMetrics(
        engine.snapshot,
        models,
        targets_s,
        per_tenant_labels=per_tenant_labels,
        max_tenant_labels=max_tenant_labels,
    )
    rolling = RollingStats(window_s, models=models)
    fanout = FanoutSink(prometheus, rolling)  # the gateway's request events
    engine.subscribe(fanout)  # the engine's batches and loads
    app.state.metrics = prometheus
    app.state.rolling = rolling
    app.state.stats = fanout
    app.state.metrics_public = metrics_public
    app.state.slo_objective = slo_objective
    app.include_router(router)
    return prometheus
