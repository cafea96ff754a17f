"""KServe v2 / Open Inference Protocol: health, metadata and infer, JSON and the
binary tensor extension, as ``tritonclient[http]`` speaks them.

``infer`` is served for every task: embedding models (a BYTES input of texts, an FP32
``[N, D]`` output), classification models (a BYTES ``LABEL`` and an FP32
``SCORE`` output per text), translation models (a BYTES ``TRANSLATION`` per
text), rerankers (a BYTES ``QUERY`` of one element and a BYTES ``TEXT``
of documents in, an FP32 ``SCORE`` per document out) and generate models
(Triton's LLM backends' tensors: a BYTES ``text_input`` of prompts, their
parameters as scalar tensors, ``sampling_parameters`` or the request's
``parameters``, a BYTES ``text_output`` in ``text_input``'s shape; see
``triton_llm``). A model of one input takes it under any name, as before; a
reranker's and a generation's are named. OCR models read ``IMAGE``: image
files in a BYTES tensor (binary data, or base64 in JSON) or UINT8 pixels
([H, W, C] or [N, H, W, C], RGB or gray), and answer each page's ``TEXT`` and
its lines one after another (``LINE_TEXT``, ``LINE_SCORE``, ``LINE_BOX`` of
four corners, ``LINE_IMAGE``: whose); the OCR route's fields (``mode``, a
vision-language model's ``prompt``...) come as the request's parameters.
Speech models read one ``TEXT`` (``speed`` a parameter) and answer ``AUDIO``
(INT16 samples) and ``SAMPLE_RATE``. Input tensors are any of KServe's
datatypes but BF16, in JSON or binary data; a model reads those it takes.

Triton's generate extension (``.../generate``, ``.../generate_stream``): a
JSON body of ``text_input`` and parameters, a JSON answer of ``text_output``,
or server-sent events of them (a piece each where ``stream`` is true).

A generation with ``stream`` true over infer is answered as server-sent
events to a caller that accepts them (``Accept: text/event-stream``; gRPC's
``ModelStreamInfer`` asks so), one prompt only: an infer response a piece,
each with ``parameters.triton_final_response`` false, then a final one with
the extras asked for (or none, where the request's parameter
``triton_enable_empty_final_response`` asks for it). Otherwise it is a 400
that says where to stream, as Triton's HTTP infer answers a decoupled model.

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

import asyncio
import json
import math
import re
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tessera import __version__
from tessera.errors import (
    InvalidInputError,
    ModelNotFoundError,
    PayloadTooLargeError,
    TesseraError,
)
from tessera.gateway.common import (
    caller_of,
    engine_of,
    run_task,
    started_task,
    visible_models,
)
from tessera.gateway.errors import KSERVE, error_headers, reject_reason, status_of
from tessera.gateway.openai_api import Pieces, texts_of
from tessera.gateway.tasks_api import OcrOptions, ocr_item, rerank_inputs
from tessera.gateway.triton_llm import (
    EXTRA_OUTPUTS,
    PROMPT,
    SAMPLING_PARAMETERS,
    TEXT,
    GenerateParameters,
    asked_extras,
    extras_of,
    generate_items,
    generation_pieces,
    parameters_of,
    text_of,
)
from tessera.metrics.stats import Durations, ModelStats
from tessera.repository.spec import ModelSpec
from tessera.tasks.image import MAX_IMAGE_PIXELS, EncodedImage, decode_base64, read_image
from tessera.tasks.types import (
    ChatOutput,
    ClassifyOutput,
    OcrLine,
    OcrOutput,
    SpeechInput,
    SpeechOutput,
    Task,
    TextInput,
    TranslateInput,
)

router = APIRouter()

HEADER_LENGTH = "inference-header-content-length"

# KServe's numeric datatypes as numpy reads their binary data (little-endian).
_NUMERIC = {
    "BOOL": "?",
    **{f"INT{bits}": f"<i{bits // 8}" for bits in (8, 16, 32, 64)},
    **{f"UINT{bits}": f"<u{bits // 8}" for bits in (8, 16, 32, 64)},
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# The JSON values each kind of datatype takes, and what they are called (INT
# and UINT by their first letters).
_JSON_VALUES: dict[str, tuple[Callable[[object], bool], str]] = {
    "BYTES": (lambda value: isinstance(value, str), "strings"),
    "BOOL": (lambda value: isinstance(value, bool), "true or false"),
    "IN": (lambda value: _is_int(value), "integers"),
    "UI": (_is_count, "integers from 0"),
    "FP": (_is_number, "numbers"),
}


def _kserve_error(error: TesseraError) -> JSONResponse:
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
            return _kserve_error(ModelNotFoundError(name))
        allowed = {name}
    found = [
        model
        for model in engine_of(request).snapshot().models
        if model.model in allowed and version in (None, model.version)
    ]
    if name is not None and not found:
        return _kserve_error(ModelNotFoundError(_versioned(name, version)))
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


def _io_metadata(spec: ModelSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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
    **{datatype: f"TYPE_{datatype}" for datatype in _NUMERIC},
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


def _versioned(name: str, version: str | None) -> str:
    """How the engine names ``version`` of model ``name`` (its current one if None)."""
    return name if version is None else f"{name}@{version}"


@router.get("/v2/models/{name}", response_model=None)
@router.get("/v2/models/{name}/versions/{version}", response_model=None)
async def model_metadata(name: str, request: Request, version: str | None = None) -> Response:
    spec = _visible_spec(request, name, version)
    if isinstance(spec, Response):
        return spec
    engine = engine_of(request)
    inputs, outputs = _io_metadata(spec)
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
        return _kserve_error(ModelNotFoundError(name))
    try:
        return engine_of(request).spec(_versioned(name, version))
    except ModelNotFoundError as e:
        return _kserve_error(e)


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
    inputs, outputs = _io_metadata(spec)
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
    allowed = set(visible_models(request))
    ready_only = await _ready_only(request)
    return JSONResponse(
        [
            {
                "name": model.name,
                "version": model.version,
                "state": "READY" if model.state == "ready" else "UNAVAILABLE",
            }
            for model in engine_of(request).snapshot().models
            if model.name in allowed
            and model.current
            and (model.state == "ready" or not ready_only)
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
    ready = _mapping(asked, "the index request").get("ready", False)
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
        return _kserve_error(e)
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
    return _mapping(given.get("parameters"), "parameters")


def _decode_bytes_tensor(raw: bytes) -> list[bytes]:
    """The elements of a BYTES tensor's binary data, each after its 4-byte
    little-endian length."""
    elements, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidInputError("truncated BYTES tensor")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidInputError("truncated BYTES element")
        elements.append(raw[offset : offset + length])
        offset += length
    return elements


# Nesting of a tensor's ``data`` (a list per dimension); deeper is refused
# before it is walked (Python's own recursion limit is near 1,000).
MAX_TENSOR_RANK = 8


# The most input tensors one request may carry (a reranker takes two; a
# generation a prompt and its parameters, TensorRT-LLM's a tensor each).
MAX_INPUTS = 24


@dataclass(frozen=True, slots=True, eq=False)
class Tensor:
    """An input tensor: its datatype, shape, and values (flat, row-major): for
    BYTES a list of str (JSON data) or bytes (binary data), else an array of
    the datatype's numpy dtype."""

    datatype: str
    shape: tuple[int, ...]
    values: list[str] | list[bytes] | np.ndarray[Any, Any]

    def tolist(self) -> list[Any]:
        """Its values as Python's: str (BYTES as UTF-8 text), bool, int or float."""
        if isinstance(self.values, np.ndarray):
            numbers: list[Any] = self.values.tolist()
            return numbers
        return [v if isinstance(v, str) else v.decode("utf-8", "replace") for v in self.values]

    def blobs(self) -> list[bytes]:
        """A BYTES tensor's elements as bytes: binary data as sent, JSON strings
        as base64 (or ``data:`` URLs), the only way JSON carries bytes."""
        assert isinstance(self.values, list)
        return [v if isinstance(v, bytes) else decode_base64(v) for v in self.values]

    def array(self) -> np.ndarray[Any, Any]:
        """Its numbers in its shape."""
        return np.asarray(self.values).reshape(self.shape)


