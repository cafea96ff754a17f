"""KServe v2 / Open Inference Protocol: health, metadata and infer, JSON and the
binary tensor extension, as ``tritonclient[http]`` speaks them.

``infer`` is served for embedding models (a BYTES input of texts, an FP32
``[N, D]`` output), classification models (a BYTES ``LABEL`` and an FP32
``SCORE`` output per text), translation models (a BYTES ``TRANSLATION`` per
text) and rerankers (a BYTES ``QUERY`` of one element and a BYTES ``TEXT``
of documents in, an FP32 ``SCORE`` per document out). A model of one input
takes it under any name, as before; a reranker's are named.

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
import math
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tessera import __version__
from tessera.errors import InvalidInputError, ModelNotFoundError, TesseraError
from tessera.gateway.common import engine_of, run_task, visible_models
from tessera.gateway.errors import error_headers, reject_reason, status_of
from tessera.metrics.stats import Durations, ModelStats
from tessera.repository.spec import ModelSpec
from tessera.tasks.types import ClassifyOutput, RerankInput, Task, TextInput, TranslateInput

router = APIRouter()

HEADER_LENGTH = "inference-header-content-length"


def _kserve_error(error: TesseraError) -> JSONResponse:
    status, _kind = status_of(error)
    return JSONResponse({"error": str(error)}, status_code=status, headers=error_headers(error))


@router.get("/v2")
async def server_metadata() -> JSONResponse:
    return JSONResponse(
        {"name": "tessera", "version": __version__, "extensions": ["binary_tensor_data"]}
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
    inputs = [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}]
    score = {"name": "SCORE", "datatype": "FP32", "shape": [-1]}
    if spec.task is Task.EMBEDDING:
        return inputs, [{"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, -1]}]
    if spec.task is Task.CLASSIFY:
        return inputs, [{"name": "LABEL", "datatype": "BYTES", "shape": [-1]}, score]
    if spec.task is Task.TRANSLATE:
        return inputs, [{"name": "TRANSLATION", "datatype": "BYTES", "shape": [-1]}]
    if spec.task is Task.RERANK:
        query = {"name": "QUERY", "datatype": "BYTES", "shape": [1]}
        return [query, *inputs], [score]
    return [], []


# KServe datatypes as Triton's model configuration names them.
_CONFIG_TYPES = {"BYTES": "TYPE_STRING", "FP32": "TYPE_FP32"}


def _config_io(tensors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"name": t["name"], "data_type": _CONFIG_TYPES[t["datatype"]], "dims": t["shape"]}
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
    return JSONResponse(
        [
            {
                "name": model.name,
                "version": model.version,
                "state": "READY" if model.state == "ready" else "UNAVAILABLE",
            }
            for model in engine_of(request).snapshot().models
            if model.name in allowed and model.current
        ]
    )


def _decode_bytes_tensor(raw: bytes) -> list[str]:
    texts, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidInputError("truncated BYTES tensor")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidInputError("truncated BYTES element")
        texts.append(raw[offset : offset + length].decode("utf-8", errors="replace"))
        offset += length
    return texts


# Nesting of a tensor's ``data`` (a list per dimension); deeper is refused
# before it is walked (Python's own recursion limit is near 1,000).
MAX_TENSOR_RANK = 8


# The most input tensors one request may carry (a reranker takes two).
MAX_INPUTS = 4


@dataclass(frozen=True, slots=True)
class InferRequest:
    """A KServe v2 infer body, validated: each BYTES input's texts, by name
    (the first for a model of one input), and how to answer."""

    inputs: dict[str, list[str]]
    request_id: str | None
    outputs: frozenset[str]  # outputs named in the request (none: all of them)
    binary_outputs: frozenset[str]  # outputs asked for as binary tensor data
    binary_by_default: bool  # ``parameters.binary_data_output``

    @property
    def texts(self) -> list[str]:
        """The texts of a request of one input (whatever its name)."""
        if len(self.inputs) != 1:
            raise InvalidInputError(
                f"this model takes one input, a BYTES tensor of texts; got {len(self.inputs)}"
            )
        (texts,) = self.inputs.values()
        return texts

    def named(self, name: str) -> list[str]:
        if name not in self.inputs:
            raise InvalidInputError(f"input {name!r} is missing; given {sorted(self.inputs)}")
        return self.inputs[name]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _mapping(value: object, where: str) -> dict[str, Any]:
    """An optional JSON object (``parameters``): absent is empty."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInputError(f"{where} must be a JSON object")
    return value


