"""A request head's caps, counted as its bytes arrive, and the bound on
connections that have sent no head yet: ``TimedHttpProtocol`` over a fake
transport and loop (no socket, no sleep)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
from uvicorn.server import ServerState

from tessera.gateway.head import HeadLimits, OpeningConnections
from tessera.gateway.server import GatewayConfig, TimedHttpProtocol

MIN_BODY_PIECE_BYTES = 64 * 1024  # the server's smallest piece of a body

LIMITS = HeadLimits(
    max_url_bytes=1024, max_header_bytes=2048, max_head_bytes=8192, max_num_headers=10
)
PEER = ("203.0.113.7", 40000)


class FakeTimer:
    def cancel(self) -> None:
        pass


class FakeTask:
    def add_done_callback(self, callback: Any) -> None:
        pass


class FakeLoop:
    """What the protocol asks of its loop: the time, timers, tasks (never run)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.tasks: list[Coroutine[Any, Any, Any]] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Any, *args: Any) -> FakeTimer:
        return FakeTimer()

    def create_task(self, coro: Coroutine[Any, Any, Any], **kwargs: Any) -> FakeTask:
        self.tasks.append(coro)
        return FakeTask()

    def close(self) -> None:
        for coro in self.tasks:
            coro.close()


class FakeTransport(asyncio.Transport):
    def __init__(self, peer: tuple[str, int] = PEER) -> None:
        super().__init__()
        self.peer = peer
        self.written = bytearray()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self.peer, "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def answer(self) -> tuple[int, dict[str, str], Any]:
        head, _, body = bytes(self.written).partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines)
        return int(status_line.split()[1]), headers, json.loads(body)


async def app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the fake loop runs no request")


class CountingParser:
    """The protocol's parser, counting the bytes it is given."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.num_bytes = 0

    def feed_data(self, data: bytes) -> None:
        self.num_bytes += len(data)
        self.parser.feed_data(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


class Connections:
    """Builds protocols of one server: one config, one state, one loop."""

    def __init__(self, opening: OpeningConnections | None = None) -> None:
        self.loop = FakeLoop()
        self.config = GatewayConfig(
            app, log_config=None, head_limits=LIMITS, opening=opening or OpeningConnections(None)
        )
        self.state = ServerState()

    def open(self, peer: tuple[str, int] = PEER) -> tuple[TimedHttpProtocol, FakeTransport]:
        protocol = TimedHttpProtocol(
            self.config,
            server_state=self.state,
            app_state={},
            _loop=self.loop,  # type: ignore[arg-type]
        )
        protocol.parser = CountingParser(protocol.parser)  # type: ignore[assignment]
        transport = FakeTransport(peer)
        protocol.connection_made(transport)
        return protocol, transport


@pytest.fixture
def connections() -> Iterator[Connections]:
    built = Connections()
    yield built
    built.loop.close()


def fed(protocol: TimedHttpProtocol) -> int:
    parser = protocol.parser
    assert isinstance(parser, CountingParser)
    return parser.num_bytes


def test_a_url_over_its_cap_is_414_and_closed(connections: Connections) -> None:
    protocol, transport = connections.open()
    protocol.data_received(b"GET /" + b"a" * 2000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = transport.answer()
    assert status == 414
    assert headers["connection"] == "close"
    assert body["error"]["type"] == "uri_too_long"
    assert "1024 bytes" in body["error"]["message"]
    assert transport.closed


def test_a_header_over_its_cap_is_431_in_its_apis_shape(connections: Connections) -> None:
    protocol, transport = connections.open()
    protocol.data_received(b"POST /v2/models/m/infer HTTP/1.1\r\nX-Big: " + b"a" * 3000 + b"\r\n")
    status, _, body = transport.answer()
    assert status == 431
    assert "2048 bytes" in body["error"]  # KServe's {"error": MESSAGE}
    assert transport.closed


def test_more_headers_than_the_cap_is_431(connections: Connections) -> None:
    protocol, transport = connections.open()
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(11))
    protocol.data_received(b"GET /v1/models HTTP/1.1\r\n" + many + b"\r\n")
    status, _, body = transport.answer()
    assert status == 431
    assert body["error"]["type"] == "request_header_fields_too_large"
    assert "10 request headers" in body["error"]["message"]


def test_a_streamed_head_is_cut_at_its_cap_before_the_parser_holds_more() -> None:
    """A header under its own cap arrives in pieces: what reaches the parser
    stops at the head's cap, however much the client sends."""
    limits = HeadLimits(max_header_bytes=1 << 30, max_head_bytes=8192)
    built = Connections()
    built.config.head_limits = limits
    try:
        protocol, transport = built.open()
        protocol.data_received(b"GET / HTTP/1.1\r\nX-Stream: ")
        for _ in range(100):
            if transport.closed:
                break
            protocol.data_received(b"a" * 3000)
        status, _, body = transport.answer()
    finally:
        built.loop.close()
    assert status == 431
    assert "8192 bytes" in body["error"]["message"]
    assert fed(protocol) <= limits.max_head_bytes


def test_one_chunk_far_over_the_head_cap_reaches_the_parser_only_up_to_it(
    connections: Connections,
) -> None:
    protocol, transport = connections.open()
    protocol.data_received(b"GET / HTTP/1.1\r\n" + b"X-A: 1\r\n" * 5000)
    assert transport.answer()[0] == 431
    assert fed(protocol) <= LIMITS.max_head_bytes