@dataclass(frozen=True, slots=True)
class InferRequest:
    """A KServe v2 infer body, validated: its input tensors by name, its
    parameters, and how to answer."""

    inputs: dict[str, Tensor]
    request_id: str | None
    outputs: frozenset[str]  # outputs named in the request (none: all of them)
    # Outputs whose ``binary_data`` is given: it overrides ``binary_by_default``.
    binary_outputs: dict[str, bool]
    binary_by_default: bool  # ``parameters.binary_data_output``
    parameters: dict[str, Any] = field(default_factory=dict)  # the request's own

    @property
    def texts(self) -> list[str]:
        """The texts of a request of one BYTES input (whatever its name)."""
        if len(self.inputs) != 1:
            raise InvalidInputError(
                f"this model takes one input, a BYTES tensor of texts; got {len(self.inputs)}"
            )
        ((name, tensor),) = self.inputs.items()
        return _texts(name, tensor)

    def named(self, name: str) -> list[str]:
        """The texts of BYTES input ``name``."""
        if name not in self.inputs:
            raise InvalidInputError(f"input {name!r} is missing; given {sorted(self.inputs)}")
        return _texts(name, self.inputs[name])


def _texts(name: str, tensor: Tensor) -> list[str]:
    if tensor.datatype != "BYTES":
        raise InvalidInputError(f"input {name!r} must be BYTES (texts), not {tensor.datatype}")
    return tensor.tolist()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _mapping(value: object, where: str) -> dict[str, Any]:
    """An optional JSON object (``parameters``): absent is empty."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInputError(f"{where} must be a JSON object")
    return value


def _flatten(data: object, datatype: str) -> list[Any]:
    """The values of a tensor's ``data``, nested at most MAX_TENSOR_RANK deep,
    without recursion; a value that is not of ``datatype`` is refused."""
    fits, kind = _JSON_VALUES[datatype if datatype in ("BYTES", "BOOL") else datatype[:2]]
    values: list[Any] = []
    stack: list[tuple[object, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, list):
            if depth >= MAX_TENSOR_RANK:
                raise InvalidInputError(f"data is nested deeper than {MAX_TENSOR_RANK} levels")
            stack.extend((item, depth + 1) for item in reversed(value))
        elif fits(value):
            values.append(value)
        else:
            raise InvalidInputError(
                f"a {datatype} tensor holds {kind}; data has {type(value).__name__} {value!r:.40}"
            )
    return values


def _decode_binary(name: str, datatype: str, raw: bytes) -> list[bytes] | np.ndarray[Any, Any]:
    """A tensor's values from its binary data."""
    if datatype == "BYTES":
        return _decode_bytes_tensor(raw)
    dtype = np.dtype(_NUMERIC[datatype])
    if len(raw) % dtype.itemsize:
        raise InvalidInputError(
            f"input {name!r}: {len(raw)} bytes are not whole {datatype} values"
            f" ({dtype.itemsize} bytes each)"
        )
    return np.frombuffer(raw, dtype)


