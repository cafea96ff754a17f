"""Probes: liveness, readiness (the server's), and a model's readiness, in the
KServe v2 / Open Inference Protocol paths that Kubernetes and Triton clients use."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tessera.gateway.common import engine_of, visible_models

router = APIRouter()


@router.get("/v2/health/live")
async def live() -> Response:
    return Response(status_code=200)


@router.get("/v2/health/ready")
async def ready(request: Request) -> Response:
    return Response(status_code=200 if engine_of(request).ready else 503)


@router.get("/v2/models/{name}/ready", response_model=None)
@router.get("/v2/models/{name}/versions/{version}/ready", response_model=None)
async def model_ready(name: str, request: Request, version: str | None = None) -> Response:
    """200 when the model can serve now: resident, or loadable on demand (not failed)."""
    engine = engine_of(request)
    if name not in visible_models(request):
        return Response(status_code=404)
    model = engine.snapshot().model(name)
    return Response(status_code=503 if model is not None and model.state == "failed" else 200)
