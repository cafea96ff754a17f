"""A client that leaves during an SSE stream never had its whole answer: its
audit row (and its request event) says 499, not the 200 the stream began
with. The real app in-process, driven as a server drives it (a disconnect
after the first chunk), over a fake chat model that writes a word at a time."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from builders import fake_engine
from tessera.gateway import create_app
from tessera.tenants import AuditLog

MODELS = {"chat": {"task": "generate", "options": {"word_s": 0.05}}}


async def stream_then_leave(app: Any, request_id: str, leave: bool) -> int:
    """POST a streamed chat; with ``leave``, hang up after the first chunk.
    Returns the number of body chunks received."""
    body = json.dumps(
        {
            "model": "chat",
            "messages": [{"role": "user", "content": " ".join(["word"] * 40)}],
            "stream": True,
        }
    ).encode()
    first_chunk = asyncio.Event()
    done = asyncio.Event()
    chunks = 0
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await (first_chunk.wait() if leave else done.wait())
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal chunks
        if message["type"] == "http.response.body":
            if message.get("body"):
                chunks += 1
                first_chunk.set()
            if not message.get("more_body", False):
                done.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    await app(scope, receive, send)
    return chunks


async def test_a_stream_its_client_left_is_audited_499_and_a_finished_one_200(
    tmp_path: Path,
) -> None:
    audit = AuditLog(tmp_path / "data")
    try:
        async with fake_engine(tmp_path / "repo", MODELS) as engine:
            app = create_app(engine, audit_log=audit)
            left = await stream_then_leave(app, "left", leave=True)
            whole = await stream_then_leave(app, "whole", leave=False)
            assert left < whole
            for _ in range(100):  # the rows wait for their charges (the generation's end)
                audit.write_pending()
                rows = {r.request_id: r for r in audit.query(limit=10)}
                if len(rows) == 2:
                    break
                await asyncio.sleep(0.05)
        assert (rows["left"].status, rows["whole"].status) == (499, 200)
    finally:
        audit.close_sync()