def _numbers(name: str, datatype: str, values: list[Any]) -> np.ndarray[Any, Any]:
    """A tensor's JSON numbers as an array of its datatype, each in its range."""
    try:
        return np.asarray(values, dtype=_NUMERIC[datatype])
    except OverflowError as e:
        raise InvalidInputError(f"input {name!r}: a value is out of {datatype}'s range") from e


def _shape(tensor: dict[str, Any]) -> list[int]:
    shape = tensor.get("shape")
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= MAX_TENSOR_RANK
        or not all(_is_int(d) and d >= 0 for d in shape)
    ):
        raise InvalidInputError(
            f"input shape must be a list of 1 to {MAX_TENSOR_RANK} non-negative integers,"
            f" got {shape!r:.80}"
        )
    return shape


def _load_header(body: bytes, header_length: str | None) -> tuple[object, bytes]:
    """The JSON header and the binary tensor data after it."""
    split = len(body)
    if header_length is not None:
        # ASCII digits only: str.isdigit() also takes superscripts ("²"), which int() refuses.
        if not re.fullmatch(r"[0-9]{1,12}", header_length) or int(header_length) > len(body):
            raise InvalidInputError(
                f"{HEADER_LENGTH} must be a whole number of bytes within the body"
                f" ({len(body)}), got {header_length!r:.40}"
            )
        split = int(header_length)
    try:
        return json.loads(body[:split]), body[split:]
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise InvalidInputError("request header is not valid JSON") from e


def _tensor_of(tensor: dict[str, Any], binary: bytes) -> tuple[str, Tensor, int]:
    """An input tensor's name and values, checked against its shape and
    datatype, and how many bytes of ``binary`` (what follows, for the next
    input) it used."""
    name = tensor.get("name")
    if not isinstance(name, str):
        raise InvalidInputError("input name must be a string")
    datatype = tensor.get("datatype")
    if not isinstance(datatype, str) or (datatype != "BYTES" and datatype not in _NUMERIC):
        raise InvalidInputError(
            f"input {name!r} has datatype {datatype!r:.20}; KServe's are BYTES, BOOL,"
            " INT8 to INT64, UINT8 to UINT64, FP16, FP32 and FP64"
        )
    shape = _shape(tensor)
    size = _mapping(tensor.get("parameters"), f"input {name!r} parameters").get("binary_data_size")
    if size is not None:
        if not _is_int(size) or not 0 <= size <= len(binary):
            raise InvalidInputError(
                f"binary_data_size must be an integer from 0 to the {len(binary)} bytes"
                f" after the header, got {size!r:.40}"
            )
        if "data" in tensor:
            raise InvalidInputError(f"input {name!r} has both data and binary_data_size")
        values = _decode_binary(name, datatype, binary[:size])
    else:
        size = 0
        if "data" not in tensor:
            raise InvalidInputError(f"input {name!r} has neither data nor binary_data_size")
        values = _flatten(tensor["data"], datatype)
        if datatype != "BYTES":
            values = _numbers(name, datatype, values)
    if math.prod(shape) != len(values):
        raise InvalidInputError(
            f"input {name!r} has shape {shape} ({math.prod(shape)} elements)"
            f" but {len(values)} {'strings' if datatype == 'BYTES' else 'values'}"
        )
    return name, Tensor(datatype, tuple(shape), values), size


