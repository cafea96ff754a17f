"""OpenAI's embeddings: texts (never token ids) in, vectors out, as floats or
base64, shortened to ``dimensions`` where a model allows it."""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tessera.errors import InvalidInputError
from tessera.gateway.common import (
    JsonBodyRoute,
    engine_of,
    run_task,
)
from tessera.tasks.types import (
    InputLimits,
    Task,
    TextInput,
    work_units,
)

# Bodies are JSON whatever their content type (``JsonBodyRoute``).
router = APIRouter(route_class=JsonBodyRoute)


def texts_of(value: str | list[str], field: str = "input") -> list[str]:
    """A string or a list of strings, none empty."""
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise InvalidInputError(f"{field} must not be empty")
    for i, text in enumerate(texts):
        if not text.strip():
            raise InvalidInputError(f"{field}[{i}] must not be an empty string")
    return texts


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _not_token_ids(cls, value: object) -> object:
        return text_not_token_ids(
            value,
            "each model counts its own tokens;"
            " LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False",
        )


def text_not_token_ids(value: object, advice: str) -> object:
    """OpenAI's API also takes token ids (tiktoken's, which some clients send
    by default); each model here has a tokenizer of its own."""
    if isinstance(value, list) and value and all(_token_ids(v) for v in value):
        raise ValueError(f"token ids are not taken as input: send the text ({advice})")
    return value


def _token_ids(value: object) -> bool:
    """An int, or a non-empty list of ints: a token id, or a text as token ids."""
    if isinstance(value, list):
        return bool(value) and all(_token_ids(v) and not isinstance(v, list) for v in value)
    return isinstance(value, int) and not isinstance(value, bool)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    items = [TextInput(t) for t in texts_of(body.input)]
    vectors = await run_task(request, body.model, Task.EMBEDDING, items)
    limits = engine_of(request).spec(body.model).inputs
    # orjson writes float32 arrays directly: about 15x faster than json on 384 floats.
    return Response(
        orjson.dumps(
            embeddings_body(body, items, vectors, limits), option=orjson.OPT_SERIALIZE_NUMPY
        ),
        media_type="application/json",
    )


def shortened(matrix: np.ndarray[Any, Any], dimensions: int) -> np.ndarray[Any, Any]:
    """The first ``dimensions`` of each row (OpenAI's ``dimensions``); rows of
    unit length are scaled to unit length again, as OpenAI's shortened
    embeddings are. 400 for more dimensions than the model gives."""
    if dimensions > matrix.shape[1]:
        raise InvalidInputError(
            f"dimensions is {dimensions}; this model's embeddings have {matrix.shape[1]}"
        )
    unit = np.abs(np.linalg.norm(matrix, axis=1) - 1.0) < 1e-3
    rows = matrix[:, :dimensions]
    return unit_rows(rows) if dimensions < matrix.shape[1] and unit.all() else rows


def unit_rows(matrix: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Each row scaled to unit length (a zero row stays zero)."""
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    rows: np.ndarray[Any, Any] = matrix / np.maximum(norms, np.finfo(np.float32).tiny)
    return rows


def embedding_matrix(vectors: list[Any], dimensions: int | None) -> np.ndarray[Any, Any]:
    """A model's vectors as float32 rows, ``shortened`` to ``dimensions`` if given."""
    matrix = np.stack([np.asarray(v, dtype=np.float32) for v in vectors])
    return matrix if dimensions is None else shortened(matrix, dimensions)


def embeddings_body(
    body: EmbeddingRequest, items: list[TextInput], vectors: list[Any], limits: InputLimits
) -> dict[str, Any]:
    """The answer (its float vectors numpy rows, for orjson)."""
    matrix = embedding_matrix(vectors, body.dimensions)
    data: list[dict[str, Any]] = []
    for index, row in enumerate(matrix):
        embedding: Any = (
            base64.b64encode(row.astype("<f4").tobytes()).decode()
            if body.encoding_format == "base64"
            else row
        )
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = int(sum(work_units(i, limits) for i in items))  # as charged: to the window
    return {
        "object": "list",
        "data": data,
        "model": body.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
