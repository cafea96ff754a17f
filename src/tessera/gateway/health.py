"""Probes: liveness, readiness (the server's), and a model's readiness, in the
KServe v2 / Open Inference Protocol paths that Kubernetes and Triton clients use."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tessera.errors import ModelNotFoundError
from tessera.gateway.common import engine_of, visible_models

router = APIRouter()


@router.get("/v2/health/live")
async def live() -> Response:
    return Response(status_code=200)


@router.get("/v2/health/ready")
async def ready(request: Request) -> JSONResponse:
    """200 when the server can serve, 503 while it starts (preloads) or drains
    (stops). A model that failed to load is that model's state, named here but
    not the server's: the others serve, and it is retried on demand.

    A lost admission store (Redis) is ``degraded``, still 200: every gateway
    loses it at once, so a 503 would take them all out of the load balancer
    for a fault each works around (it admits on its share of the limits)."""
    engine = engine_of(request)
    snapshot = engine.snapshot()
    failed = [m.name for m in snapshot.models if m.state == "failed"]
    status = engine.phase
    if status == "ready" and snapshot.admission_degraded:
        status = "degraded"
    body = {"ready": engine.ready, "status": status, "failed_models": failed}
    return JSONResponse(body, status_code=200 if engine.ready else 503)


@router.get("/v2/models/{name}/ready", response_model=None)
@router.get("/v2/models/{name}/versions/{version}/ready", response_model=None)
async def model_ready(name: str, request: Request, version: str | None = None) -> Response:
    """200 when the model can serve now: resident, or loadable on demand (not failed)."""
    engine = engine_of(request)
    if name not in visible_models(request):
        return Response(status_code=404)
    if version is not None:
        try:
            engine.spec(f"{name}@{version}")
        except ModelNotFoundError:  # a version not served is not ready (KServe: 4xx)
            return Response(status_code=404)
    model = engine.snapshot().model(name)
    return Response(status_code=503 if model is not None and model.state == "failed" else 200)