def _outputs(outputs: object) -> tuple[frozenset[str], dict[str, bool]]:
    """The requested outputs, and whether each that says so wants binary data."""
    if outputs is None:
        return frozenset(), {}
    if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
        raise InvalidInputError("outputs must be a list of objects")
    names: set[str] = set()
    binary: dict[str, bool] = {}
    for output in outputs:
        name = output.get("name")
        if not isinstance(name, str):
            raise InvalidInputError("output name must be a string")
        asked = _mapping(output.get("parameters"), f"output {name!r} parameters")
        if asked.get("classification") is not None:
            # Triton's classification extension (tritonclient's class_count): not
            # served, and its shape ("score:index:label" strings) not the one answered.
            raise InvalidInputError(
                f"output {name!r}: the classification extension is not served;"
                " a classifier's LABEL and SCORE outputs hold its top labels"
            )
        wants = asked.get("binary_data")
        if wants is not None and not isinstance(wants, bool):
            raise InvalidInputError(f"output {name!r} binary_data must be true or false")
        names.add(name)
        if wants is not None:
            binary[name] = wants
    return frozenset(names), binary


def _parse_request(body: bytes, header_length: str | None) -> InferRequest:
    """The JSON header and the values of each input (their binary data one
    after another, in the inputs' order), every field checked: a
    malformed body is ``InvalidInputError``, never anything else."""
    header, binary = _load_header(body, header_length)
    if not isinstance(header, dict):
        raise InvalidInputError("request header must be a JSON object")
    tensors = header.get("inputs")
    if (
        not isinstance(tensors, list)
        or not 1 <= len(tensors) <= MAX_INPUTS
        or not all(isinstance(t, dict) for t in tensors)
    ):
        raise InvalidInputError(f"infer takes 1 to {MAX_INPUTS} input tensors")
    inputs: dict[str, Tensor] = {}
    for tensor in tensors:
        name, values, used = _tensor_of(tensor, binary)
        if name in inputs:
            raise InvalidInputError(f"input {name!r} is given twice")
        inputs[name] = values
        binary = binary[used:]
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInputError("id must be a string")
    parameters = _mapping(header.get("parameters"), "parameters")
    by_default = parameters.get("binary_data_output", False)
    if not isinstance(by_default, bool):
        raise InvalidInputError("binary_data_output must be true or false")
    outputs, binary_outputs = _outputs(header.get("outputs"))
    return InferRequest(
        inputs=inputs,
        request_id=request_id,
        outputs=outputs,
        binary_outputs=binary_outputs,
        binary_by_default=by_default,
        parameters=parameters,
    )


def binary_data(datatype: str, values: Any) -> bytes:
    """Values of ``datatype`` (an array, or a flat list) as binary tensor data:
    BYTES elements (bytes, or text as UTF-8) each after its 4-byte
    little-endian length, numbers little-endian."""
    if datatype == "BYTES":
        flat = values if isinstance(values, list) else np.asarray(values, dtype=object).ravel()
        elements = (x if isinstance(x, bytes) else str(x).encode() for x in flat)
        return b"".join(struct.pack("<I", len(b)) + b for b in elements)
    return np.asarray(values).astype(_NUMERIC[datatype]).tobytes()


def _encode_output(
    request: InferRequest, name: str, array: np.ndarray[Any, Any], datatype: str
) -> tuple[dict[str, Any], bytes]:
    out: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
    # An output's own binary_data overrides binary_data_output (Triton's binary data extension).
    if request.binary_outputs.get(name, request.binary_by_default):
        raw = binary_data(datatype, array)
        out["parameters"] = {"binary_data_size": len(raw)}
        return out, raw
    out["data"] = [str(x) for x in array.ravel()] if datatype == "BYTES" else array.ravel().tolist()
    return out, b""


Arrays = list[tuple[str, np.ndarray[Any, Any], str]]  # output tensors: name, values, datatype
# A request's items, and how their outputs become output tensors.
Work = tuple[list[Any], Callable[[list[Any]], Arrays]]


