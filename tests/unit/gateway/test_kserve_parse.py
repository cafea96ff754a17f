"""KServe v2 infer bodies: whatever the bytes, ``parse_request`` returns a
validated request or raises ``InvalidInputError`` (a 4xx), nothing else."""

from __future__ import annotations

import contextlib
import json
import math
import struct
from typing import Any

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from tessera.errors import InvalidInputError
from tessera.gateway.kserve_tensor import MAX_TENSOR_RANK, encode_output, parse_request

SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)
TENSOR = st.fixed_dictionaries(
    {},
    optional={
        "name": st.just("TEXT") | JSON,
        "datatype": st.sampled_from(["BYTES", "BOOL", "INT32", "UINT64", "FP32"]) | JSON,
        "shape": st.lists(st.integers(-1, 3), max_size=3) | JSON,
        "data": st.lists(st.text(max_size=3), max_size=4) | JSON,
        "parameters": st.fixed_dictionaries({"binary_data_size": st.integers(-2, 20) | JSON})
        | JSON,
    },
)
HEADER = st.fixed_dictionaries(
    {},
    optional={
        "id": JSON,
        "inputs": st.lists(TENSOR, min_size=1, max_size=2) | JSON,
        "outputs": st.lists(st.fixed_dictionaries({"name": st.just("EMBEDDING") | JSON})) | JSON,
        "parameters": st.fixed_dictionaries({"binary_data_output": JSON}) | JSON,
    },
)


@hypothesis.given(
    header=HEADER,
    blob=st.binary(max_size=32),
    length=st.none() | st.integers(-3, 300).map(str) | st.text(max_size=4),
)
@hypothesis.settings(max_examples=400, database=None)
def test_any_body_parses_or_is_invalid_input(
    header: dict[str, Any], blob: bytes, length: str | None
) -> None:
    head = json.dumps(header).encode()
    try:
        parsed = parse_request(head + blob, str(len(head)) if length == "" else length)
    except InvalidInputError as e:
        message = str(e)
    else:
        for tensor in parsed.inputs.values():
            assert len(tensor.values) == math.prod(tensor.shape)
        return
    assert message  # every refusal says why


@hypothesis.given(st.binary(max_size=64), st.none() | st.text(max_size=6))
@hypothesis.example(b"{}", "\u00b2")  # a digit to str.isdigit(), not to int(): found so
@hypothesis.settings(max_examples=200, database=None)
def test_any_bytes_parse_or_are_invalid_input(body: bytes, length: str | None) -> None:
    with contextlib.suppress(InvalidInputError):
        parse_request(body, length)


def test_a_valid_binary_tensor_parses() -> None:
    texts = [b"hello", b"w\xc3\xb6rld"]
    blob = b"".join(struct.pack("<I", len(t)) + t for t in texts)
    tensor = {
        "name": "TEXT",
        "datatype": "BYTES",
        "shape": [2],
        "parameters": {"binary_data_size": len(blob)},
    }
    head = json.dumps(
        {
            "id": "r1",
            "inputs": [tensor],
            "outputs": [{"name": "EMBEDDING", "parameters": {"binary_data": True}}],
        }
    ).encode()
    parsed = parse_request(head + blob, str(len(head)))
    assert parsed.texts == ["hello", "wörld"]
    assert parsed.request_id == "r1"
    assert parsed.binary_outputs == {"EMBEDDING": True}


