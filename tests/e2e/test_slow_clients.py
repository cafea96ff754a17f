"""Acceptance for slow clients (slowloris): a request's head and its body must
arrive within their deadlines, on a real server process, with raw sockets."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml

from builders import write_fake_repository
from serverproc import Server, start_server, stop_server

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
UVICORN_KEEP_ALIVE_S = 5.0  # uvicorn's default, which the server's setting replaces
HANG_S = 30.0  # a socket read that waits this long means the server never acted


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("slow-clients")
    repo = write_fake_repository(tmp / "repo", {"echo": {"task": "embedding", "preload": True}})
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "include_default_models": False,
                "model_repositories": [str(repo)],
                "preload": ["echo"],
                "header_timeout_s": HEADER_TIMEOUT_S,
                "body_timeout_s": BODY_TIMEOUT_S,
            }
        )
    )
    process, server = start_server(tmp, "--config", str(config), "--no-auth")
    try:
        yield server
    finally:
        stop_server(process)


def _connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(HANG_S)
    return sock


def _trickle(sock: socket.socket, data: bytes, seconds: float) -> bool:
    """Send ``data`` a byte at a time, 10 a second, for at most ``seconds``;
    False once the server has closed the connection."""
    deadline = time.monotonic() + seconds
    for byte in data:
        if time.monotonic() > deadline:
            break
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return False
        time.sleep(0.1)
    return True


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body


def test_headers_trickled_get_408_and_the_connection_closes(server: Server) -> None:
    with _connect(server) as sock:
        head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200
        _trickle(sock, head, seconds=HANG_S)
        status, headers, body = _response(_read_all(sock))
    assert status == 408
    assert headers["connection"] == "close"
    assert "headers" in json.loads(body)["error"]["message"]


def test_a_connection_that_sends_nothing_is_closed(server: Server) -> None:
    with _connect(server) as sock:
        assert _read_all(sock) == b""  # closed, no answer to a request never begun


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v2/models/echo/infer"])
def test_a_body_trickled_after_its_headers_gets_408_and_the_connection_closes(
    server: Server, path: str
) -> None:
    body = json.dumps({"model": "echo", "input": "x" * 200}).encode()
    head = (
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nx-request-id: slow-body\r\n\r\n"
    )
    with _connect(server) as sock:
        sock.sendall(head)
        _trickle(sock, body, seconds=HANG_S)
        status, headers, answer = _response(_read_all(sock))
    assert status == 408
    assert headers["x-request-id"] == "slow-body"
    error = json.loads(answer)["error"]
    # KServe's routes answer {"error": MESSAGE}, as tritonclient reads it.
    assert "body" in (error if path.startswith("/v2/") else error["message"])
    assert "Traceback" not in server.log()


def test_a_kept_alive_connection_may_idle_between_requests(server: Server) -> None:
    """The head's deadline runs from a request's first byte, not from the last
    answer: between requests the keep-alive applies (``keep_alive_s``, 75 s),
    longer than uvicorn's 5 s, which closed connections that clients such as
    httpx (5 s) still held for their next request."""
    body = json.dumps({"model": "echo", "input": "x"}).encode()
    request = (
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    with _connect(server) as sock, sock.makefile("rb") as answers:
        for idle_s in (max(HEADER_TIMEOUT_S * 1.5, UVICORN_KEEP_ALIVE_S + 1), 0):
            sock.sendall(request)
            assert answers.readline().startswith(b"HTTP/1.1 200")
            length = 0
            while (line := answers.readline()) != b"\r\n":
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            assert json.loads(answers.read(length))["data"]
            time.sleep(idle_s)


def test_prompt_clients_are_served_while_a_slow_one_holds_a_connection(server: Server) -> None:
    with _connect(server) as slow, httpx.Client(base_url=server.base_url, timeout=30) as client:
        slow.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")  # held open, unfinished
        r = client.post("/v1/embeddings", json={"model": "echo", "input": "x"})
        assert r.status_code == 200, r.text
