"""A gateway process's forward to the engine process's app
(``gateway/forward.py``) over a real Unix socket: requests for the engine's
paths arrive as they were sent, the answer comes back whole, an answer made
before the request's body was read still comes back, and an app that is
not there is a 503 in JSON, never a bare 500."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from starlette.types import Receive, Scope, Send

from tessera.gateway.forward import EngineAppForward, to_engine

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def local_app(scope: Scope, receive: Receive, send: Send) -> None:
    """What the gateway answers itself."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"gateway"})


@asynccontextmanager
async def engine_app(path: Path, handler: Handler) -> AsyncIterator[None]:
    """A stand-in for the engine process's app on ``path``; on leaving, its
    connections' handlers are waited for (and their sockets closed)."""
    handlers: list[asyncio.Task[None]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_unix_server(serve, path=str(path))
    try:
        yield
    finally:
        server.close()
        await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), 5)
        await server.wait_closed()


def client(socket_path: Path) -> httpx.AsyncClient:
    app = EngineAppForward(local_app, socket_path)
    transport = httpx.ASGITransport(app=app, client=("10.1.2.3", 5555))
    return httpx.AsyncClient(transport=transport, base_url="http://gateway")


async def read_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


def test_only_the_engines_paths_are_forwarded() -> None:
    assert to_engine("/admin/residency")
    assert to_engine("/metrics")
    assert to_engine("/dashboard")
    assert to_engine("/dashboard/assets/app.js")
    assert not to_engine("/administrator")
    assert not to_engine("/v1/embeddings")


async def test_a_request_goes_on_as_sent_and_its_answer_comes_back(tmp_path: Path) -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await read_head(reader)
        seen.append(head)
        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        seen.append(await reader.readexactly(length))
        body = b'{"ok": true}'
        writer.write(
            b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        writer.close()

    socket_path = tmp_path / "app.sock"
    async with engine_app(socket_path, handler), client(socket_path) as http:
        response = await http.post(
            "/admin/models?x=1", content=b"folder", headers={"authorization": "Bearer k"}
        )
        assert (await http.get("/v1/models")).text == "gateway"
    assert response.status_code == 201
    assert response.json() == {"ok": True}
    head = seen[0].lower()
    assert head.startswith(b"post /admin/models?x=1 http/1.1")
    assert b"authorization: bearer k" in head
    assert b"x-forwarded-for: 10.1.2.3" in head
    assert seen[1] == b"folder"


async def test_an_answer_made_before_the_body_was_read_comes_back(tmp_path: Path) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)  # and not the body: refused on its length, as uvicorn
        body = b'{"error": "too large"}'  # answers, then reads what is left of the request
        writer.write(
            b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        while await reader.read(65536):
            pass
        writer.close()

    socket_path = tmp_path / "app.sock"
    async with engine_app(socket_path, handler), client(socket_path) as http:
        response = await http.post("/admin/models", content=b"x" * 4_000_000)
    assert response.status_code == 413
    assert response.json() == {"error": "too large"}


async def test_no_engine_app_is_a_503_in_json(tmp_path: Path) -> None:
    async with client(tmp_path / "absent.sock") as http:
        response = await http.get("/admin/residency")
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert "engine process" in response.json()["error"]["message"]


async def test_an_engine_app_that_closes_without_answering_is_a_503(tmp_path: Path) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.close()

    socket_path = tmp_path / "app.sock"
    async with engine_app(socket_path, handler), client(socket_path) as http:
        response = await http.get("/metrics")
    assert response.status_code == 503