def _work(spec: ModelSpec, parsed: InferRequest) -> Work:
    """The model's items of a request's inputs, and how their outputs become
    output tensors."""
    if spec.task is Task.OCR:
        return _pages(spec, parsed)
    if spec.task is Task.RERANK:
        unexpected = sorted(set(parsed.inputs) - {"QUERY", "TEXT"})
        if unexpected:
            raise InvalidInputError(f"a reranker takes inputs QUERY and TEXT, not {unexpected}")
        queries, documents = parsed.named("QUERY"), parsed.named("TEXT")
        if len(queries) != 1:
            raise InvalidInputError(f"QUERY holds one query, not {len(queries)}")
        if not documents:
            raise InvalidInputError("TEXT must hold at least one document")
        return rerank_inputs(queries[0], documents), _scores  # as /v1/rerank checks them
    texts = parsed.texts
    if spec.task is Task.TTS:
        return _speech(parsed, texts)
    texts = texts_of(texts, "TEXT")  # none blank, as the HTTP routes refuse them
    if spec.task is Task.TRANSLATE:
        return [TranslateInput(t) for t in texts], _translations
    if spec.task is Task.EMBEDDING:
        return [TextInput(t) for t in texts], _embeddings
    if spec.task is Task.CLASSIFY:
        return [TextInput(t) for t in texts], _labels
    raise InvalidInputError(f"infer does not serve {spec.task} models")


def _own_parameters(parsed: InferRequest) -> dict[str, Any]:
    """The request's parameters but Triton's own: the model's to read."""
    return {k: v for k, v in parsed.parameters.items() if k not in _RESERVED_PARAMETERS}


def _pages(
    spec: ModelSpec, parsed: InferRequest
) -> tuple[list[Any], Callable[[list[Any]], Arrays]]:
    """A page an image of ``IMAGE`` (or a model's one input, whatever its
    name): encoded image files in a BYTES tensor (binary data, or base64 in
    JSON), or pixels in a UINT8 one, [H, W, C] or [N, H, W, C] (RGB, or gray
    with C 1). A vision-language model's prompt fields and ``mode`` come as
    the request's parameters, as the OCR route's form fields."""
    if "IMAGE" in parsed.inputs:
        if len(parsed.inputs) > 1:
            others = sorted(set(parsed.inputs) - {"IMAGE"})
            raise InvalidInputError(f"an OCR model takes input IMAGE alone, not {others} too")
        tensor = parsed.inputs["IMAGE"]
    elif len(parsed.inputs) == 1:
        (tensor,) = parsed.inputs.values()
    else:
        raise InvalidInputError(f"input 'IMAGE' is missing; given {sorted(parsed.inputs)}")
    given = _own_parameters(parsed)
    mode = given.pop("mode", "page")
    if mode not in ("page", "line"):
        raise InvalidInputError(f"mode is page or line, not {mode!r:.20}")
    if isinstance(given.get("fields"), str):
        try:
            given["fields"] = json.loads(given["fields"])
        except (ValueError, RecursionError) as e:
            raise InvalidInputError("parameter 'fields' must be JSON") from e
    try:
        ask = OcrOptions.model_validate(given)
    except ValueError as e:
        raise InvalidInputError(f"invalid parameters: {e}") from e
    if ask.model_extra:
        raise InvalidInputError(f"an OCR model takes no parameter {sorted(ask.model_extra)}")
    images = _images(tensor)
    if not images:
        raise InvalidInputError("IMAGE must hold at least one image")
    return [ocr_item(spec, image, mode, ask) for image in images], _read


