"""The hot routes served by ``FastRoutes`` (gateway/fast.py) answer exactly as
FastAPI does, and what the fast path is not sure of goes to FastAPI with its
body intact."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from tessera.engine import Engine
from tessera.errors import InvalidInputError
from tessera.gateway import create_app
from tessera.gateway.errors import UnexpectedErrorMiddleware, install_error_handlers
from tessera.gateway.fast import FastRoute, FastRoutes, install_fast_routes


class Echo(BaseModel):
    text: str
    times: int = 1


router = APIRouter()


@router.post("/echo/{name}")
async def echo(body: Echo, request: Request, name: str) -> Response:
    if body.text == "refuse":
        raise InvalidInputError("refused by the endpoint")
    if body.text == "bug":
        raise RuntimeError("a bug")
    return JSONResponse({"name": name, "text": body.text * body.times})


@router.post("/other")
async def other(body: Echo, request: Request) -> Response:
    return JSONResponse({"other": body.text})


class Recorder:
    """The app FastRoutes falls through to: FastAPI, with what it was given written down."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks: list[bytes] = []

        async def recording() -> Any:
            message = await receive()
            chunks.append(message.get("body", b""))
            return message

        try:
            await self.app(scope, recording, send)
        finally:
            self.bodies.append(b"".join(chunks))


@pytest.fixture
async def served() -> AsyncIterator[tuple[httpx.AsyncClient, Recorder]]:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(router)
    recorder = Recorder(app)
    fast = UnexpectedErrorMiddleware(
        FastRoutes(recorder, [FastRoute.of(r) for r in router.routes if r.path != "/other"])  # type: ignore[arg-type]
    )

    async def outer(scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = app  # as Starlette's app sets it for its middleware
        await fast(scope, receive, send)

    transport = httpx.ASGITransport(app=outer)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        yield client, recorder


async def test_a_valid_body_is_served_by_the_endpoint_without_fastapi(
    served: tuple[httpx.AsyncClient, Recorder],
) -> None:
    client, recorder = served
    r = await client.post("/echo/a%20b", json={"text": "xy", "times": 2})
    assert r.status_code == 200
    assert r.json() == {"name": "a b", "text": "xyxy"}
    assert recorder.bodies == []


async def test_an_engine_error_is_answered_by_the_apps_handler(
    served: tuple[httpx.AsyncClient, Recorder],
) -> None:
    client, recorder = served
    r = await client.post("/echo/a", json={"text": "refuse"})
    assert r.status_code == 422
    assert r.json()["error"] == {
        "message": "refused by the endpoint",
        "type": "invalid_request_error",
        "code": 422,
    }
    r = await client.post("/echo/a", json={"text": "bug"})
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "internal error: RuntimeError"
    assert recorder.bodies == []


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (b'{"text": ', {"content-type": "application/json"}),  # not JSON
        (b'{"times": 2}', {"content-type": "application/json"}),  # no text
        (b'{"text": "x"}', {"content-type": "text/plain"}),  # not said to be JSON
        (b'{"text": "x"}', {}),  # nothing said
    ],
)
async def test_what_the_fast_path_is_not_sure_of_goes_to_fastapi_with_its_body(
    served: tuple[httpx.AsyncClient, Recorder], body: bytes, headers: dict[str, str]
) -> None:
    client, recorder = served
    r = await client.post("/echo/a", content=body, headers=headers)
    assert recorder.bodies == [body]
    assert r.status_code == 422  # as FastAPI answers each of them
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_a_route_not_given_to_it_goes_to_fastapi(
    served: tuple[httpx.AsyncClient, Recorder],
) -> None:
    client, recorder = served
    r = await client.post("/other", json={"text": "x"})
    assert r.json() == {"other": "x"}
    assert recorder.bodies == [b'{"text":"x"}']
    r = await client.get("/echo/a")
    assert r.status_code == 405


