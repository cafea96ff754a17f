"""KServe v2 over HTTP: server and model metadata, model configuration, the
model repository extension (index, load, unload) and statistics.

Triton's statistics extension (``/v2/models/stats``, ``.../{name}/stats``,
``tritonclient``'s ``get_inference_statistics``) reports each version's
requests since start from its engine: answered (``success``), failed,
their time queued, the run time of the batches they ran in
(``compute_infer``), and per batch size its batches; tessera does not time
the input and output conversions apart, so ``compute_input`` and
``compute_output`` count the answered requests at 0 ns, and there is no
response cache (``cache_hit``, ``cache_miss``: 0).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tessera import __version__
from tessera.errors import (
    InvalidInputError,
    ModelNotFoundError,
    TesseraError,
)
from tessera.gateway.common import (
    engine_of,
    visible_current,
    visible_models,
)
from tessera.gateway.errors import KSERVE, error_headers, status_of
from tessera.gateway.kserve_tensor import NUMERIC_DTYPES, json_object
from tessera.gateway.triton_llm import (
    EXTRA_OUTPUTS,
    PROMPT,
    SAMPLING_PARAMETERS,
    TEXT,
)
from tessera.metrics.stats import Durations, ModelStats
from tessera.repository.spec import ModelSpec
from tessera.tasks.types import (
    Task,
)

router = APIRouter()


def kserve_error(error: TesseraError) -> JSONResponse:
    status, _kind = status_of(error, KSERVE)
    return JSONResponse({"error": str(error)}, status_code=status, headers=error_headers(error))


@router.get("/v2")
async def server_metadata() -> JSONResponse:
    return JSONResponse(
        {
            "name": "tessera",
            "version": __version__,
            "extensions": [
                "binary_tensor_data",
                "model_configuration",
                "model_repository",
                "statistics",
                "generate",
            ],
        }
    )


@router.get("/v2/models/stats", response_model=None)
@router.get("/v2/models/{name}/stats", response_model=None)
@router.get("/v2/models/{name}/versions/{version}/stats", response_model=None)
async def model_statistics(
    request: Request, name: str | None = None, version: str | None = None
) -> Response:
    """Every version of the models the caller may use, of ``name``, or of one
    version of it (Triton's statistics extension: module notes)."""
    allowed = set(visible_models(request))
    if name is not None:
        if name not in allowed:
            return kserve_error(ModelNotFoundError(name))
        allowed = {name}
    found = [
        model
        for model in engine_of(request).snapshot().models
        if model.model in allowed and version in (None, model.version)
    ]
    if name is not None and not found:
        return kserve_error(ModelNotFoundError(versioned(name, version)))
    return JSONResponse({"model_stats": [_statistics(model) for model in found]})


def _statistics(model: ModelStats) -> dict[str, Any]:
    times = model.times
    answered = times.answered.count

    def span(durations: Durations) -> dict[str, int]:
        return {"count": durations.count, "ns": round(durations.seconds * 1e9)}

    def untimed(count: int) -> dict[str, int]:
        return {"count": count, "ns": 0}

    return {
        "name": model.model,
        "version": model.version,
        "last_inference": round((times.last_batch_at or 0.0) * 1000),
        "inference_count": sum(size * runs.count for size, runs in times.batches),
        "execution_count": sum(runs.count for _, runs in times.batches),
        "inference_stats": {
            "success": span(times.answered),
            "fail": span(times.failed),
            "queue": span(times.queued),
            "compute_input": untimed(answered),
            "compute_infer": span(times.run),
            "compute_output": untimed(answered),
            "cache_hit": untimed(0),
            "cache_miss": untimed(0),
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": untimed(runs.count),
                "compute_infer": span(runs),
                "compute_output": untimed(runs.count),
            }
            for size, runs in times.batches
        ],
        "memory_usage": [],
    }