def _images(tensor: Tensor) -> list[EncodedImage] | list[np.ndarray[Any, Any]]:
    """The pages of an image tensor: image files, their headers read (decoded
    when they run), or pixels, each H x W x 3 BGR (as ``decode_image``)."""
    if tensor.datatype == "BYTES":
        return [read_image(blob) for blob in tensor.blobs()]
    if tensor.datatype != "UINT8" or len(tensor.shape) not in (3, 4):
        raise InvalidInputError(
            "IMAGE is BYTES (image files) or UINT8 pixels [H, W, C] or [N, H, W, C],"
            f" not {tensor.datatype} {list(tensor.shape)}"
        )
    pixels = tensor.array()
    pages = pixels[None] if pixels.ndim == 3 else pixels
    _count, height, width, channels = pages.shape
    if channels not in (1, 3) or not height or not width:
        raise InvalidInputError(f"IMAGE's pages are H x W x 1 or 3, not {list(pages.shape[1:])}")
    if height * width > MAX_IMAGE_PIXELS:
        raise PayloadTooLargeError(
            f"image of {width} x {height} pixels is over the limit of {MAX_IMAGE_PIXELS:,} pixels"
        )
    return [
        np.ascontiguousarray(np.repeat(page, 3 // channels, axis=2)[:, :, ::-1]) for page in pages
    ]


def _quad(box: tuple[tuple[float, float], ...]) -> list[tuple[float, float]]:
    """A line's box as four corners: its own, or its bounds where it has other."""
    if len(box) == 4:
        return list(box)
    xs, ys = [p[0] for p in box] or [0.0], [p[1] for p in box] or [0.0]
    return [(min(xs), min(ys)), (max(xs), min(ys)), (max(xs), max(ys)), (min(xs), max(ys))]


def _read(outputs: list[OcrOutput | ChatOutput]) -> Arrays:
    """Each page's ``TEXT``, and its lines one after another (``LINE_IMAGE``
    says whose): ``LINE_TEXT``, ``LINE_SCORE``, ``LINE_BOX`` (four corners,
    pixels). A vision-language model's answer is its text, with no lines."""
    texts: list[str] = []
    lines: list[tuple[int, OcrLine]] = []
    for index, output in enumerate(outputs):
        if isinstance(output, ChatOutput):
            texts.append(output.text)
            continue
        texts.append("\n".join(line.text for line in output.lines))
        lines.extend((index, line) for line in output.lines)
    boxes = np.array([_quad(line.box) for _, line in lines], dtype=np.float32).reshape(-1, 4, 2)
    return [
        ("TEXT", np.array(texts, dtype=object), "BYTES"),
        ("LINE_TEXT", np.array([line.text for _, line in lines], dtype=object), "BYTES"),
        ("LINE_SCORE", np.array([line.score for _, line in lines], dtype=np.float32), "FP32"),
        ("LINE_BOX", boxes, "FP32"),
        ("LINE_IMAGE", np.array([index for index, _ in lines], dtype=np.int32), "INT32"),
    ]


def _speech(
    parsed: InferRequest, texts: list[str]
) -> tuple[list[Any], Callable[[list[Any]], Arrays]]:
    """One text's speech: ``AUDIO`` (16-bit samples) and its ``SAMPLE_RATE``;
    ``speed`` (1.0) as a parameter."""
    if len(texts) != 1:
        raise InvalidInputError(f"a speech model reads one text a request, not {len(texts)}")
    given = _own_parameters(parsed)
    speed = given.pop("speed", 1.0)
    if given:
        raise InvalidInputError(f"a speech model takes speed alone, not {sorted(given)}")
    if not _is_number(speed) or not 0.25 <= speed <= 4.0:
        raise InvalidInputError(f"speed is a number from 0.25 to 4, not {speed!r:.20}")
    if not texts[0].strip():
        raise InvalidInputError("the text must not be blank")
    return [SpeechInput(texts[0], float(speed))], _audio


def _audio(outputs: list[SpeechOutput]) -> Arrays:
    (speech,) = outputs
    return [
        ("AUDIO", np.asarray(speech.samples, dtype=np.int16), "INT16"),
        ("SAMPLE_RATE", np.array([speech.sample_rate], dtype=np.int32), "INT32"),
    ]


def _embeddings(outputs: list[Any]) -> Arrays:
    return [("EMBEDDING", np.stack([np.asarray(v, np.float32) for v in outputs]), "FP32")]


def _translations(outputs: list[Any]) -> Arrays:
    return [("TRANSLATION", np.array(outputs, dtype=object), "BYTES")]


def _scores(outputs: list[Any]) -> Arrays:
    return [("SCORE", np.asarray(outputs, dtype=np.float32), "FP32")]


def _labels(outputs: list[ClassifyOutput]) -> Arrays:
    labels = np.array([r.labels[0].label for r in outputs], dtype=object)
    scores = np.array([r.labels[0].score for r in outputs], dtype=np.float32)
    return [("LABEL", labels, "BYTES"), ("SCORE", scores, "FP32")]


# Triton's own request parameters, which are not a generation's.
_RESERVED_PARAMETERS = frozenset(
    {
        "binary_data_output",
        "priority",
        "timeout",
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "headers",
        "triton_enable_empty_final_response",
    }
)
_WORD_LISTS = frozenset({"stop", "stop_words", "bad_words"})  # every element, not one


def _generation_request(parsed: InferRequest) -> tuple[list[str], GenerateParameters]:
    """The prompts of ``text_input`` and their parameters, gathered as
    ``triton_llm`` says."""
    prompts = parsed.named(PROMPT)
    given = _own_parameters(parsed)
    if SAMPLING_PARAMETERS in parsed.inputs:
        raw = parsed.named(SAMPLING_PARAMETERS)
        try:
            sampling = json.loads(raw[0]) if len(raw) == 1 else None
        except ValueError:
            sampling = None
        if not isinstance(sampling, dict):
            raise InvalidInputError(f"{SAMPLING_PARAMETERS} must hold one JSON object")
        given.update(sampling)
    for name, tensor in parsed.inputs.items():
        if name in (PROMPT, SAMPLING_PARAMETERS):
            continue
        if name in _WORD_LISTS:
            given[name] = parsed.named(name)
        elif len(tensor.values) != 1:
            raise InvalidInputError(f"input {name!r} holds one value, not {len(tensor.values)}")
        else:
            given[name] = tensor.tolist()[0]
    given.update(asked_extras(parsed.outputs))
    return prompts, parameters_of(given)


def _generation(parsed: InferRequest, prompts: list[str], parameters: GenerateParameters) -> Work:
    """A prompt's item per ``text_input`` element; ``text_output`` (and the
    extras asked for) in ``text_input``'s shape."""
    shape = parsed.inputs[PROMPT].shape
    items = generate_items(prompts, parameters)

    def arrays(outputs: list[ChatOutput]) -> Arrays:
        texts = [text_of(parameters, p, o) for p, o in zip(prompts, outputs, strict=True)]
        tensors = [(TEXT, np.array(texts, dtype=object).reshape(shape), "BYTES")]
        for extra in extras_of(parameters):
            values = [extra.value(output) for output in outputs]
            dtype = object if extra.datatype == "BYTES" else _NUMERIC[extra.datatype]
            tensors.append(
                (extra.name, np.array(values, dtype=dtype).reshape(shape), extra.datatype)
            )
        return tensors

    return items, arrays


@router.post("/v2/models/{name}/infer", response_model=None)
@router.post("/v2/models/{name}/versions/{version}/infer", response_model=None)
async def infer(name: str, request: Request, version: str | None = None) -> Response:
    engine = engine_of(request)
    served_as = _versioned(name, version)
    try:
        caller_of(request, served_as)  # a model the caller may not use: 404 before any check
        spec = engine.spec(served_as)
        parsed = _parse_request(await request.body(), request.headers.get(HEADER_LENGTH))
        known = {output["name"] for output in _io_metadata(spec)[1]}
        if not parsed.outputs <= known:
            raise InvalidInputError(
                f"model {name!r} has no output {sorted(parsed.outputs - known)};"
                f" its outputs are {sorted(known)}"
            )
        if spec.task is Task.GENERATE:
            prompts, parameters = _generation_request(parsed)
            if parameters.stream:
                return await _infer_events(request, name, served_as, parsed, prompts, parameters)
            items, arrays_of = _generation(parsed, prompts, parameters)
        else:
            items, arrays_of = _work(spec, parsed)
        outputs_raw = await run_task(request, served_as, spec.task, items)
    except TesseraError as e:
        request.state.audit.reason = reject_reason(e) or type(e).__name__
        return _kserve_error(e)
    arrays = arrays_of(outputs_raw)
    if parsed.outputs:  # only those asked for, as Triton answers
        arrays = [entry for entry in arrays if entry[0] in parsed.outputs]
    outputs, blobs = [], []
    for out_name, array, datatype in arrays:
        out, blob = _encode_output(parsed, out_name, array, datatype)
        outputs.append(out)
        blobs.append(blob)
    response_header: dict[str, Any] = {
        "model_name": name,
        "model_version": request.state.model_version,  # the version that answered
        "outputs": outputs,
    }
    if parsed.request_id is not None:
        response_header["id"] = parsed.request_id
    head = json.dumps(response_header).encode()
    binary = b"".join(blobs)
    if not binary:
        return Response(head, media_type="application/json")
    return Response(
        head + binary,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(head))},
    )


