"""KServe v2's tensors over HTTP: an infer request's JSON header and binary
data parsed into named tensors (every field checked), and output tensors
encoded as JSON or as binary data (the binary tensor extension)."""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tessera.errors import (
    InvalidInputError,
)
from tessera.tasks.image import decode_base64

HEADER_LENGTH = "inference-header-content-length"

# KServe's numeric datatypes as numpy reads their binary data (little-endian).
NUMERIC_DTYPES = {
    "BOOL": "?",
    **{f"INT{bits}": f"<i{bits // 8}" for bits in (8, 16, 32, 64)},
    **{f"UINT{bits}": f"<u{bits // 8}" for bits in (8, 16, 32, 64)},
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
}


def is_number(value: object) -> bool:
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
    "FP": (is_number, "numbers"),
}


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


def json_object(value: object, where: str) -> dict[str, Any]:
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
    dtype = np.dtype(NUMERIC_DTYPES[datatype])
    if len(raw) % dtype.itemsize:
        raise InvalidInputError(
            f"input {name!r}: {len(raw)} bytes are not whole {datatype} values"
            f" ({dtype.itemsize} bytes each)"
        )
    return np.frombuffer(raw, dtype)


def _numbers(name: str, datatype: str, values: list[Any]) -> np.ndarray[Any, Any]:
    """A tensor's JSON numbers as an array of its datatype, each in its range."""
    try:
        return np.asarray(values, dtype=NUMERIC_DTYPES[datatype])
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
    if not isinstance(datatype, str) or (datatype != "BYTES" and datatype not in NUMERIC_DTYPES):
        raise InvalidInputError(
            f"input {name!r} has datatype {datatype!r:.20}; KServe's are BYTES, BOOL,"
            " INT8 to INT64, UINT8 to UINT64, FP16, FP32 and FP64"
        )
    shape = _shape(tensor)
    size = json_object(tensor.get("parameters"), f"input {name!r} parameters").get(
        "binary_data_size"
    )
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
        asked = json_object(output.get("parameters"), f"output {name!r} parameters")
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


def parse_request(body: bytes, header_length: str | None) -> InferRequest:
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
    parameters = json_object(header.get("parameters"), "parameters")
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
    return np.asarray(values).astype(NUMERIC_DTYPES[datatype]).tobytes()


def encode_output(
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
