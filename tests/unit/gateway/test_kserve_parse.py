"""KServe v2 infer bodies: whatever the bytes, ``_parse_request`` returns a
validated request or raises ``InvalidInputError`` (a 4xx), nothing else."""

from __future__ import annotations

import contextlib
import json
import struct
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest

from tessera.errors import InvalidInputError
from tessera.gateway.kserve import MAX_TENSOR_RANK, _parse_request

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
        "datatype": st.just("BYTES") | JSON,
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
        parsed = _parse_request(head + blob, str(len(head)) if length == "" else length)
    except InvalidInputError as e:
        message = str(e)
    else:
        assert all(isinstance(t, str) for t in parsed.texts)
        return
    assert message  # every refusal says why


@hypothesis.given(st.binary(max_size=64), st.none() | st.text(max_size=6))
@hypothesis.example(b"{}", "\u00b2")  # a digit to str.isdigit(), not to int(): found so
@hypothesis.settings(max_examples=200, database=None)
def test_any_bytes_parse_or_are_invalid_input(body: bytes, length: str | None) -> None:
    with contextlib.suppress(InvalidInputError):
        _parse_request(body, length)


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
    parsed = _parse_request(head + blob, str(len(head)))
    assert parsed.texts == ["hello", "wörld"]
    assert parsed.request_id == "r1"
    assert parsed.binary_outputs == frozenset({"EMBEDDING"})


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
    parsed = _parse_request(head + query_blob + documents_blob, str(len(head)))
    assert parsed.inputs == {"QUERY": ["q"], "EXTRA": ["x"], "TEXT": ["a", "bc"]}
    assert parsed.named("TEXT") == ["a", "bc"]
    with pytest.raises(InvalidInputError, match="takes one input"):
        _ = parsed.texts
    with pytest.raises(InvalidInputError, match="'OTHER' is missing"):
        parsed.named("OTHER")
    twice = json.dumps({"inputs": [inline, inline]}).encode()
    with pytest.raises(InvalidInputError, match="given twice"):
        _parse_request(twice, None)


def test_nesting_is_bounded_without_recursion() -> None:
    data: object = "x"
    for _ in range(MAX_TENSOR_RANK):
        data = [data]
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": data}]}
    assert _parse_request(json.dumps(body).encode(), None).texts == ["x"]
    body["inputs"][0]["data"] = [data]  # type: ignore[index]
    with pytest.raises(InvalidInputError, match="nested deeper"):
        _parse_request(json.dumps(body).encode(), None)