@router.post("/v2/models/{name}/generate", response_model=None)
@router.post("/v2/models/{name}/versions/{version}/generate", response_model=None)
async def generate(name: str, request: Request, version: str | None = None) -> Response:
    """Triton's generate extension: one JSON answer (``triton_llm`` notes)."""
    return await _generate(name, request, version, streamed=False)


@router.post("/v2/models/{name}/generate_stream", response_model=None)
@router.post("/v2/models/{name}/versions/{version}/generate_stream", response_model=None)
async def generate_stream(name: str, request: Request, version: str | None = None) -> Response:
    """Triton's generate extension as server-sent events: the text as it
    comes where ``stream`` is true, else whole in one event."""
    return await _generate(name, request, version, streamed=True)


def _generate_request(body: bytes) -> tuple[str, GenerateParameters]:
    """A generate body's prompt and parameters (``parameters`` and any other
    field but ``text_input``)."""
    try:
        given = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise InvalidInputError("the body is not valid JSON") from e
    if not isinstance(given, dict):
        raise InvalidInputError("the body must be a JSON object")
    prompt = given.pop(PROMPT, None)
    if not isinstance(prompt, str):
        raise InvalidInputError(f"{PROMPT} must be a string, the prompt")
    parameters = _mapping(given.pop("parameters", None), "parameters")
    return prompt, parameters_of({**given, **parameters})