def test_an_outputs_own_binary_data_overrides_the_requests_default() -> None:
    text = {"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["a"]}
    head = {
        "inputs": [text],
        "parameters": {"binary_data_output": True},
        "outputs": [
            {"name": "EMBEDDING", "parameters": {"binary_data": False}},
            {"name": "TOKENS"},
        ],
    }
    parsed = parse_request(json.dumps(head).encode(), None)
    values = np.ones((1, 2), dtype=np.float32)
    as_json, raw = encode_output(parsed, "EMBEDDING", values, "FP32")
    assert (as_json["data"], raw) == ([1.0, 1.0], b"")
    as_binary, raw = encode_output(parsed, "TOKENS", values, "FP32")
    assert as_binary["parameters"] == {"binary_data_size": 8}
    assert raw == values.tobytes()


def test_inputs_read_their_binary_data_in_turn() -> None:
    def tensor(name: str, texts: list[bytes]) -> tuple[dict[str, object], bytes]:
        blob = b"".join(struct.pack("<I", len(t)) + t for t in texts)
        shape = [len(texts)]
        return {
            "name": name,
            "datatype": "BYTES",
            "shape": shape,
            "parameters": {"binary_data_size": len(blob)},
        }, blob

    query, query_blob = tensor("QUERY", [b"q"])
    documents, documents_blob = tensor("TEXT", [b"a", b"bc"])
    inline = {"name": "EXTRA", "datatype": "BYTES", "shape": [1], "data": ["x"]}
    head = json.dumps({"inputs": [query, inline, documents]}).encode()
    parsed = parse_request(head + query_blob + documents_blob, str(len(head)))
    assert {name: t.tolist() for name, t in parsed.inputs.items()} == {
        "QUERY": ["q"],
        "EXTRA": ["x"],
        "TEXT": ["a", "bc"],
    }
    assert parsed.named("TEXT") == ["a", "bc"]
    with pytest.raises(InvalidInputError, match="takes one input"):
        _ = parsed.texts
    with pytest.raises(InvalidInputError, match="'OTHER' is missing"):
        parsed.named("OTHER")
    twice = json.dumps({"inputs": [inline, inline]}).encode()
    with pytest.raises(InvalidInputError, match="given twice"):
        parse_request(twice, None)


def test_nesting_is_bounded_without_recursion() -> None:
    data: object = "x"
    for _ in range(MAX_TENSOR_RANK):
        data = [data]
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": data}]}
    assert parse_request(json.dumps(body).encode(), None).texts == ["x"]
    body["inputs"][0]["data"] = [data]  # type: ignore[index]
    with pytest.raises(InvalidInputError, match="nested deeper"):
        parse_request(json.dumps(body).encode(), None)


def test_numbers_and_bools_read_from_json_and_binary_data() -> None:
    tokens = np.array([[7]], dtype="<i4").tobytes()
    seed = np.array([2**63 + 1], dtype="<u8").tobytes()
    tensors = [
        {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": [["hi"]]},
        {
            "name": "max_tokens",
            "datatype": "INT32",
            "shape": [1, 1],
            "parameters": {"binary_data_size": len(tokens)},
        },
        {"name": "stream", "datatype": "BOOL", "shape": [1], "data": [False]},
        {"name": "temperature", "datatype": "FP32", "shape": [1], "data": [1]},
        {
            "name": "random_seed",
            "datatype": "UINT64",
            "shape": [1],
            "parameters": {"binary_data_size": len(seed)},
        },
    ]
    head = json.dumps({"inputs": tensors, "parameters": {"top_p": 0.5}}).encode()
    parsed = parse_request(head + tokens + seed, str(len(head)))
    assert {name: t.tolist() for name, t in parsed.inputs.items()} == {
        "text_input": ["hi"],
        "max_tokens": [7],
        "stream": [False],
        "temperature": [1],
        "random_seed": [2**63 + 1],
    }
    tokens = parsed.inputs["max_tokens"]
    assert (tokens.datatype, tokens.shape, tokens.array().dtype) == ("INT32", (1, 1), np.int32)
    assert parsed.parameters == {"top_p": 0.5}
    with pytest.raises(InvalidInputError, match="must be BYTES"):
        parsed.named("max_tokens")


@pytest.mark.parametrize(
    ("tensor", "says"),
    [
        ({"datatype": "BOOL", "data": [1]}, "BOOL tensor holds true or false; data has int"),
        ({"datatype": "INT32", "data": [True]}, "holds integers; data has bool"),
        ({"datatype": "UINT8", "data": [-1]}, "holds integers from 0; data has int -1"),
        ({"datatype": "FP32", "data": ["1"]}, "holds numbers; data has str"),
        ({"datatype": "BF16", "data": [1.0]}, "KServe's are BYTES, BOOL"),
        ({"datatype": "INT64", "parameters": {"binary_data_size": 5}}, "not whole INT64 values"),
        ({"datatype": "UINT8", "data": [256]}, "out of UINT8's range"),
    ],
)
def test_values_not_of_their_datatype_say_why(tensor: dict[str, Any], says: str) -> None:
    body = {"inputs": [{"name": "x", "shape": [1], **tensor}]}
    head = json.dumps(body).encode()
    with pytest.raises(InvalidInputError, match=says):
        parse_request(head + b"\0" * 5, str(len(head)))
