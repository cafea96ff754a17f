"""OpenAI's models: those the caller may use."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tessera.errors import ModelNotFoundError
from tessera.gateway.common import (
    engine_of,
    visible_current,
    visible_models,
)
from tessera.metrics.stats import ModelStats

router = APIRouter()


def _model_object(model_id: str, model: ModelStats) -> dict[str, Any]:
    """``model`` as OpenAI's model object, named ``model_id``."""
    return {
        "id": model_id,
        "object": "model",
        "created": 0,
        "owned_by": "tessera",
        "task": model.task,
        "state": model.state,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    models = [_model_object(model.model, model) for model in visible_current(request)]
    return JSONResponse({"object": "list", "data": models})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    """One model (the OpenAI client's ``models.retrieve``); 404 for a model
    the caller may not use, as for one that does not exist. ``model@version``
    is that version, while it is served."""
    if model.partition("@")[0] not in visible_models(request):
        raise ModelNotFoundError(model)
    engine = engine_of(request)
    engine.spec(model)  # ModelNotFoundError for a version not served (one rolling out)
    found = engine.snapshot().model(model)
    if found is None:
        raise ModelNotFoundError(model)
    return JSONResponse(_model_object(model, found))