async def _generate(name: str, request: Request, version: str | None, streamed: bool) -> Response:
    served_as = _versioned(name, version)
    try:
        prompt, parameters = _generate_request(await request.body())
        if parameters.stream and not streamed:
            raise InvalidInputError("generate answers once: stream with .../generate_stream")
        if parameters.stream:
            pieces: Pieces = asyncio.Queue()
            items = generate_items([prompt], parameters, pieces)
            work = await started_task(request, served_as, Task.GENERATE, items)
            events = _generated_events(name, request, prompt, parameters, work, pieces)
            return _event_stream(events)
        outputs = await run_task(
            request, served_as, Task.GENERATE, generate_items([prompt], parameters)
        )
    except TesseraError as e:
        request.state.audit.reason = reject_reason(e) or type(e).__name__
        return _kserve_error(e)
    body = _generated(
        name, request, text_of(parameters, prompt, outputs[0]), parameters, outputs[0]
    )
    if streamed:
        return _event_stream(_one(body))
    return JSONResponse(body)


def _generated(
    name: str,
    request: Request,
    text: str,
    parameters: GenerateParameters,
    output: ChatOutput | None = None,
) -> dict[str, Any]:
    """A generate response: ``text``, and (with the output) the extras asked for."""
    body = {"model_name": name, "model_version": request.state.model_version, TEXT: text}
    if output is not None:
        body.update((extra.name, extra.value(output)) for extra in extras_of(parameters))
    return body


def _event_stream(bodies: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        async for body in bodies:
            yield f"data: {json.dumps(body)}\n\n"

    return StreamingResponse(
        events(), media_type=EVENT_STREAM, headers={"Cache-Control": "no-cache"}
    )


async def _one(body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield body


async def _generated_events(
    name: str,
    request: Request,
    prompt: str,
    parameters: GenerateParameters,
    work: asyncio.Future[list[Any]],
    pieces: Pieces,
) -> AsyncIterator[dict[str, Any]]:
    """Each text ``generation_pieces`` gives, then the extras asked for (with
    no text); an error as ``{"error": ...}``."""
    try:
        async for got in generation_pieces(prompt, parameters, work, pieces):
            if isinstance(got, str):
                yield _generated(name, request, got, parameters)
            elif extras_of(parameters):
                yield _generated(name, request, "", parameters, got)
    except TesseraError as e:
        yield {"error": str(e)}


EVENT_STREAM = "text/event-stream"


async def _infer_events(
    request: Request,
    name: str,
    served_as: str,
    parsed: InferRequest,
    prompts: list[str],
    parameters: GenerateParameters,
) -> Response:
    """A streamed generation over infer, for a caller that accepts server-sent
    events (gRPC's ``ModelStreamInfer`` is one): an infer response an event,
    each with ``triton_final_response`` among its parameters (module notes)."""
    if EVENT_STREAM not in request.headers.get("accept", ""):
        raise InvalidInputError(
            "infer answers once: stream with .../generate_stream, gRPC's ModelStreamInfer,"
            f" or infer with Accept: {EVENT_STREAM}"
        )
    if len(prompts) != 1:
        raise InvalidInputError(f"a streamed generation takes one prompt, not {len(prompts)}")
    pieces: Pieces = asyncio.Queue()
    items = generate_items(prompts, parameters, pieces)
    work = await started_task(request, served_as, Task.GENERATE, items)
    shape = list(parsed.inputs[PROMPT].shape)
    empty_final = parsed.parameters.get("triton_enable_empty_final_response") is True

    def response(outputs: list[dict[str, Any]], final: bool) -> dict[str, Any]:
        body = {
            "model_name": name,
            "model_version": request.state.model_version,
            "outputs": outputs,
            "parameters": {"triton_final_response": final},
        }
        if parsed.request_id is not None:
            body["id"] = parsed.request_id
        return body

    def tensor(name: str, datatype: str, value: Any) -> dict[str, Any]:
        return {"name": name, "datatype": datatype, "shape": shape, "data": [value]}

    async def events() -> AsyncIterator[dict[str, Any]]:
        try:
            async for got in generation_pieces(prompts[0], parameters, work, pieces):
                if isinstance(got, str):
                    yield response([tensor(TEXT, "BYTES", got)], final=False)
                    continue
                extras = [
                    tensor(extra.name, extra.datatype, extra.value(got))
                    for extra in extras_of(parameters)
                ]
                if extras or empty_final:
                    yield response(extras, final=True)
        except TesseraError as e:
            yield {"error": str(e)}

    return _event_stream(events())
