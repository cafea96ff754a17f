"""Acceptance for what a client may send before its request is known: a head
streamed without end is cut at its cap (431 or 414, then closed) while other
clients are answered, and an address's connections that send no head are
bounded; on a real server process, with raw sockets."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from builders import write_fake_repository
from serverproc import Server, start_server, stop_server

MAX_NUM_OPENING = 4
FLOOD_BYTES = 20 * 1024 * 1024  # at most this much of one head is streamed
FLOOD_S = 5.0  # for at most this long
HANG_S = 30.0  # a socket read that waits this long means the server never acted
WEBSOCKET_HANDSHAKE = (
    b"GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
)


def _serve(tmp: Path, gateways: int) -> tuple[subprocess.Popen[bytes], Server]:
    repo = write_fake_repository(tmp / "repo", {"echo": {"task": "embedding", "preload": True}})
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "include_default_models": False,
                "model_repositories": [str(repo)],
                "preload": ["echo"],
                "max_num_opening_connections": MAX_NUM_OPENING,
                "gateways": gateways,
            }
        )
    )
    return start_server(tmp, "--config", str(config), "--no-auth")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    process, server = _serve(tmp_path_factory.mktemp("head-limits"), gateways=0)
    try:
        yield server
    finally:
        stop_server(process)


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The process split: a gateway process reads the heads."""
    process, server = _serve(tmp_path_factory.mktemp("head-limits-split"), gateways=1)
    try:
        yield server
    finally:
        stop_server(process)


@dataclass
class Flood:
    """What a client streaming one head without end saw."""

    num_sent: int = 0
    answer: bytes = b""
    closed: bool = False


def _flood(server: Server, start: bytes) -> Flood:
    """Stream ``start`` then bytes of the same line, as fast as the server
    takes them, up to ``FLOOD_BYTES`` or ``FLOOD_S``; then read the answer."""
    flood = Flood()
    chunk = b"a" * 65536
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(HANG_S)
        deadline = time.monotonic() + FLOOD_S
        try:
            sock.sendall(start)
            while flood.num_sent < FLOOD_BYTES and time.monotonic() < deadline:
                sock.sendall(chunk)
                flood.num_sent += len(chunk)
        except OSError:  # the server closed the connection: what it said comes next
            pass
        flood.answer, flood.closed = _read_until_closed(sock)
    return flood


def _read_until_closed(sock: socket.socket) -> tuple[bytes, bool]:
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return b"".join(chunks), True
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)


def _response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _embed(client: httpx.Client) -> int:
    return client.post("/v1/embeddings", json={"model": "echo", "input": "x"}).status_code


@pytest.mark.parametrize(
    ("start", "status"),
    [
        (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nX-Flood: ", 431),
        (b"GET /v1/models?q=", 414),
        (b"POST /v1/embeddings HTTP/1.1\r\n" + b"X-Many: 1\r\n" * 1000, 431),
        (WEBSOCKET_HANDSHAKE + b"X-Flood: ", 431),
    ],
    ids=["one-header", "url", "many-headers", "websocket-handshake"],
)
def test_a_head_streamed_without_end_is_cut_while_others_are_answered(
    server: Server, start: bytes, status: int
) -> None:
    floods: list[Flood] = []
    flooder = threading.Thread(target=lambda: floods.append(_flood(server, start)))
    statuses: list[int] = []
    with httpx.Client(base_url=server.base_url, timeout=HANG_S) as client:
        flooder.start()
        while flooder.is_alive() or not statuses:
            statuses.append(_embed(client))
        flooder.join()
    (flood,) = floods
    answered, headers, body = _response(flood.answer)
    assert answered == status
    assert headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["error"]
    assert flood.closed
    assert flood.num_sent < FLOOD_BYTES  # cut before the client was done
    assert set(statuses) == {200}
    assert "Traceback" not in server.log()


def test_an_address_holding_its_bound_of_silent_connections_gets_429_for_one_more(
    server: Server,
) -> None:
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_NUM_OPENING)]
    try:
        time.sleep(1.5)  # they count once they have sent nothing for a second
        with socket.create_connection(("127.0.0.1", server.port)) as extra:
            extra.settimeout(HANG_S)
            raw, closed = _read_until_closed(extra)
        status, headers, body = _response(raw)
        assert status == 429
        assert headers["retry-after"] == "1"
        assert "no request head" in json.loads(body)["error"]["message"]
        assert closed
    finally:
        for sock in silent:
            sock.close()
    with httpx.Client(base_url=server.base_url, timeout=HANG_S) as client:
        assert _embed(client) == 200  # the place is free again once they closed


def test_connections_that_send_their_head_at_once_are_not_bounded(server: Server) -> None:
    """A client's many connections opening together (a pool) are never refused."""
    num_clients = MAX_NUM_OPENING * 4
    statuses: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        with httpx.Client(base_url=server.base_url, timeout=HANG_S) as client:
            status = _embed(client)
        with lock:
            statuses.append(status)

    threads = [threading.Thread(target=one) for _ in range(num_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == [200] * num_clients


def test_a_gateway_process_cuts_a_streamed_head_and_bounds_silent_connections(
    split: Server,
) -> None:
    flood = _flood(split, b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nX-Flood: ")
    assert _response(flood.answer)[0] == 431
    assert flood.num_sent < FLOOD_BYTES
    silent = [socket.create_connection(("127.0.0.1", split.port)) for _ in range(MAX_NUM_OPENING)]
    try:
        time.sleep(1.5)
        with socket.create_connection(("127.0.0.1", split.port)) as extra:
            extra.settimeout(HANG_S)
            raw, _ = _read_until_closed(extra)
        assert _response(raw)[0] == 429
    finally:
        for sock in silent:
            sock.close()