def test_a_body_is_not_counted_as_head(connections: Connections) -> None:
    protocol, transport = connections.open()
    body = b"x" * (LIMITS.max_head_bytes * 4)
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\ncontent-length: %d\r\n\r\n" % len(body)
    protocol.data_received(head + body[:100])
    protocol.data_received(body[100:])
    assert not transport.closed
    assert transport.written == b""
    assert fed(protocol) == len(head) + len(body)


def test_heads_on_a_kept_alive_connection_are_counted_each_alone(
    connections: Connections,
) -> None:
    protocol, transport = connections.open()
    head = b"GET / HTTP/1.1\r\nX-A: " + b"a" * 1500 + b"\r\nX-B: " + b"b" * 1500 + b"\r\n\r\n"
    for _ in range(6):  # 6 heads of about 3 KiB: over the 8 KiB cap together
        protocol.data_received(head)
    assert not transport.closed
    assert transport.written == b""


def test_a_head_and_the_next_in_one_chunk_are_each_under_the_cap(
    connections: Connections,
) -> None:
    protocol, transport = connections.open()
    head = b"GET / HTTP/1.1\r\nX-A: " + b"a" * 1500 + b"\r\n\r\n"
    protocol.data_received(head * 8)  # pipelined, about 12 KiB in one chunk
    assert not transport.closed


@pytest.mark.parametrize("body_bytes", [100, 200_000])
def test_a_head_pipelined_behind_a_body_is_cut_near_its_cap(
    connections: Connections, body_bytes: int
) -> None:
    """The parser does not say where a head begins inside the piece that ends
    the request before it: that piece's part of it goes uncounted, no more."""
    first = b"POST /v1/embeddings HTTP/1.1\r\ncontent-length: %d\r\n\r\n" % body_bytes
    first += b"x" * body_bytes
    protocol, transport = connections.open()
    protocol.data_received(first + b"GET / HTTP/1.1\r\nX-Stream: " + b"a" * 1_000_000)
    assert transport.closed
    assert fed(protocol) <= len(first) + 2 * max(LIMITS.max_head_bytes, MIN_BODY_PIECE_BYTES)


def test_a_malformed_head_is_still_uvicorns_400(connections: Connections) -> None:
    protocol, transport = connections.open()
    protocol.data_received(b"NOT HTTP AT ALL\r\n\r\n")
    assert transport.written.startswith(b"HTTP/1.1 400")
    assert transport.closed


def test_an_address_over_its_bound_of_stale_opening_connections_is_refused() -> None:
    built = Connections(OpeningConnections(3))
    try:
        held = [built.open() for _ in range(3)]
        built.loop.now += 1.5  # the three sent nothing for over a second
        _, refused = built.open()
        _, other_address = built.open(("198.51.100.1", 1))
    finally:
        built.loop.close()
    assert not any(transport.closed for _, transport in held)
    status, headers, body = refused.answer()
    assert status == 429
    assert headers["retry-after"] == "1"
    assert body["error"]["type"] == "rate_limit_exceeded"
    assert refused.closed
    assert not other_address.closed


def test_a_connection_that_sends_its_head_or_closes_frees_its_place() -> None:
    opening = OpeningConnections(2)
    built = Connections(opening)
    try:
        (first, _), (second, _) = built.open(), built.open()
        built.loop.now += 1.5
        first.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        second.connection_lost(None)
        _, admitted = built.open()
    finally:
        built.loop.close()
    assert not admitted.closed
    assert opening.num_opening(PEER[0]) == 1


def test_a_burst_of_fresh_connections_is_never_refused() -> None:
    built = Connections(OpeningConnections(3))
    try:
        burst = [built.open() for _ in range(50)]
    finally:
        built.loop.close()
    assert not any(transport.closed for _, transport in burst)


def test_opening_connections_keep_no_entry_for_an_address_with_none() -> None:
    opening = OpeningConnections(4)
    for i in range(1000):  # many addresses, each connecting then sending its head
        address = f"10.0.{i // 256}.{i % 256}"
        assert opening.admit(address, i, now=0.0)
        opening.release(address, i)
    assert opening.num_addresses == 0


def test_a_stale_connection_counts_only_up_to_the_bound() -> None:
    opening = OpeningConnections(2, stale_after_s=1.0)
    assert opening.admit("a", 1, now=0.0)
    assert opening.admit("a", 2, now=0.9)
    assert opening.admit("a", 3, now=1.5)  # one stale (1), one fresh (2)
    assert not opening.admit("a", 4, now=2.0)  # 1 and 2 are stale now
    opening.release("a", 1)
    assert opening.admit("a", 5, now=2.0)


@pytest.mark.parametrize(
    ("trusted", "address", "bound"),
    [
        (["10.0.0.0/8"], "10.1.2.3", False),
        (["10.0.0.5"], "10.0.0.5", False),
        (["*"], "192.0.2.1", False),
        (["10.0.0.0/8", "proxy.local"], "192.0.2.1", True),
        (["::1"], "::1", False),
    ],
)
def test_trusted_proxies_are_not_bound(trusted: list[str], address: str, bound: bool) -> None:
    opening = OpeningConnections(1, trusted, stale_after_s=0.0)
    assert opening.admit(address, 1, now=0.0)
    assert opening.admit(address, 2, now=1.0) is not bound


def test_no_bound_admits_every_connection() -> None:
    opening = OpeningConnections(None, stale_after_s=0.0)
    assert all(opening.admit("a", i, now=float(i)) for i in range(100))
    assert opening.num_addresses == 0
