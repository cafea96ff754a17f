"""A gateway process's way to the engine process's own app, for the routes
that read or change the engine's state rather than run a request.

With gateway processes (``gateways`` in the config), the engine process
serves the whole app on a Unix socket of its own, and each gateway passes
``/admin/*``, ``/metrics`` and ``/dashboard*`` there unchanged, before its
own middleware: the metrics, the live page, residency, tenants and model
admin are the engine process's, one view whichever gateway a client reaches,
and authenticated and audited there. The client's address goes with the
request as ``X-Forwarded-For`` (that app trusts it: the socket is the
server's own).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.gateway.errors import error_body

log = logging.getLogger(__name__)

ENGINE_PATHS = ("/admin", "/metrics", "/dashboard")
_CHUNK = 65536


def to_engine(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in ENGINE_PATHS)


class EngineAppForward:
    """ASGI middleware: requests for ``ENGINE_PATHS`` go to the app on
    ``socket_path`` (module notes); the rest to ``app``."""

    def __init__(self, app: ASGIApp, socket_path: Path) -> None:
        self.app = app
        self.socket_path = socket_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not to_engine(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            reader, writer = await asyncio.open_unix_connection(str(self.socket_path))
        except OSError as e:
            log.error("the engine process's app is not reachable: %s", e)
            await _unavailable(send)
            return
        try:
            started = await _forward(scope, receive, send, reader, writer)
        except (OSError, h11.ProtocolError) as e:
            log.error("forwarding %s to the engine process failed: %s", scope["path"], e)
            started = None
        finally:
            writer.close()
        if started is False:  # nothing was answered: say why, as JSON
            await _unavailable(send)


async def _forward(
    scope: Scope,
    receive: Receive,
    send: Send,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> bool | None:
    """Send the request on and the answer back. Whether an answer began
    (False: none came), or None when the client left first."""
    conn = h11.Connection(h11.CLIENT)
    target = scope["raw_path"] if scope.get("raw_path") else scope["path"].encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    # Kept alive (no "connection: close"): an app that answers before it has
    # read the body (a 413) then reads the rest rather than closing on it,
    # which would reset the socket and lose the answer; the connection is
    # closed here once the answer is in.
    headers = [
        (name, value)
        for name, value in scope["headers"]
        if name not in (b"host", b"connection", b"x-forwarded-for")
    ]
    headers.append((b"host", b"tessera-engine"))
    client = scope.get("client")
    if client:
        headers.append((b"x-forwarded-for", str(client[0]).encode("latin-1")))
    if not any(name in (b"content-length", b"transfer-encoding") for name, _ in headers):
        headers.append((b"transfer-encoding", b"chunked"))
    writer.write(conn.send(h11.Request(method=scope["method"], target=target, headers=headers)))
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            if body:
                writer.write(conn.send(h11.Data(data=body)))
            if not message.get("more_body", False):
                break
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()
    except ConnectionError:
        pass  # the engine's app answered and closed before it read it all: its answer follows
    started = False
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await reader.read(_CHUNK)
            conn.receive_data(data)
            if not data and not started:
                return False
            continue
        if isinstance(event, h11.Response):
            started = True
            # uvicorn frames the body itself (chunked where no length is given).
            kept = [
                (n, v) for n, v in event.headers if n not in (b"connection", b"transfer-encoding")
            ]
            await send(
                {"type": "http.response.start", "status": event.status_code, "headers": kept}
            )
        elif isinstance(event, h11.Data):
            await send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return started


async def _unavailable(send: Send) -> None:
    body = json.dumps(
        error_body(503, "the engine process is not answering", "engine_unavailable")
    ).encode()
    start: Message = {
        "type": "http.response.start",
        "status": 503,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"),
        ],
    }
    await send(start)
    await send({"type": "http.response.body", "body": body})
