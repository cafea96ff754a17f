"""A drain answers the requests still pending when its grace ends, saying
which grace ended: the configured one, or none left (a second signal)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import uvicorn

from builders import fake_engine
from serverproc import free_port
from tessera.admission import TenantLimits
from tessera.engine import Caller
from tessera.errors import ShuttingDownError
from tessera.gateway import create_app
from tessera.tasks.types import Task, TextInput
from tessera.tenants import TenantStore

MODELS = {
    "slow": {
        "task": "embedding",
        "options": {"run_s": 0.3},
        "batching": {"max_batch_size": 1, "max_concurrent_batches": 1},
    },
}


@pytest.mark.parametrize(("grace_s", "says"), [(0.05, "(0.05s grace)"), (0, "grace cut short")])
async def test_what_a_drain_cuts_says_which_grace_ended(
    tmp_path: Path, grace_s: float, says: str
) -> None:
    async with fake_engine(tmp_path / "repo", MODELS) as engine:
        submissions = [
            engine.submit("slow", Task.EMBEDDING, [TextInput(f"t{i}")]) for i in range(3)
        ]
        assert await engine.drain(grace_s) >= 2  # one may run; the queued ones are cut
        messages = []
        for submission in submissions:
            try:
                await engine.wait(submission)
            except ShuttingDownError as e:
                messages.append(str(e))
        assert len(messages) >= 2
        assert all(says in message for message in messages), messages


async def test_a_draining_server_answers_503_before_any_rate_limit(tmp_path: Path) -> None:
    models = {"embed": {"task": "embedding", "preload": True}}
    async with fake_engine(tmp_path / "repo", models) as engine:
        with TenantStore(tmp_path / "data") as store:
            store.add_tenant("acme", qps=0.001, burst=1)  # one request, then 429s
            key = store.create_key("acme").key
            transport = httpx.ASGITransport(app=create_app(engine, tenant_store=store))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                body = {"model": "embed", "input": "a"}
                auth = {"authorization": f"Bearer {key}"}
                assert (await client.post("/v1/embeddings", json=body, headers=auth)).is_success
                limited = await client.post("/v1/embeddings", json=body, headers=auth)
                assert limited.status_code == 429
                await engine.drain(0)
                for headers in (auth, {}):  # over its rate, and without a key
                    r = await client.post("/v1/embeddings", json=body, headers=headers)
                    assert r.status_code == 503, r.text
                    assert r.json()["error"]["type"] == "shutting_down"
                    assert r.headers["retry-after"] == "1"
                assert (await client.get("/v2/health/live")).status_code == 200
        # The engine's own order, for callers that do not pass the gateway (the WebSocket).
        caller = Caller(TenantLimits("acme", qps=0.001, burst=1))
        with pytest.raises(ShuttingDownError):
            engine.submit("embed", Task.EMBEDDING, [TextInput("a")], caller=caller)


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One response's head (the probes answer no body)."""
    return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)


async def test_answers_while_draining_close_their_kept_alive_connection(tmp_path: Path) -> None:
    async with fake_engine(tmp_path / "repo", {"embed": {"task": "embedding"}}) as engine:
        port = free_port()
        config = uvicorn.Config(
            create_app(engine), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
        )
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        try:
            for _ in range(1000):  # up to 10 s to listen
                if server.started:
                    break
                await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            probe = b"GET /v2/health/live HTTP/1.1\r\nhost: t\r\n\r\n"
            writer.write(probe)
            assert b"connection: close" not in (await read_response(reader)).lower()
            await engine.drain(0)
            writer.write(probe)  # the same connection, kept alive
            head = (await read_response(reader)).lower()
            assert head.startswith(b"http/1.1 200")
            assert b"connection: close" in head
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
            writer.close()
        finally:
            server.should_exit = True
            await serving
