"""Bad input gets the right 4xx JSON error, never a 500: KServe v2 bodies,
images that would decompress to too many pixels, compressed bodies, a text
over its window, a request that could never fit; an unexpected error logs one
line, not a traceback per request."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import struct
import zlib
from collections.abc import MutableMapping
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from tessera.engine import Engine
from tessera.gateway.errors import UnexpectedErrorMiddleware, install_error_handlers

INFER = "/v2/models/embed/infer"


def bytes_input(data: object, shape: object = None, **extra: object) -> dict[str, object]:
    tensor = {"name": "TEXT", "datatype": "BYTES", "data": data, **extra}
    tensor["shape"] = [len(data)] if shape is None and isinstance(data, list) else shape
    return {"inputs": [tensor]}


def nested(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (
            b'{"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": '
            + b"[" * 30_000
            + b"]" * 30_000
            + b"}]}",
            "not valid JSON",
        ),
        (json.dumps(bytes_input(nested(50), [1])).encode(), "nested deeper"),
        (json.dumps({**bytes_input(["a"]), "parameters": "x"}).encode(), "parameters"),
        (json.dumps({**bytes_input(["a"]), "parameters": [1]}).encode(), "parameters"),
        (json.dumps({**bytes_input(["a"]), "outputs": "EMBEDDING"}).encode(), "outputs"),
        (json.dumps({**bytes_input(["a"]), "outputs": [1, 2]}).encode(), "outputs"),
        (json.dumps({**bytes_input(["a"]), "outputs": [{"name": "LABEL"}]}).encode(), "LABEL"),
        (json.dumps(bytes_input(["a", "b"], [3])).encode(), "shape"),
        (json.dumps(bytes_input(["a"], [1, -1])).encode(), "shape"),
        (json.dumps(bytes_input(["a"], "1")).encode(), "shape"),
        (json.dumps(bytes_input([1, None], [2])).encode(), "strings"),
        (json.dumps(bytes_input([["a"], [2.5]], [2, 1])).encode(), "strings"),
        (json.dumps(bytes_input(["a"], [1], datatype="FP32")).encode(), "holds numbers"),
        (json.dumps(bytes_input([1.5], [1], datatype="FP32")).encode(), "must be BYTES"),
        (json.dumps(bytes_input(["a"], [1], datatype="BF16")).encode(), "datatype"),
        (json.dumps({**bytes_input(["a"]), "id": {"x": 1}}).encode(), "id"),
        (
            json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1]}]}).encode(),
            "neither",
        ),
        (json.dumps([1, 2]).encode(), "JSON object"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
async def test_malformed_kserve_bodies_are_4xx_json(
    shared_client: httpx.AsyncClient, body: bytes, says: str
) -> None:
    r = await shared_client.post(INFER, content=body)
    assert 400 <= r.status_code < 500, r.text
    assert says in r.json()["error"]


@pytest.mark.parametrize(
    ("size", "header_length", "says"),
    [
        ("x", None, "binary_data_size"),
        (-1, None, "binary_data_size"),
        (True, None, "binary_data_size"),
        (10**6, None, "binary_data_size"),
        (5, "abc", "inference-header-content-length"),
        (5, "99999", "inference-header-content-length"),
        (5, "-3", "inference-header-content-length"),
    ],
)
async def test_malformed_binary_tensors_are_4xx_json(
    shared_client: httpx.AsyncClient, size: object, header_length: str | None, says: str
) -> None:
    tensor = {
        "name": "TEXT",
        "datatype": "BYTES",
        "shape": [1],
        "parameters": {"binary_data_size": size},
    }
    head = json.dumps({"inputs": [tensor]}).encode()
    blob = struct.pack("<I", 1) + b"a"
    length = str(len(head)) if header_length is None else header_length
    r = await shared_client.post(
        INFER, content=head + blob, headers={"inference-header-content-length": length}
    )
    assert 400 <= r.status_code < 500, r.text
    assert says in r.json()["error"]


async def test_a_well_formed_kserve_body_nested_by_its_shape_is_served(
    shared_client: httpx.AsyncClient,
) -> None:
    r = await shared_client.post(INFER, json=bytes_input([["a", "b"], ["c", "d"]], [2, 2]))
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["shape"][0] == 4


# A lone surrogate, as JSON's escapes give it: Python's json takes it, UTF-8
# cannot encode it, and the real tokenizers raised TypeError on it (a 500).
SURROGATE = '"a\\ud800b"'


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/embeddings", '{"model": "embed", "input": [$S]}', 400),
        ("/v1/rerank", '{"model": "rerank", "query": "q", "documents": ["d", $S]}', 400),
        ("/v1/classify", '{"model": "intent", "inputs": [$S]}', 400),
        ("/v2/embed", '{"model": "embed", "texts": [$S], "input_type": "search_query"}', 400),
        ("/tei/embed/embed", '{"inputs": $S}', 422),  # TEI's status for an invalid request
        (
            INFER,
            '{"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": [$S]}]}',
            400,
        ),
    ],
)
async def test_a_lone_surrogate_in_a_text_is_refused_before_the_model(
    shared_client: httpx.AsyncClient, path: str, body: str, status: int
) -> None:
    content = body.replace("$S", SURROGATE).encode()
    r = await shared_client.post(
        path, content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    assert "surrogate" in r.text


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels (its data is empty)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(("width", "height"), [(7000, 7000), (100_000, 100_000), (2**31 - 1, 2)])
async def test_decompression_bombs_are_refused_from_the_header(
    shared_client: httpx.AsyncClient, width: int, height: int
) -> None:
    bomb = png_header(width, height)
    r = await shared_client.post(
        "/v1/ocr", files={"file": ("bomb.png", bomb)}, data={"model": "ocr"}
    )
    assert r.status_code == 413, r.text
    assert "40,000,000 pixels" in r.json()["error"]["message"]
    image = base64.b64encode(bomb).decode()
    r = await shared_client.post("/v1/ocr", json={"model": "ocr", "image": image})
    assert r.status_code == 413, r.text


async def test_a_decompression_bomb_in_a_chat_image_url_is_refused_from_the_header(
    shared_client: httpx.AsyncClient,
) -> None:
    url = "data:image/png;base64," + base64.b64encode(png_header(100_000, 100_000)).decode()
    content = [
        {"type": "text", "text": "read it"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    body = {"model": "chat", "messages": [{"role": "user", "content": content}]}
    r = await shared_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 413, r.text
    assert "40,000,000 pixels" in r.json()["error"]["message"]


async def test_a_base64_image_over_the_body_limit_is_413(shared_client: httpx.AsyncClient) -> None:
    image = base64.b64encode(b"\0" * 100_000).decode()
    r = await shared_client.post("/v1/ocr", json={"model": "ocr", "image": image})
    assert r.status_code == 413
    assert "bytes" in r.json()["error"]["message"]


@pytest.mark.parametrize(("width", "height"), [(5000, 1), (3, 3000), (8000, 10)])
async def test_an_image_too_thin_for_rapidocrs_resize_is_400(
    shared_client: httpx.AsyncClient, width: int, height: int
) -> None:
    # Brought to 2,000 pixels on its long side, its short side rounds to 0
    # multiples of 32: rapidocr raised ResizeImgError, a 500.
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), "white").save(buffer, format="PNG")
    image = base64.b64encode(buffer.getvalue()).decode()
    for mode in ("page", "line"):
        r = await shared_client.post("/v1/ocr", json={"model": "ocr", "image": image, "mode": mode})
        assert r.status_code == 400, r.text
        assert f"{width} x {height} pixels" in r.json()["error"]["message"]


async def test_ocr_json_bodies_nested_deeply_or_of_the_wrong_shape_are_4xx(
    shared_client: httpx.AsyncClient,
) -> None:
    over_limit = b"[" * 50_000 + b"]" * 50_000
    deep = b"[" * 3000 + b"]" * 3000  # within the body limit, past the JSON parser's depth
    for body in (over_limit, deep, b'{"model": "ocr", "image": 5}', b"[]", b'"x"'):
        r = await shared_client.post(
            "/v1/ocr", content=body, headers={"content-type": "application/json"}
        )
        assert 400 <= r.status_code < 500, r.text
        assert r.json()["error"]["message"]
    fields = {"model": "ocr", "fields": deep.decode()}
    r = await shared_client.post("/v1/ocr", files={"file": ("page.png", b"x")}, data=fields)
    assert r.status_code == 400, r.text
    assert "'fields' must be JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
async def test_compressed_bodies_are_refused_with_415(
    shared_client: httpx.AsyncClient, encoding: str
) -> None:
    body = zlib.compress(json.dumps({"model": "embed", "input": "x"}).encode())
    r = await shared_client.post(
        "/v1/embeddings",
        content=body,
        headers={"content-type": "application/json", "content-encoding": encoding},
    )
    assert r.status_code == 415
    assert encoding in r.json()["error"]["message"]


async def test_a_request_whose_activations_could_never_fit_is_413_not_503(
    client: httpx.AsyncClient,
) -> None:
    # scratch allocates 1.25 MiB per unit and the budget is 64 MiB: 60 units
    # could never run beside its weights. Its warm-up's estimate refuses
    # nothing: two requests run (in the room there is) and are measured, and
    # their readings refuse the third.
    assert (await client.post("/admin/models/scratch/load")).status_code == 200
    statuses = []  # (a reading may come out low: then a later run is the second over)
    while len(statuses) < 6 and 413 not in statuses:
        r = await client.post("/v1/embeddings", json={"model": "scratch", "input": "x" * 240})
        statuses.append(r.status_code)
    assert statuses[:2] == [200, 200], statuses
    assert r.status_code == 413, r.text
    message = r.json()["error"]["message"]
    assert "bytes of activations beside 1,000 bytes of weights" in message
    assert "over the whole budget of 67,108,864 bytes: it could never run" in message
    r = await client.post("/v1/embeddings", json={"model": "scratch", "input": "x" * 16})
    assert r.status_code == 200  # a smaller one is served


async def test_a_long_text_is_served_and_charged_to_its_window(
    shared_client: httpx.AsyncClient,
) -> None:
    # The window is 512 tokens by default: a text of about 10,000 tokens is
    # truncated to it, served, and charged (and counted in usage) as 512.
    r = await shared_client.post("/v1/embeddings", json={"model": "embed", "input": "word " * 8000})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 512


def failing_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom/{n}")
    async def boom(n: int) -> None:
        raise RuntimeError(f"boom {n}")

    @app.get("/other")
    async def other() -> None:
        raise KeyError("other")

    app.add_middleware(UnexpectedErrorMiddleware)
    return app


async def test_an_unexpected_error_is_a_json_500_logged_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    transport = httpx.ASGITransport(app=failing_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        with caplog.at_level(logging.INFO, logger="tessera.gateway.errors"):
            responses = [await client.get(f"/boom/{i}") for i in range(5)]
            responses.append(await client.get("/other"))
    assert [r.status_code for r in responses] == [500] * 6
    assert responses[0].json()["error"]["message"] == "internal error: RuntimeError"
    records = [r for r in caplog.records if r.name == "tessera.gateway.errors"]
    assert len(records) == 6  # one line a request
    with_traceback = [r.getMessage() for r in records if r.exc_info]
    # A traceback once per route and error type: /boom/{n} RuntimeError, /other KeyError.
    assert len(with_traceback) == 2
    assert "GET /boom/{n}: RuntimeError" in with_traceback[0]
    assert all("\n" not in r.getMessage() for r in records)


async def test_tracebacks_show_again_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    transport = httpx.ASGITransport(app=failing_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        with caplog.at_level(logging.DEBUG, logger="tessera.gateway.errors"):
            for i in range(3):
                await client.get(f"/boom/{i}")
    assert sum(1 for r in caplog.records if r.exc_info) == 3


async def test_the_real_app_answers_a_bug_with_a_json_500_and_one_traceback(
    client: httpx.AsyncClient,
    engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken_submit(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(engine, "submit", broken_submit)
    with caplog.at_level(logging.INFO, logger="tessera.gateway.errors"):
        for i in range(4):
            r = await client.post("/v1/embeddings", json={"model": "embed", "input": f"x{i}"})
            assert r.status_code == 500
            assert r.json()["error"] == {
                "message": "internal error: RuntimeError",
                "type": "internal_error",
                "code": 500,
            }
    records = [r for r in caplog.records if r.name == "tessera.gateway.errors"]
    assert len(records) == 4
    assert sum(1 for r in records if r.exc_info) == 1


async def test_a_bug_behind_the_websocket_is_an_error_for_its_id_in_one_log_line(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tessera.gateway import create_app
    from tessera.gateway import websocket as ws

    async def broken(*args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setitem(ws._HANDLERS, "embeddings", broken)
    app = create_app(engine, max_body_bytes=64 * 1024)
    asks = [
        {"id": f"e{i}", "type": "embeddings", "model": "embed", "input": "x"} for i in range(3)
    ] + [{"id": "r", "type": "rerank", "model": "rerank", "query": "q", "documents": ["a"]}]
    incoming: list[MutableMapping[str, Any]] = [{"type": "websocket.connect"}]
    incoming += [{"type": "websocket.receive", "text": json.dumps(a)} for a in asks]
    answers: dict[str, dict[str, Any]] = {}
    all_answered = asyncio.Event()

    async def receive() -> MutableMapping[str, Any]:
        if incoming:
            return incoming.pop(0)
        await all_answered.wait()  # then the client leaves
        return {"type": "websocket.disconnect", "code": 1000}

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "websocket.send":
            answer = json.loads(str(message["text"]))
            answers[answer["id"]] = answer
            if len(answers) == len(asks):
                all_answered.set()

    scope = {"type": "websocket", "path": "/v1/ws", "headers": [], "query_string": b""}
    with caplog.at_level(logging.INFO, logger="tessera.gateway.errors"):
        await asyncio.wait_for(app(scope, receive, send), 30)
    for i in range(3):  # each message answered for its id; the socket served on
        assert answers[f"e{i}"]["type"] == "error"
        assert answers[f"e{i}"]["error"] == {
            "message": "internal error: RuntimeError",
            "type": "internal_error",
            "code": 500,
        }
    assert answers["r"]["type"] != "error"
    records = [r for r in caplog.records if r.name == "tessera.gateway.errors"]
    assert len(records) == 3  # one line a message, its traceback once
    assert sum(1 for r in records if r.exc_info) == 1
    assert "WS /v1/ws embeddings: RuntimeError" in records[0].getMessage()


TWELVE_BIG_PAGES = 12 * 6300 * 6300  # each just under the 40-megapixel limit


def kserve_images(pages: list[bytes]) -> dict[str, object]:
    data = [base64.b64encode(p).decode() for p in pages]
    return {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [len(data)], "data": data}]}


async def test_twelve_big_pages_in_one_request_are_413_from_their_headers(
    shared_client: httpx.AsyncClient,
) -> None:
    # Each page's header says 6,300 x 6,300 and its data is empty: decoding
    # any of them would fail (415), so the 413 shows none was decoded.
    pages = [png_header(6300, 6300)] * 12
    r = await shared_client.post("/v2/models/ocr/infer", json=kserve_images(pages))
    assert r.status_code == 413, r.text
    message = r.json()["error"]
    assert f"12 images of {TWELVE_BIG_PAGES:,} pixels in all" in message
    assert "at most 120,000,000 pixels (max_request_pixels)" in message
    # Three such pages are within the bound: queued undecoded (the fake model
    # reads their shape alone, the real one decodes each as its page runs).
    r = await shared_client.post("/v2/models/ocr/infer", json=kserve_images(pages[:3]))
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == ["6300x6300"] * 3


async def test_a_chat_with_more_images_than_a_request_may_carry_is_413(
    shared_client: httpx.AsyncClient,
) -> None:
    url = "data:image/png;base64," + base64.b64encode(png_header(8, 8)).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}] * 65
    body = {"model": "chat", "messages": [{"role": "user", "content": content}]}
    r = await shared_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 413, r.text
    assert (
        "65 images in one request; at most 64 (max_request_pages)" in r.json()["error"]["message"]
    )


async def test_the_request_image_limits_are_the_apps_and_bound_websocket_pages(
    engine: Engine,
) -> None:
    from tessera.gateway import create_app
    from tessera.tasks.image import RequestImageLimits

    limits = RequestImageLimits(max_request_pixels=10_000, max_request_pages=2)
    app = create_app(engine, max_body_bytes=64 * 1024, image_limits=limits)
    transport = httpx.ASGITransport(app=app)
    page = base64.b64encode(png_header(100, 100)).decode()
    async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
        r = await client.post("/v1/ocr", json={"model": "ocr", "image": page})
        assert r.status_code == 200, r.text
        big = base64.b64encode(png_header(101, 100)).decode()
        r = await client.post("/v1/ocr", json={"model": "ocr", "image": big})
        assert r.status_code == 413, r.text
        assert "10,100 pixels in all" in r.json()["error"]["message"]
        assert "at most 10,000 pixels" in r.json()["error"]["message"]
    # A WebSocket message's pages run as requests of their own: they are
    # bounded together, before any runs.
    ask = {"id": "p", "type": "ocr", "model": "ocr", "images": [page] * 3}
    incoming: list[MutableMapping[str, Any]] = [
        {"type": "websocket.connect"},
        {"type": "websocket.receive", "text": json.dumps(ask)},
    ]
    answers: list[dict[str, Any]] = []
    answered = asyncio.Event()

    async def receive() -> MutableMapping[str, Any]:
        if incoming:
            return incoming.pop(0)
        await answered.wait()
        return {"type": "websocket.disconnect", "code": 1000}

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "websocket.send":
            answers.append(json.loads(str(message["text"])))
            if answers[-1]["type"] in ("error", "result"):
                answered.set()

    scope = {"type": "websocket", "path": "/v1/ws", "headers": [], "query_string": b""}
    await asyncio.wait_for(app(scope, receive, send), 30)
    assert [a["type"] for a in answers] == ["error"], answers  # no page was read
    assert answers[0]["error"]["code"] == 413
    assert "3 images in one request; at most 2" in answers[0]["error"]["message"]