def io_metadata(spec: ModelSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    inputs = [_tensor_metadata("TEXT", "BYTES", -1)]
    score = _tensor_metadata("SCORE", "FP32", -1)
    if spec.task is Task.EMBEDDING:
        return inputs, [_tensor_metadata("EMBEDDING", "FP32", -1, -1)]
    if spec.task is Task.CLASSIFY:
        return inputs, [_tensor_metadata("LABEL", "BYTES", -1), score]
    if spec.task is Task.TRANSLATE:
        return inputs, [_tensor_metadata("TRANSLATION", "BYTES", -1)]
    if spec.task is Task.RERANK:
        return [_tensor_metadata("QUERY", "BYTES", 1), *inputs], [score]
    if spec.task is Task.GENERATE:
        extras = [_tensor_metadata(extra.name, extra.datatype, -1) for extra in EXTRA_OUTPUTS]
        prompt, text = _tensor_metadata(PROMPT, "BYTES", -1), _tensor_metadata(TEXT, "BYTES", -1)
        return [prompt, *_GENERATE_INPUTS], [text, *extras]
    if spec.task is Task.OCR:
        return [_tensor_metadata("IMAGE", "BYTES", -1)], _OCR_OUTPUTS
    if spec.task is Task.TTS:
        return [_tensor_metadata("TEXT", "BYTES", 1)], _TTS_OUTPUTS
    return [], []


def _tensor_metadata(name: str, datatype: str, *shape: int) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": list(shape)}


_OCR_OUTPUTS = [
    _tensor_metadata("TEXT", "BYTES", -1),
    _tensor_metadata("LINE_TEXT", "BYTES", -1),
    _tensor_metadata("LINE_SCORE", "FP32", -1),
    _tensor_metadata("LINE_BOX", "FP32", -1, 4, 2),
    _tensor_metadata("LINE_IMAGE", "INT32", -1),
]
_TTS_OUTPUTS = [
    _tensor_metadata("AUDIO", "INT16", -1),
    _tensor_metadata("SAMPLE_RATE", "INT32", 1),
]


def _optional(name: str, datatype: str, shape: int = 1) -> dict[str, Any]:
    return {**_tensor_metadata(name, datatype, shape), "optional": True}


# A generation's parameters that may come as input tensors (any other name
# ``triton_llm`` takes may too; these are TensorRT-LLM's and the vLLM backend's).
_GENERATE_INPUTS = (
    _optional("max_tokens", "INT32"),
    _optional("temperature", "FP32"),
    _optional("top_p", "FP32"),
    _optional("stop_words", "BYTES", -1),
    _optional("random_seed", "UINT64"),
    _optional("stream", "BOOL"),
    _optional("exclude_input_in_output", "BOOL"),
    _optional(SAMPLING_PARAMETERS, "BYTES"),
)

# KServe datatypes as Triton's model configuration names them.
_CONFIG_TYPES = {
    "BYTES": "TYPE_STRING",
    **{datatype: f"TYPE_{datatype}" for datatype in NUMERIC_DTYPES},
}


def _config_io(tensors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "name": t["name"],
            "data_type": _CONFIG_TYPES[t["datatype"]],
            "dims": t["shape"],
            **({"optional": True} if t.get("optional") else {}),
        }
        for t in tensors
    ]


def versioned(name: str, version: str | None) -> str:
    """How the engine names ``version`` of model ``name`` (its current one if None)."""
    return name if version is None else f"{name}@{version}"


@router.get("/v2/models/{name}", response_model=None)
@router.get("/v2/models/{name}/versions/{version}", response_model=None)
async def model_metadata(name: str, request: Request, version: str | None = None) -> Response:
    spec = _visible_spec(request, name, version)
    if isinstance(spec, Response):
        return spec
    engine = engine_of(request)
    inputs, outputs = io_metadata(spec)
    return JSONResponse(
        {
            "name": spec.name,
            "versions": [v.version_label for v in engine.versions(name)],
            "platform": f"tessera_{spec.runtime}",
            "inputs": inputs,
            "outputs": outputs,
        }
    )


def _visible_spec(request: Request, name: str, version: str | None) -> ModelSpec | Response:
    """The spec of ``name`` (at ``version``) if the caller may use it, else the 404."""
    if name not in visible_models(request):
        return kserve_error(ModelNotFoundError(name))
    try:
        return engine_of(request).spec(versioned(name, version))
    except ModelNotFoundError as e:
        return kserve_error(e)