def _flatten_strings(data: object) -> list[str]:
    """The strings of a BYTES tensor's ``data``, nested at most MAX_TENSOR_RANK
    deep, without recursion; anything but a string is refused."""
    texts: list[str] = []
    stack: list[tuple[object, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, list):
            if depth >= MAX_TENSOR_RANK:
                raise InvalidInputError(f"data is nested deeper than {MAX_TENSOR_RANK} levels")
            stack.extend((item, depth + 1) for item in reversed(value))
        elif isinstance(value, str):
            texts.append(value)
        else:
            raise InvalidInputError(
                f"a BYTES tensor holds strings; data has {type(value).__name__} {value!r:.40}"
            )
    return texts


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


def _texts_of(tensor: dict[str, Any], binary: bytes) -> tuple[str, list[str], int]:
    """A BYTES input tensor's name and texts, checked against its shape, and
    how many bytes of ``binary`` (what follows, for the next input) it used."""
    name = tensor.get("name")
    if not isinstance(name, str):
        raise InvalidInputError("input name must be a string")
    if tensor.get("datatype") != "BYTES":
        raise InvalidInputError(f"input {name!r} must be BYTES, not {tensor.get('datatype')!r:.20}")
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
        texts = _decode_bytes_tensor(binary[:size])
    else:
        size = 0
        if "data" not in tensor:
            raise InvalidInputError(f"input {name!r} has neither data nor binary_data_size")
        texts = _flatten_strings(tensor["data"])
    if math.prod(shape) != len(texts):
        raise InvalidInputError(
            f"input {name!r} has shape {shape} ({math.prod(shape)} elements)"
            f" but {len(texts)} strings"
        )
    return name, texts, size


def _outputs(outputs: object) -> tuple[frozenset[str], frozenset[str]]:
    """The requested outputs, and those that want binary data."""
    if outputs is None:
        return frozenset(), frozenset()
    if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
        raise InvalidInputError("outputs must be a list of objects")
    names, binary = set(), set()
    for output in outputs:
        name = output.get("name")
        if not isinstance(name, str):
            raise InvalidInputError("output name must be a string")
        wants = _mapping(output.get("parameters"), f"output {name!r} parameters").get(
            "binary_data", False
        )
        if not isinstance(wants, bool):
            raise InvalidInputError(f"output {name!r} binary_data must be true or false")
        names.add(name)
        if wants:
            binary.add(name)
    return frozenset(names), frozenset(binary)


def _parse_request(body: bytes, header_length: str | None) -> InferRequest:
    """The JSON header and the texts of each BYTES input (their binary data
    one after another, in the inputs' order), every field checked: a
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
        raise InvalidInputError(f"infer takes 1 to {MAX_INPUTS} inputs, BYTES tensors of texts")
    inputs: dict[str, list[str]] = {}
    for tensor in tensors:
        name, texts, used = _texts_of(tensor, binary)
        if name in inputs:
            raise InvalidInputError(f"input {name!r} is given twice")
        inputs[name] = texts
        binary = binary[used:]
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInputError("id must be a string")
    by_default = _mapping(header.get("parameters"), "parameters").get("binary_data_output", False)
    if not isinstance(by_default, bool):
        raise InvalidInputError("binary_data_output must be true or false")
    outputs, binary_outputs = _outputs(header.get("outputs"))
    return InferRequest(
        inputs=inputs,
        request_id=request_id,
        outputs=outputs,
        binary_outputs=binary_outputs,
        binary_by_default=by_default,
    )


def _encode_output(
    request: InferRequest, name: str, array: np.ndarray[Any, Any], datatype: str
) -> tuple[dict[str, Any], bytes]:
    out: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
    if datatype == "BYTES":
        raw = b"".join(
            struct.pack("<I", len(b)) + b for b in (str(x).encode() for x in array.ravel())
        )
        data: list[Any] = [str(x) for x in array.ravel()]
    else:
        raw = array.astype("<f4").tobytes()
        data = array.ravel().tolist()
    if name in request.binary_outputs or request.binary_by_default:
        out["parameters"] = {"binary_data_size": len(raw)}
        return out, raw
    out["data"] = data
    return out, b""


def _items(spec: ModelSpec, parsed: InferRequest) -> list[Any]:
    """The model's items of a request's inputs."""
    if spec.task is Task.RERANK:
        queries, documents = parsed.named("QUERY"), parsed.named("TEXT")
        if len(queries) != 1:
            raise InvalidInputError(f"QUERY holds one query, not {len(queries)}")
        if not documents:
            raise InvalidInputError("TEXT must hold at least one document")
        return [RerankInput(queries[0], document) for document in documents]
    texts = parsed.texts
    if not texts:
        raise InvalidInputError("input must not be empty")
    if spec.task is Task.TRANSLATE:
        return [TranslateInput(t) for t in texts]
    if spec.task not in (Task.EMBEDDING, Task.CLASSIFY):
        raise InvalidInputError(
            f"infer serves embedding, classify, translate and rerank models, not {spec.task}"
        )
    return [TextInput(t) for t in texts]


def _arrays(task: Task, outputs: list[Any]) -> list[tuple[str, np.ndarray[Any, Any], str]]:
    """The output tensors of a task's outputs: (name, array, datatype)."""
    if task is Task.EMBEDDING:
        return [("EMBEDDING", np.stack([np.asarray(v, np.float32) for v in outputs]), "FP32")]
    if task is Task.TRANSLATE:
        return [("TRANSLATION", np.array(outputs, dtype=object), "BYTES")]
    if task is Task.RERANK:
        return [("SCORE", np.asarray(outputs, dtype=np.float32), "FP32")]
    results: list[ClassifyOutput] = outputs
    labels = np.array([r.labels[0].label for r in results], dtype=object)
    scores = np.array([r.labels[0].score for r in results], dtype=np.float32)
    return [("LABEL", labels, "BYTES"), ("SCORE", scores, "FP32")]


@router.post("/v2/models/{name}/infer", response_model=None)
@router.post("/v2/models/{name}/versions/{version}/infer", response_model=None)
async def infer(name: str, request: Request, version: str | None = None) -> Response:
    engine = engine_of(request)
    served_as = _versioned(name, version)
    try:
        spec = engine.spec(served_as)
        parsed = _parse_request(await request.body(), request.headers.get(HEADER_LENGTH))
        items = _items(spec, parsed)
        known = {output["name"] for output in _io_metadata(spec)[1]}
        if not parsed.outputs <= known:
            raise InvalidInputError(
                f"model {name!r} has no output {sorted(parsed.outputs - known)};"
                f" its outputs are {sorted(known)}"
            )
        outputs_raw = await run_task(request, served_as, spec.task, items)
    except TesseraError as e:
        request.state.audit.reason = reject_reason(e) or type(e).__name__
        return _kserve_error(e)
    arrays = _arrays(spec.task, outputs_raw)
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
