"""OpenAI's models: those the caller may use."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tessera.errors import ModelNotFoundError
from tessera.gateway.common import (
    engine_of,
    visible_models,
)

router = APIRouter()


def _model_objects(request: Request) -> list[dict[str, Any]]:
    """The models the caller may use, as OpenAI's model objects."""
    allowed = set(visible_models(request))
    return [
        {
            "id": model.name,
            "object": "model",
            "created": 0,
            "owned_by": "tessera",
            "task": model.task,
            "state": model.state,
        }
        for model in engine_of(request).snapshot().models
        if model.name in allowed
    ]


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": _model_objects(request)})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    """One model (the OpenAI client's ``models.retrieve``); 404 for a model
    the caller may not use, as for one that does not exist."""
    for found in _model_objects(request):
        if found["id"] == model:
            return JSONResponse(found)
    raise ModelNotFoundError(model)