@router.get("/v2/models/{name}/config", response_model=None)
@router.get("/v2/models/{name}/versions/{version}/config", response_model=None)
async def model_config(name: str, request: Request, version: str | None = None) -> Response:
    """Triton's model configuration extension (``tritonclient``'s
    ``get_model_config``), in Triton's JSON form. Shapes are the metadata's,
    batch dimension included, so ``max_batch_size`` reads 0 as Triton has it
    for such models; tessera's own batching is under ``parameters``."""
    spec = _visible_spec(request, name, version)
    if isinstance(spec, Response):
        return spec
    inputs, outputs = io_metadata(spec)
    batching = {
        "max_batch_size": spec.batching.max_batch_size,
        "max_wait_ms": spec.batching.max_wait_ms,
    }
    return JSONResponse(
        {
            "name": spec.name,
            "version": spec.version_label,
            "platform": f"tessera_{spec.runtime}",
            "backend": "tessera",
            "max_batch_size": 0,
            "input": _config_io(inputs),
            "output": _config_io(outputs),
            "parameters": {
                f"tessera_batching_{key}": {"string_value": f"{value:g}"}
                for key, value in batching.items()
            },
        }
    )


@router.post("/v2/repository/index", response_model=None)
async def repository_index(request: Request) -> Response:
    """Triton's model repository extension, its index only (``tritonclient``'s
    ``get_model_repository_index``): every model the caller may use, its
    current version, and ``READY`` for one resident now, else ``UNAVAILABLE``
    (it loads on its first request). Loads and unloads are the admin API's."""
    ready_only = await _ready_only(request)
    return JSONResponse(
        [
            {
                "name": model.model,
                "version": model.version,
                "state": "READY" if model.state == "ready" else "UNAVAILABLE",
            }
            for model in visible_current(request)
            if model.state == "ready" or not ready_only
        ]
    )


async def _ready_only(request: Request) -> bool:
    """The index request's ``ready`` (Triton's: only the models ready now); an
    empty or absent body asks for every model."""
    body = await request.body()
    if not body.strip():
        return False
    try:
        asked = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise InvalidInputError("the index request must be a JSON object") from e
    ready = json_object(asked, "the index request").get("ready", False)
    if not isinstance(ready, bool):
        raise InvalidInputError("ready must be true or false")
    return ready


@router.post("/v2/repository/models/{name}/load", response_model=None)
async def repository_load(name: str, request: Request) -> Response:
    """Triton's model repository extension, load (``tritonclient``'s
    ``load_model``; an admin key): ``name``'s current version made resident
    now, where it would load on its first request anyway. A ``config`` or
    model files are refused: models come from their cards (``POST
    /admin/models``)."""
    return await _repository_call(name, request, "load", frozenset(), engine_of(request).load)


@router.post("/v2/repository/models/{name}/unload", response_model=None)
async def repository_unload(name: str, request: Request) -> Response:
    """Triton's model repository extension, unload (``unload_model``; an admin
    key): ``name`` evicted now. It stays served, and loads again on its next
    request, as every model here does; ``unload_dependents`` asks nothing more
    (no model here depends on another)."""
    allowed = frozenset({"unload_dependents"})
    return await _repository_call(name, request, "unload", allowed, engine_of(request).unload)


async def _repository_call(
    name: str,
    request: Request,
    verb: str,
    allowed: frozenset[str],
    action: Callable[[str], Awaitable[object]],
) -> Response:
    """``action`` (``verb``) on a model the caller may use, its body's
    parameters among ``allowed``."""
    try:
        parameters = _repository_parameters(await request.body())
        if set(parameters) - allowed:
            takes = " and ".join(sorted(allowed)) + " alone" if allowed else "no parameters"
            raise InvalidInputError(
                f"{verb} takes {takes} here, given {sorted(parameters)}:"
                " a model's config and files come from its card (POST /admin/models)"
            )
        if name not in visible_models(request):
            raise ModelNotFoundError(name)
        await action(name)
    except TesseraError as e:
        return kserve_error(e)
    return JSONResponse({})


def _repository_parameters(body: bytes) -> dict[str, Any]:
    """A load or unload body's ``parameters`` (an empty body has none)."""
    if not body.strip():
        return {}
    try:
        given = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise InvalidInputError("the body is not valid JSON") from e
    if not isinstance(given, dict) or set(given) - {"parameters"}:
        raise InvalidInputError('the body is {"parameters": {...}} or empty')
    return json_object(given.get("parameters"), "parameters")