def test_only_routes_of_the_routers_given_can_be_fast() -> None:
    async def stray(request: Request) -> Response:
        return Response()

    with pytest.raises(ValueError, match="stray"):
        install_fast_routes(FastAPI(), [router], [echo, stray])


def _without_ids(response: httpx.Response) -> Any:
    """The answer, less the id each answer is given anew."""
    if not response.headers["content-type"].startswith("application/json"):
        return response.content
    return {k: v for k, v in response.json().items() if k != "id"}


def _png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), "white").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"model": "embed", "input": ["a b", "c"]}),
        ("/v1/embeddings", {"model": "embed", "input": "a", "encoding_format": "base64"}),
        ("/v1/embeddings", {"model": "embed", "input": ""}),
        ("/v1/embeddings", {"model": "nope", "input": "a"}),
        ("/v1/embeddings", {"model": "embed", "input": ["a"] * 5}),
        ("/v1/embeddings", {"model": "embed", "input": "a", "dimensions": 0}),
        ("/v1/embeddings", {"model": "embed"}),
        ("/v1/embeddings", ["not", "an", "object"]),
        ("/v1/embeddings", {"model": "intent", "input": "a"}),
        ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["a", "bb"]}),
        ("/v1/classify", {"model": "intent", "input": ["hello", "hey"]}),
        ("/v1/translate", {"model": "mt", "input": ["abc", "xy"]}),
        ("/v1/ocr", {"model": "ocr", "image": "%%%"}),
        ("/v1/ocr", {"model": "ocr", "image": _png()}),
        ("/v1/audio/speech", {"model": "tts", "input": ""}),
        ("/v2/models/embed/infer", {"inputs": []}),
        (
            "/v2/models/embed/infer",
            {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["a"]}]},
        ),
        ("/v2/models/embed/versions/7/infer", {"inputs": []}),
    ],
)
async def test_the_apps_hot_routes_answer_as_fastapi_does(
    shared_client: httpx.AsyncClient, shared_engine: Engine, path: str, body: Any
) -> None:
    """The same request to the app and to one without FastRoutes (FastAPI serves
    every route) gets the same answer."""
    app = create_app(shared_engine, max_body_bytes=64 * 1024)
    app.user_middleware = [m for m in app.user_middleware if m.cls is not FastRoutes]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as plain:
        fast = await shared_client.post(path, json=body)
        slow = await plain.post(path, json=body)
    assert fast.status_code == slow.status_code
    assert _without_ids(fast) == _without_ids(slow)
    same = ("content-type", "retry-after", "x-model-version")
    assert {h: fast.headers.get(h) for h in same} == {h: slow.headers.get(h) for h in same}
    assert fast.headers["x-request-id"]


async def test_a_client_gone_before_its_answer_drops_its_queued_request(
    client: httpx.AsyncClient, engine: Engine
) -> None:
    """The watcher cancels the request's own task (fast.py runs the endpoint in
    it): the request leaves the queue unrun and the answer is 499."""
    await engine.load("slow")  # one request a batch, 0.1 s each
    first = asyncio.ensure_future(
        client.post("/v1/embeddings", json={"model": "slow", "input": "a"})
    )
    for _ in range(500):  # until the first is taken into a batch
        model = engine.snapshot().model("slow")
        if model is not None and model.num_requests == 1 and model.queue_depth == 0:
            break
        await asyncio.sleep(0.01)
    body = b'{"model": "slow", "input": "b"}'
    messages = [{"type": "http.request", "body": body}, {"type": "http.disconnect"}]
    sent: list[Any] = []

    async def receive() -> Any:
        return messages.pop(0)  # the second read is the watcher's, once it is queued

    async def send(message: Any) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": headers}
    await create_app(engine)({**scope, "query_string": b"", "client": None}, receive, send)
    assert sent[0]["status"] == 499
    assert (await first).status_code == 200
    stats = engine.snapshot().model("slow")
    assert stats is not None
    assert (stats.num_requests, stats.num_batches) == (2, 1)  # the second never ran
