"""The WebSocket ``/v1/ws`` on a real server process over fake models of every
task, with the real ``websockets`` client: each task, streaming chat, several
ids in flight answered as they finish, per-page OCR, authentication by header
and by first message, and the close codes of bad input; a client that leaves
mid-stream stops its generation (charged what ran, in the audit)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from PIL import Image
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from builders import write_fake_repository
from serverproc import Server, audit_rows, start_server, stop_server
from tessera.gateway.websocket import MAX_IN_FLIGHT
from tessera.tenants import TenantStore

MAX_MESSAGE_BYTES = 64 * 1024
HEADER_TIMEOUT_S = 2
WS_COLUMNS = "tenant, model, status, units"  # the audit columns these tests read
WORDS = 200  # the chatty model's answer: a word every 50 ms, 10 s in all
MODELS = {
    "embed": {"task": "embedding"},
    "rank": {"task": "rerank"},
    "intent": {"task": "classify"},
    "reader": {"task": "ocr"},
    "tr": {"task": "translate"},
    "voice": {"task": "tts"},
    "chatty": {
        "task": "generate",
        "options": {"word_s": 0.05},
        "batching": {"max_batch_size": 4, "max_wait_ms": 0},
    },
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("websocket") / "data"


@pytest.fixture(scope="module")
def key(data_dir: Path) -> str:
    with TenantStore(data_dir) as store:
        store.add_tenant("acme")
        return store.create_key("acme").key


@pytest.fixture(scope="module")
def server(data_dir: Path, key: str) -> Iterator[Server]:
    tmp = data_dir.parent
    repo = write_fake_repository(tmp / "repo", MODELS)
    config = tmp / "config.yaml"
    settings = {
        "include_default_models": False,
        "model_repositories": [str(repo)],
        "max_body_bytes": MAX_MESSAGE_BYTES,
        "header_timeout_s": HEADER_TIMEOUT_S,  # a socket's wait for its key too
    }
    config.write_text(yaml.safe_dump(settings))
    process, server = start_server(
        tmp, "--config", str(config), "--data-dir", str(data_dir), key=key
    )
    try:
        yield server
    finally:
        stop_server(process)


def url(server: Server) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/ws"


def open_socket(server: Server, key: str | None, request_id: str = "") -> ClientConnection:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if request_id:
        headers["x-request-id"] = request_id
    return connect(url(server), additional_headers=headers, open_timeout=30)


def ask(ws: ClientConnection, message: dict[str, Any]) -> None:
    ws.send(json.dumps(message))


def answer(ws: ClientConnection) -> dict[str, Any]:
    reply: dict[str, Any] = json.loads(ws.recv(timeout=30))
    return reply


def result_of(ws: ClientConnection, message_id: str) -> dict[str, Any]:
    """The answers to ``message_id`` until its result or error (others must not come)."""
    reply = answer(ws)
    assert reply["id"] == message_id, reply
    return reply


def png_b64(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), "white").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def closed_with(ws: ClientConnection) -> tuple[int | None, dict[str, Any] | None]:
    """The close code, and the error message sent before it if any."""
    error = None
    try:
        while True:
            error = json.loads(ws.recv(timeout=30))
    except ConnectionClosed as e:
        return (e.rcvd.code if e.rcvd else None), error


def test_every_task_is_answered_with_its_http_body(
    server: Server, key: str, data_dir: Path
) -> None:
    messages = {
        "e": {"type": "embeddings", "model": "embed", "input": ["hello", "world"]},
        "r": {"type": "rerank", "model": "rank", "query": "q", "documents": ["a", "b"]},
        "c": {"type": "classify", "model": "intent", "input": "hi", "top_k": 1},
        "t": {"type": "translate", "model": "tr", "input": "abc"},
        "s": {"type": "speech", "model": "voice", "input": "Hello."},
        "o": {"type": "ocr", "model": "reader", "image": png_b64(40, 30)},
        "h": {"type": "chat", "model": "chatty", "messages": [{"role": "user", "content": "a b"}]},
        "p": {"type": "completion", "model": "chatty", "prompt": ["x y", "z"], "echo": True},
    }
    with open_socket(server, key, "ws-tasks") as ws:
        for message_id, message in messages.items():
            ask(ws, {"id": message_id, **message})
        replies: dict[str, dict[str, Any]] = {}
        while len(replies) < len(messages):
            reply = answer(ws)
            if reply["type"] in ("result", "error"):
                replies[reply["id"]] = reply
    assert all(r["type"] == "result" for r in replies.values()), replies
    data = {k: r["data"] for k, r in replies.items()}
    assert len(data["e"]["data"]) == 2
    assert len(data["e"]["data"][0]["embedding"]) == 8  # the fake's dimensions
    assert [r["index"] for r in data["r"]["results"]] in ([0, 1], [1, 0])
    assert data["c"]["data"][0]["label"].startswith("label-")
    assert data["t"]["data"][0]["translation"] == "cba"
    assert base64.b64decode(data["s"]["audio"])[:4] == b"RIFF"
    assert data["o"]["pages"][0]["text"] == "40x30"
    assert data["h"]["choices"][0]["message"]["content"] == "a b "
    assert [c["text"] for c in data["p"]["choices"]] == ["x yx y ", "zz "]
    rows = audit_rows(data_dir, "ws-tasks/", len(messages), WS_COLUMNS)
    assert {k.removeprefix("ws-tasks/") for k in rows} == set(messages)
    assert all(row[0] == "acme" and row[2] == 200 for row in rows.values())


def test_chat_streams_and_ids_in_flight_are_answered_as_they_finish(
    server: Server, key: str
) -> None:
    long_chat = {"role": "user", "content": " ".join(f"w{i}" for i in range(20))}
    with open_socket(server, key) as ws:
        ask(
            ws,
            {
                "id": "long",
                "type": "chat",
                "model": "chatty",
                "stream": True,
                "messages": [long_chat],
            },
        )
        ask(ws, {"id": "short", "type": "embeddings", "model": "embed", "input": "x"})
        order: list[tuple[str, str]] = []
        deltas: list[str] = []
        while ("long", "result") not in order:
            reply = answer(ws)
            order.append((reply["id"], reply["type"]))
            if reply["type"] == "delta":
                deltas.append(reply["content"])
            if reply["type"] == "result" and reply["id"] == "long":
                final = reply["data"]
    # The embedding, sent second, was answered while the chat still streamed.
    assert order.index(("short", "result")) < order.index(("long", "result"))
    assert len(deltas) == 20
    assert "".join(deltas) == final["choices"][0]["message"]["content"]
    assert final["usage"]["completion_tokens"] == 20


def test_a_completion_of_two_choices_streams_deltas_by_index(server: Server, key: str) -> None:
    message = {"type": "completion", "model": "chatty", "prompt": "a b c", "n": 2}
    with open_socket(server, key) as ws:
        ask(ws, {"id": "p", "stream": True, **message})
        texts = {0: "", 1: ""}
        while (reply := answer(ws))["type"] == "delta":
            texts[reply["index"]] += reply["content"]
    assert reply["type"] == "result"
    assert texts == {0: "a b c ", 1: "a b c "}
    assert [c["text"] for c in reply["data"]["choices"]] == ["a b c ", "a b c "]


def test_ocr_pages_come_as_they_are_read(server: Server, key: str) -> None:
    pages = [png_b64(40 + i, 30) for i in range(3)]
    with open_socket(server, key) as ws:
        ask(ws, {"id": "doc", "type": "ocr", "model": "reader", "images": pages})
        replies = [answer(ws) for _ in range(4)]
    assert sorted(r["index"] for r in replies[:3]) == [0, 1, 2]
    assert all(r["type"] == "page" for r in replies[:3])
    assert replies[3]["type"] == "result"
    assert [p["text"] for p in replies[3]["data"]["pages"]] == ["40x30", "41x30", "42x30"]


def test_an_ocr_page_over_the_pixel_limit_is_413_for_its_id(server: Server, key: str) -> None:
    buffer = io.BytesIO()
    Image.new("1", (8000, 8000), 1).save(buffer, format="PNG")  # 64 MP in 23 KB
    bomb = base64.b64encode(buffer.getvalue()).decode()
    with open_socket(server, key) as ws:
        ask(ws, {"id": "bomb", "type": "ocr", "model": "reader", "images": [png_b64(4, 4), bomb]})
        reply = result_of(ws, "bomb")
        assert reply["type"] == "error"
        assert reply["error"]["code"] == 413
        assert "40,000,000 pixels" in reply["error"]["message"]
        ask(ws, {"id": "ok", "type": "ocr", "model": "reader", "image": png_b64(4, 4)})
        assert [answer(ws)["type"] for _ in range(2)] == ["page", "result"]  # still open


def test_authentication_by_first_message(server: Server, key: str) -> None:
    with open_socket(server, None) as ws:
        ask(ws, {"type": "auth", "key": key})
        assert answer(ws) == {"type": "auth", "tenant": "acme"}
        ask(ws, {"id": "1", "type": "translate", "model": "tr", "input": "ab"})
        assert result_of(ws, "1")["data"]["data"][0]["translation"] == "ba"
    with open_socket(server, None) as ws:  # anything else first: refused
        ask(ws, {"id": "1", "type": "translate", "model": "tr", "input": "ab"})
        code, error = closed_with(ws)
    assert code == 1008
    assert error is not None
    assert error["error"]["code"] == 401


def test_a_socket_that_sends_no_key_is_closed_after_the_header_timeout(server: Server) -> None:
    with open_socket(server, None) as ws:
        code, error = closed_with(ws)
    assert code == 1008
    assert error is not None
    assert error["error"]["code"] == 408
    assert f"no key within {HEADER_TIMEOUT_S} s" in error["error"]["message"]


def test_a_later_auth_message_changes_the_key(server: Server, key: str) -> None:
    with open_socket(server, key) as ws:
        ask(ws, {"type": "auth", "key": key})  # once authenticated, a key again
        assert answer(ws) == {"type": "auth", "tenant": "acme"}
        ask(ws, {"id": "1", "type": "translate", "model": "tr", "input": "ab"})
        assert result_of(ws, "1")["type"] == "result"
        ask(ws, {"type": "auth", "key": "tsk_not_a_key"})
        code, error = closed_with(ws)
    assert code == 1008
    assert error is not None
    assert error["error"]["code"] == 401


def test_a_wrong_key_is_refused_with_1008(server: Server, data_dir: Path) -> None:
    with open_socket(server, "tsk_nothere0_" + "x" * 43, "ws-wrongkey") as ws:
        code, error = closed_with(ws)
    assert code == 1008
    assert error is not None
    assert "invalid" in error["error"]["message"]
    with open_socket(server, None) as ws:
        ask(ws, {"type": "auth", "key": "tsk_nothere1_" + "y" * 43})
        code, _ = closed_with(ws)
    assert code == 1008
    rows = audit_rows(data_dir, "ws-wrongkey", 1, WS_COLUMNS)
    assert rows["ws-wrongkey"][2] == 401  # audited as HTTP's failed keys are


def test_a_key_revoked_while_its_socket_is_open_ends_it_at_the_next_message(
    server: Server, data_dir: Path
) -> None:
    with TenantStore(data_dir) as store:
        fresh = store.create_key("acme")
    with open_socket(server, fresh.key) as ws:
        ask(ws, {"id": "before", "type": "embeddings", "model": "embed", "input": "x"})
        assert result_of(ws, "before")["type"] == "result"
        with TenantStore(data_dir) as store:
            store.revoke_key(fresh.info.prefix)
        ask(ws, {"id": "after", "type": "embeddings", "model": "embed", "input": "x"})
        code, error = closed_with(ws)
    assert code == 1008
    assert error is not None
    assert "revoked" in error["error"]["message"]


@pytest.mark.parametrize(
    ("send", "code"),
    [
        ("{not json", 1007),
        ("[1, 2]", 1007),
        ("[" * 3000 + "]" * 3000, 1007),  # nested past the JSON parser's depth
        (json.dumps({"type": "chat"}), 1007),  # no id: nothing to answer to
        (b"\x00\x01", 1003),
        ("x" * (MAX_MESSAGE_BYTES + 1), 1009),
    ],
)
def test_bad_messages_close_the_socket_with_their_code(
    server: Server, key: str, send: str | bytes, code: int
) -> None:
    with open_socket(server, key) as ws:
        ws.send(send)
        received, _ = closed_with(ws)
    assert received == code


def test_bad_fields_and_unknown_types_are_errors_for_their_id(server: Server, key: str) -> None:
    with open_socket(server, key) as ws:
        ask(ws, {"id": "u", "type": "paint", "model": "embed"})
        reply = result_of(ws, "u")
        assert reply["type"] == "error"
        assert reply["error"]["code"] == 400
        assert "unknown type" in reply["error"]["message"]
        ask(ws, {"id": "m", "type": "embeddings", "model": "nope", "input": "x"})
        assert result_of(ws, "m")["error"]["code"] == 404
        ask(ws, {"id": "w", "type": "embeddings", "model": "tr", "input": "x"})
        assert result_of(ws, "w")["error"]["code"] == 400  # tr translates
        ask(ws, {"id": "f", "type": "embeddings", "model": "embed", "input": 3})
        assert result_of(ws, "f")["error"]["code"] == 400
        ask(ws, {"id": "ok", "type": "embeddings", "model": "embed", "input": "x"})
        assert result_of(ws, "ok")["type"] == "result"  # the socket is still open


def test_an_id_in_flight_is_refused_again_and_the_first_keeps_it(server: Server, key: str) -> None:
    words = " ".join(f"w{i}" for i in range(20))  # a word every 50 ms: 1 s
    chat = {"type": "chat", "model": "chatty", "messages": [{"role": "user", "content": words}]}
    with open_socket(server, key) as ws:
        ask(ws, {"id": "d", **chat})
        ask(ws, {"id": "d", **chat})
        replies = [answer(ws)]  # the second refused ...
        ask(ws, {"id": "d", **chat})  # ... and the id still the first's after it
        replies += [answer(ws) for _ in range(2)]
    assert [r["type"] for r in replies] == ["error", "error", "result"]
    for refused in replies[:2]:
        assert refused["error"]["code"] == 400
        assert "in flight already" in refused["error"]["message"]


def test_an_ocr_page_that_fails_is_its_own_status_not_a_500(server: Server, key: str) -> None:
    pages = [png_b64(4, 4), png_b64(5, 4)]
    with open_socket(server, key) as ws:
        ask(ws, {"id": "late", "type": "ocr", "model": "reader", "images": pages, "timeout": 1e-6})
        reply = result_of(ws, "late")
    assert reply["type"] == "error"
    assert reply["error"]["code"] in (503, 504), reply  # past its deadline: queued or not
    assert "internal" not in reply["error"]["message"]


def test_more_than_the_bound_in_flight_is_refused_for_its_id(server: Server, key: str) -> None:
    chat = {
        "type": "chat",
        "model": "chatty",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "a b c d e f"}],
    }
    with open_socket(server, key) as ws:
        for i in range(MAX_IN_FLIGHT + 1):
            ask(ws, {"id": f"c{i}", **chat})
        replies = [answer(ws) for _ in range(MAX_IN_FLIGHT + 1)]
    refused = [r for r in replies if r["type"] == "error"]
    assert [r["id"] for r in refused] == [f"c{MAX_IN_FLIGHT}"]
    assert refused[0]["error"]["type"] == "too_many_in_flight"
    assert refused[0]["error"]["code"] == 429


def test_a_client_that_leaves_mid_stream_stops_its_generation(
    server: Server, key: str, data_dir: Path
) -> None:
    words = " ".join(f"w{i}" for i in range(WORDS))
    with open_socket(server, key, "ws-leave") as ws:
        ask(
            ws,
            {
                "id": "gen",
                "type": "chat",
                "model": "chatty",
                "stream": True,
                "max_tokens": 1000,
                "messages": [{"role": "user", "content": words}],
            },
        )
        for _ in range(3):
            assert answer(ws)["type"] == "delta"
    # Closed after three words: the generation stops at its next word and is
    # charged its prompt and the words made, far from all 200 (10 s of them).
    (row,) = audit_rows(data_dir, "ws-leave/", 1, WS_COLUMNS).values()
    tenant, model, status, units = row
    assert (tenant, model, status) == ("acme", "chatty", 499)
    assert 1 + 3 <= float(units) < 1 + WORDS / 2
