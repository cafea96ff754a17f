"""KServe v2 / Open Inference Protocol: health, metadata and infer, JSON and the
binary tensor extension, as ``tritonclient[http]`` speaks them.

``infer`` is served for embedding models (a BYTES input of texts, an FP32
``[N, D]`` output) and classification models (a BYTES ``LABEL`` and an FP32
``SCORE`` output per text).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tessera import __version__
from tessera.errors import InvalidInputError, ModelNotFoundError, TesseraError
from tessera.gateway.common import engine_of, run_task, visible_models
from tessera.gateway.errors import error_headers, reject_reason, status_of
from tessera.repository.spec import ModelSpec
from tessera.tasks.types import ClassifyOutput, Task, TextInput

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


def _io_metadata(spec: ModelSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    inputs = [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}]
    if spec.task is Task.EMBEDDING:
        return inputs, [{"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, -1]}]
    if spec.task is Task.CLASSIFY:
        return inputs, [
            {"name": "LABEL", "datatype": "BYTES", "shape": [-1]},
            {"name": "SCORE", "datatype": "FP32", "shape": [-1]},
        ]
    return [], []


@router.get("/v2/models/{name}", response_model=None)
@router.get("/v2/models/{name}/versions/{version}", response_model=None)
async def model_metadata(name: str, request: Request, version: str | None = None) -> Response:
    if name not in visible_models(request):
        return _kserve_error(ModelNotFoundError(name))
    spec = engine_of(request).repository.get(name)
    inputs, outputs = _io_metadata(spec)
    return JSONResponse(
        {
            "name": spec.name,
            "versions": [str(v) for v in spec.versions] or ["1"],
            "platform": f"tessera_{spec.runtime}",
            "inputs": inputs,
            "outputs": outputs,
        }
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


def _flatten(data: Any) -> list[Any]:
    if isinstance(data, list):
        return [x for item in data for x in _flatten(item)]
    return [data]


def _parse_request(body: bytes, header_length: str | None) -> tuple[dict[str, Any], list[str]]:
    """The JSON header and the texts of the (single) BYTES input."""
    try:
        if header_length is not None:
            split = int(header_length)
            header, binary = json.loads(body[:split]), body[split:]
        else:
            header, binary = json.loads(body), b""
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidInputError("request is not valid JSON") from e
    inputs = header.get("inputs") if isinstance(header, dict) else None
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise InvalidInputError("infer takes exactly one input: a BYTES tensor of texts")
    tensor = inputs[0]
    if tensor.get("datatype") != "BYTES":
        raise InvalidInputError(f"input {tensor.get('name')!r} must be BYTES")
    size = (tensor.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        texts = _decode_bytes_tensor(binary[: int(size)])
    else:
        texts = [str(x) for x in _flatten(tensor.get("data", []))]
    return header, texts


def _wants_binary(header: dict[str, Any], name: str) -> bool:
    for output in header.get("outputs") or []:
        if output.get("name") == name:
            return bool((output.get("parameters") or {}).get("binary_data", False))
    return bool((header.get("parameters") or {}).get("binary_data_output", False))


def _encode_output(
    header: dict[str, Any], name: str, array: np.ndarray[Any, Any], datatype: str
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
    if _wants_binary(header, name):
        out["parameters"] = {"binary_data_size": len(raw)}
        return out, raw
    out["data"] = data
    return out, b""


@router.post("/v2/models/{name}/infer", response_model=None)
@router.post("/v2/models/{name}/versions/{version}/infer", response_model=None)
async def infer(name: str, request: Request, version: str | None = None) -> Response:
    engine = engine_of(request)
    try:
        spec = engine.repository.get(name)
        header, texts = _parse_request(await request.body(), request.headers.get(HEADER_LENGTH))
        if not texts:
            raise InvalidInputError("input must not be empty")
        items = [TextInput(t) for t in texts]
        if spec.task not in (Task.EMBEDDING, Task.CLASSIFY):
            raise InvalidInputError(f"infer serves embedding and classify models, not {spec.task}")
        outputs_raw = await run_task(request, name, spec.task, items)
    except TesseraError as e:
        request.state.audit.reason = reject_reason(e) or type(e).__name__
        return _kserve_error(e)
    arrays: list[tuple[str, np.ndarray[Any, Any], str]]
    if spec.task is Task.EMBEDDING:
        arrays = [("EMBEDDING", np.stack([np.asarray(v, np.float32) for v in outputs_raw]), "FP32")]
    else:
        results: list[ClassifyOutput] = outputs_raw
        labels = np.array([r.labels[0].label for r in results], dtype=object)
        scores = np.array([r.labels[0].score for r in results], dtype=np.float32)
        arrays = [("LABEL", labels, "BYTES"), ("SCORE", scores, "FP32")]
    outputs, blobs = [], []
    for out_name, array, datatype in arrays:
        out, blob = _encode_output(header, out_name, array, datatype)
        outputs.append(out)
        blobs.append(blob)
    response_header: dict[str, Any] = {
        "model_name": name,
        "model_version": str(version or spec.version or 1),
        "outputs": outputs,
    }
    if "id" in header:
        response_header["id"] = header["id"]
    head = json.dumps(response_header).encode()
    binary = b"".join(blobs)
    if not binary:
        return Response(head, media_type="application/json")
    return Response(
        head + binary,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(head))},
    )
