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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import signal
from collections.abc import Callable, Generator
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from tessera.config import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, ServerConfig
from tessera.engine import ServingEngine
from tessera.gateway.errors import error_body_for

log = logging.getLogger(__name__)

# After the drain, how long uvicorn waits for answers still being written.
FLUSH_S = 5


class GatewayConfig(uvicorn.Config):
    """Uvicorn's settings and the read deadlines ``TimedHttpProtocol`` applies."""

    def __init__(
        self,
        app: Any,
        *,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, http=TimedHttpProtocol, timeout_graceful_shutdown=FLUSH_S, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s


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
        timeout_keep_alive=math.ceil(settings.keep_alive_s),
        # The client's address is the peer's unless a trusted proxy says otherwise:
        # uvicorn would take X-Forwarded-For from any local caller by default.
        proxy_headers=bool(trusted),
        forwarded_allow_ips=trusted,
        **where,
    )


class TimedHttpProtocol(HttpToolsProtocol):
    """Uvicorn's httptools protocol with deadlines on reading a request.

    One timer at a time: the head's from the connection (or the request's
    first byte) to the end of its headers, then the body's to its last byte."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        timed = config if isinstance(config, GatewayConfig) else None
        self._header_timeout_s = timed.header_timeout_s if timed else DEFAULT_HEADER_TIMEOUT_S
        self._body_timeout_s = timed.body_timeout_s if timed else DEFAULT_BODY_TIMEOUT_S
        self._deadline: asyncio.TimerHandle | None = None
        self._head_begun = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self._header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_begun = True
        if self._deadline is None:  # a later request on a kept-alive connection
            self._arm(self._header_timeout_s, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._head_begun = False
        super().on_headers_complete()
        if _has_body(self.headers) and self.cycle is not None:
            self._arm(self._body_timeout_s, self._body_timed_out, self.cycle)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

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
            self._write_408(f"request headers not received within {self._header_timeout_s:g}s")
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
            self._write_408(
                f"request body not received within {self._body_timeout_s:g}s",
                request_id,
                cycle.scope.get("path", ""),
            )
        # The app, waiting for the body, reads a disconnect; its answer goes nowhere.
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.close()

    def _client(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "?"

    def _write_408(self, message: str, request_id: str | None = None, path: str = "") -> None:
        """A 408 written on the transport; in the shape of ``path``'s API where
        its head was read (not for a head that never came whole)."""
        body = json.dumps(error_body_for(path, 408, message, "request_timeout")).encode()
        head = [
            b"HTTP/1.1 408 Request Timeout",
            b"content-type: application/json",
            b"content-length: " + str(len(body)).encode(),
            b"connection: close",
        ]
        if request_id is not None:
            head.append(b"x-request-id: " + request_id.encode("latin-1"))
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)


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
