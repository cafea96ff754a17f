"""The HTTP server around the app: a graceful stop, and read deadlines for slow clients.

Uvicorn's own SIGTERM handling closes the listener at once (readiness then
reads "connection refused", never "draining") and raises the signal again
once it has stopped (exit status -15). Here, instead:

- The first SIGTERM or SIGINT drains (``Engine.drain``): readiness turns 503
  at once, new work gets 503 with Retry-After, and the listener keeps
  answering probes and the requests already accepted, for up to
  ``shutdown_grace_s``; what is still pending then gets a 503. Only then does
  uvicorn close the listener and the app's lifespan stop the engine (workers,
  llama.cpp processes) and flush the audit log. The exit status is 0.
- A second signal ends the grace period now (the pending requests get their
  503 at once); the stop is otherwise the same.

Uvicorn times out nothing before a request's first response: a client can
trickle its headers, or its body, a byte at a time and hold a connection and
its task for ever (slowloris). ``TimedHttpProtocol`` bounds both: the head
must arrive within ``header_timeout_s`` of its first byte (or of the
connection), the whole body within ``body_timeout_s`` of the head. Either
gets a 408 JSON answer where nothing has been answered yet, and the
connection is closed.

Nor does it bound a head's size: it buffered a URL or a header as long as
the client streamed it, and joined a URL's pieces at a cost that grows with
its square, on the one event loop every request shares. ``TimedHttpProtocol``
counts a head's bytes before the parser sees them (``gateway/head.py``): a
URL over ``max_url_bytes`` gets 414, a header over ``max_header_bytes``, more
than ``max_num_headers`` or a head over ``max_head_bytes`` 431, and the
connection is closed; and an address holding ``max_num_opening_connections``
connections that have sent no head for a second has its next one closed (429).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import math
import signal
from collections.abc import Callable, Generator
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from tessera.config import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, ServerConfig
from tessera.engine import ServingEngine
from tessera.gateway.errors import error_body_for
from tessera.gateway.head import HeadLimits, HeadRefusal, OpeningConnections

log = logging.getLogger(__name__)

# After the drain, how long uvicorn waits for answers still being written.
FLUSH_S = 5
WS_SLACK_BYTES = 64 * 1024
# A request line's method, spaces and version around its URL, and a line's CRLF.
_REQUEST_LINE_SLACK_BYTES = 64
# A body is given to the parser in pieces no smaller than this, however small
# max_head_bytes is: a piece's end may begin the next head, uncounted.
_MIN_BODY_PIECE_BYTES = 64 * 1024


class GatewayConfig(uvicorn.Config):
    """Uvicorn's settings and the read deadlines ``TimedHttpProtocol`` applies."""

    def __init__(
        self,
        app: Any,
        *,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        head_limits: HeadLimits | None = None,
        opening: OpeningConnections | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, http=TimedHttpProtocol, timeout_graceful_shutdown=FLUSH_S, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.head_limits = head_limits or HeadLimits()
        # One per server: its connections share it (one event loop, no lock).
        self.opening = opening or OpeningConnections(None)


def http_config(
    app: Any, settings: ServerConfig, log_level: str, *, trust_forwarded: bool = False, **where: Any
) -> GatewayConfig:
    """Uvicorn's settings for ``app`` from the server's config; ``where`` says
    where it listens (host and port, a Unix socket, or sockets given to
    ``serve``). ``trust_forwarded``: X-Forwarded-For names the client,
    whoever sends it (the engine process's own socket, which only its
    gateways reach)."""
    trusted = ["*"] if trust_forwarded else list(settings.trusted_proxies)
    return GatewayConfig(
        app,
        log_level=log_level.lower(),
        log_config=None,
        # Off by default: every request has an audit row, and uvicorn's line a
        # request was about 8% of a gateway's CPU (cProfile, docs/benchmarks.md).
        access_log=settings.access_log,
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        head_limits=HeadLimits(
            max_url_bytes=settings.max_url_bytes,
            max_header_bytes=settings.max_header_bytes,
            max_head_bytes=settings.max_head_bytes,
            max_num_headers=settings.max_num_headers,
        ),
        # The engine process's own socket (trust_forwarded) hears only its gateways.
        opening=OpeningConnections(
            None if trust_forwarded else settings.max_num_opening_connections,
            settings.trusted_proxies,
        ),
        # websockets' bound on a message it reads whole: the app answers one over
        # max_body_bytes itself (1009 with its message); far over, the library cuts.
        ws_max_size=settings.max_body_bytes + WS_SLACK_BYTES,
        timeout_keep_alive=math.ceil(settings.keep_alive_s),
        # The client's address is the peer's unless a trusted proxy says otherwise:
        # uvicorn would take X-Forwarded-For from any local caller by default.
        proxy_headers=bool(trusted),
        forwarded_allow_ips=trusted,
        **where,
    )


class TimedHttpProtocol(HttpToolsProtocol):
    """Uvicorn's httptools protocol with deadlines on reading a request, and
    caps on what a client sends before its request is known (``gateway/head.py``).

    One timer at a time: the head's from the connection (or the request's
    first byte) to the end of its headers, then the body's to its last byte."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        gateway = config if isinstance(config, GatewayConfig) else None
        self._header_timeout_s = gateway.header_timeout_s if gateway else DEFAULT_HEADER_TIMEOUT_S
        self._body_timeout_s = gateway.body_timeout_s if gateway else DEFAULT_BODY_TIMEOUT_S
        self._limits = gateway.head_limits if gateway else HeadLimits()
        self._opening = gateway.opening if gateway else None
        self._deadline: asyncio.TimerHandle | None = None
        self._head_begun = False
        self._max_head_bytes = self._limits.max_head_bytes
        self._head_bytes = 0  # of the head being read, as given to the parser
        self._line_bytes = 0  # of its last line, unfinished
        # A header line, or the request line (whose URL on_url caps first).
        self._max_line_bytes = max(
            self._limits.max_header_bytes, self._limits.max_url_bytes + _REQUEST_LINE_SLACK_BYTES
        )
        self._num_heads = 0  # heads read whole on this connection
        self._body_piece_bytes = max(self._limits.max_head_bytes, _MIN_BODY_PIECE_BYTES)
        self._in_body = False
        self._upgraded = False
        self._refusal: HeadRefusal | None = None  # set by a parser callback over a cap

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        opening = self._opening
        if opening is not None and not opening.admit(self._peer(), id(self), self.loop.time()):
            refusal = HeadRefusal.opening(opening.max_num_per_address or 0)
            self._refuse(refusal, retry_after_s=1)
            return
        self._arm(self._header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._release()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Invariant: the parser is given a head's bytes only while they fit
        # its room (max_head_bytes), whatever the client streams, and a head
        # still not whole once its room is gone is refused. A head pipelined
        # behind a request may begin inside a piece of that request (the
        # parser does not say where), uncounted: so at most twice the cap of
        # one head reaches the parser. Body bytes are the app's to bound.
        start = 0
        while start < len(data) and not self._upgraded and not self.transport.is_closing():
            in_body = self._in_body
            room = self._body_piece_bytes if in_body else self._max_head_bytes - self._head_bytes
            piece = data[start : start + room] if start or room < len(data) else data
            start += len(piece)
            num_heads = self._num_heads
            if not in_body:
                self._head_bytes += len(piece)
            if piece:
                self._feed(piece)
            if self.transport.is_closing() or self._upgraded:
                return
            if in_body or self._num_heads != num_heads or self._in_body:
                self._line_bytes = 0  # the piece's end was a body's or a next head's
            elif self._line_too_long(piece):
                self._refuse(HeadRefusal.header(self._limits))
                return
            elif start < len(data):
                self._refuse(HeadRefusal.head(self._limits))
                return

    def _line_too_long(self, piece: bytes) -> bool:
        """Whether a line of the head still being read is over a line's cap.
        The parser tells of a header only once the next one begins: one
        streamed for ever would meet only the head's cap."""
        if b"\n" not in piece:
            self._line_bytes += len(piece)
            return self._line_bytes > self._max_line_bytes
        lengths = [len(line) for line in piece.split(b"\n")]
        lengths[0] += self._line_bytes
        self._line_bytes = lengths[-1]
        return max(lengths) > self._max_line_bytes

    def _feed(self, data: bytes) -> None:
        """Uvicorn's ``data_received``, with a cap's own answer for a callback's refusal."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(self._refusal)
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def handle_websocket_upgrade(self) -> None:
        self._upgraded = True  # the WebSocket's protocol reads from here on
        super().handle_websocket_upgrade()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_begun = True
        if self._deadline is None:  # a later request on a kept-alive connection
            self._arm(self._header_timeout_s, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        if len(self.url) + len(url) > self._limits.max_url_bytes:
            raise self._refused(HeadRefusal.url(self._limits))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > self._limits.max_header_bytes:
            raise self._refused(HeadRefusal.header(self._limits))
        if len(self.headers) >= self._limits.max_num_headers:
            raise self._refused(HeadRefusal.num_headers(self._limits))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._head_begun = False
        self._num_heads += 1
        self._head_bytes = 0
        self._in_body = True
        self._release()
        super().on_headers_complete()
        if _has_body(self.headers) and self.cycle is not None:
            self._arm(self._body_timeout_s, self._body_timed_out, self.cycle)

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_body = False
        super().on_message_complete()

    def _refused(self, refusal: HeadRefusal) -> _HeadRefused:
        """Kept for ``_feed``: httptools wraps what a callback raises."""
        self._refusal = refusal
        return _HeadRefused(refusal.message)

    def _refuse(self, refusal: HeadRefusal, retry_after_s: int | None = None) -> None:
        """Answer ``refusal`` (unless a response is being written) and close."""
        log.info("closing a connection from %s: %s", self._client(), refusal.message)
        running = self.cycle is not None and not self.cycle.response_complete
        if not running:
            url = getattr(self, "url", b"")  # set from a request's first byte
            path = url.partition(b"?")[0].decode("latin-1") if refusal.status != 414 else ""
            headers = [] if retry_after_s is None else [(b"retry-after", str(retry_after_s))]
            self._write_error(
                refusal.status, refusal.message, refusal.kind, path=path, extra=headers
            )
        self.transport.close()

    def _release(self) -> None:
        if self._opening is not None:
            self._opening.release(self._peer(), id(self))

    def _peer(self) -> str | None:
        """The socket's peer address (never X-Forwarded-For: no head is read yet)."""
        return self.client[0] if self.client else None

    def _arm(self, seconds: float, callback: Callable[..., None], *args: object) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, callback, *args)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        running = self.cycle is not None and not self.cycle.response_complete
        log.info(
            "closing a connection from %s: no request head within %gs",
            self._client(),
            self._header_timeout_s,
        )
        # Nothing sent at all (an idle connection) is closed without an answer,
        # as is a head trickling behind a request still being answered.
        if self._head_begun and not running:
            message = f"request headers not received within {self._header_timeout_s:g}s"
            self._write_error(408, message, "request_timeout")
        self.transport.close()

    def _body_timed_out(self, cycle: RequestResponseCycle) -> None:
        self._deadline = None
        if cycle is not self.cycle or cycle.response_complete or self.transport.is_closing():
            return
        log.info(
            "closing a connection from %s: no request body within %gs",
            self._client(),
            self._body_timeout_s,
        )
        if not cycle.response_started:
            request_id = cycle.scope.get("state", {}).get("request_id")
            self._write_error(
                408,
                f"request body not received within {self._body_timeout_s:g}s",
                "request_timeout",
                request_id,
                cycle.scope.get("path", ""),
            )
        # The app, waiting for the body, reads a disconnect; its answer goes nowhere.
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.close()

    def _client(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "?"

    def _write_error(
        self,
        status: int,
        message: str,
        kind: str,
        request_id: str | None = None,
        path: str = "",
        extra: list[tuple[bytes, str]] | None = None,
    ) -> None:
        """An error answer written on the transport, closing the connection; in
        the shape of ``path``'s API where its head was read."""
        body = json.dumps(error_body_for(path, status, message, kind)).encode()
        head = [
            f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}".encode(),
            b"content-type: application/json",
            b"content-length: " + str(len(body)).encode(),
            b"connection: close",
        ]
        if request_id is not None:
            head.append(b"x-request-id: " + request_id.encode("latin-1"))
        head += [name + b": " + value.encode("latin-1") for name, value in extra or ()]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)


class _HeadRefused(Exception):
    """Raised in a parser callback to stop at a cap (``_refusal`` says which)."""


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"content-length":
            return value.strip() not in (b"", b"0")
        if name == b"transfer-encoding":
            return b"chunked" in value.lower()
    return False


class GatewayServer(uvicorn.Server):
    """Uvicorn's server with a drain before it stops (see the module's notes)."""

    def __init__(
        self, config: uvicorn.Config, engine: ServingEngine, shutdown_grace_s: float
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_grace_s = shutdown_grace_s
        self._drain: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Uvicorn's raises the caught signal again after stopping: the exit
        # status would be the signal's, not 0.
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._drain is None:
            log.info(
                "%s: draining, up to %gs for accepted requests", sig.name, self.shutdown_grace_s
            )
            self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())
        else:
            log.warning("%s again: answering what is pending now, then stopping", sig.name)
            asyncio.get_running_loop().create_task(self.engine.drain(0))

    async def _drain_then_exit(self) -> None:
        try:
            num_cut = await self.engine.drain(self.shutdown_grace_s)
            if num_cut:
                log.warning("%d requests still pending after the drain got 503", num_cut)
        finally:
            self.should_exit = True
