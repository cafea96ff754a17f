"""Ollama's API over fake models: embed, chat and generate (whole and
streamed a line a piece), tags, ps; errors in Ollama's shape."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from pathlib import Path

import httpx
import numpy as np
import pytest

from harness.fake_models import fake_embedding
from tessera.engine import Engine
from tessera.gateway import create_app
from tessera.tenants import TenantStore


async def test_embed_gives_unit_vectors_and_the_older_route_one(
    shared_client: httpx.AsyncClient,
) -> None:
    r = await shared_client.post(
        "/api/embed", json={"model": "embed:latest", "input": ["a b", "c"]}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "embed:latest"
    np.testing.assert_allclose(
        body["embeddings"], [fake_embedding("a b"), fake_embedding("c")], rtol=1e-6
    )
    assert body["prompt_eval_count"] > 0
    r = await shared_client.post(
        "/api/embed", json={"model": "embed", "input": "c", "dimensions": 3}
    )
    head = fake_embedding("c")[:3]
    np.testing.assert_allclose(r.json()["embeddings"], [head / np.linalg.norm(head)], rtol=1e-5)
    r = await shared_client.post("/api/embeddings", json={"model": "embed", "prompt": "c"})
    np.testing.assert_allclose(r.json()["embedding"], fake_embedding("c"), rtol=1e-6)
    # JSON whatever the content type says, as Ollama reads it (curl -d sends a form's).
    form = {"content-type": "application/x-www-form-urlencoded"}
    raw = json.dumps({"model": "embed", "prompt": "c"})
    r = await shared_client.post("/api/embeddings", content=raw, headers=form)
    np.testing.assert_allclose(r.json()["embedding"], fake_embedding("c"), rtol=1e-6)


async def test_chat_whole_and_streamed(shared_client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "one two three"}]
    body = {"model": "chat", "messages": messages, "stream": False}
    r = await shared_client.post("/api/chat", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["message"] == {"role": "assistant", "content": "one two three "}
    assert (answer["done"], answer["done_reason"]) == (True, "stop")
    assert answer["eval_count"] == 3
    # Streamed by default, as Ollama's: a JSON object a line, the last one done.
    async with shared_client.stream(
        "POST", "/api/chat", json={"model": "chat", "messages": messages}
    ) as s:
        assert s.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) async for line in s.aiter_lines() if line]
    assert [line["done"] for line in lines] == [False, False, False, True]
    assert "".join(line["message"]["content"] for line in lines) == "one two three "
    assert lines[-1]["eval_count"] == 3


async def test_generate_whole_raw_and_streamed(shared_client: httpx.AsyncClient) -> None:
    body = {"model": "chat", "prompt": "x y", "system": "be brief", "stream": False}
    r = await shared_client.post("/api/generate", json=body)
    assert r.json()["response"] == "x y "  # the fake echoes the last message
    r = await shared_client.post("/api/generate", json={**body, "raw": True})
    assert r.json()["response"] == "x y "
    async with shared_client.stream("POST", "/api/generate", json={**body, "stream": True}) as s:
        lines = [json.loads(line) async for line in s.aiter_lines() if line]
    assert "".join(line["response"] for line in lines) == "x y "
    assert lines[-1]["done"]


async def test_tags_and_ps(client: httpx.AsyncClient) -> None:
    names = [m["name"] for m in (await client.get("/api/tags")).json()["models"]]
    assert {"embed", "chat", "intent"} <= set(names)
    resident = (await client.get("/api/ps")).json()["models"]
    assert [m["name"] for m in resident] == ["embed"]  # preloaded; nothing else ran
    assert resident[0]["size"] > 0
    assert (await client.get("/api/version")).json()["version"]


async def test_show_says_what_a_model_can_do(shared_client: httpx.AsyncClient) -> None:
    async def capabilities(**body: str) -> list[str]:
        r = await shared_client.post("/api/show", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["details"]["family"]
        found: list[str] = r.json()["capabilities"]
        return found

    assert await capabilities(model="embed:latest") == ["embedding"]
    assert await capabilities(name="chat") == ["completion"]  # in process: no tools
    assert await capabilities(model="intent") == []


async def test_pulling_a_model_served_here_succeeds_at_once(
    shared_client: httpx.AsyncClient,
) -> None:
    r = await shared_client.post("/api/pull", json={"model": "embed:latest", "stream": False})
    assert r.json() == {"status": "success"}
    async with shared_client.stream("POST", "/api/pull", json={"model": "chat"}) as s:
        lines = [json.loads(line) async for line in s.aiter_lines() if line]
    assert [line["status"] for line in lines] == ["pulling manifest", "success"]


async def test_a_chat_or_generation_of_nothing_loads_and_keep_alive_0_unloads(
    client: httpx.AsyncClient,
) -> None:
    def resident() -> Awaitable[httpx.Response]:
        return client.get("/api/ps")

    r = await client.post("/api/generate", json={"model": "chat"})  # Ollama's load
    assert r.status_code == 200, r.text
    assert (r.json()["response"], r.json()["done"], r.json()["done_reason"]) == ("", True, "load")
    assert "chat" in [m["name"] for m in (await resident()).json()["models"]]
    r = await client.post("/api/chat", json={"model": "chat", "messages": [], "keep_alive": 0})
    assert r.status_code == 200, r.text
    assert r.json()["message"] == {"role": "assistant", "content": ""}
    assert r.json()["done_reason"] == "unload"
    assert "chat" not in [m["name"] for m in (await resident()).json()["models"]]
    r = await client.post("/api/chat", json={"model": "chat", "messages": [], "keep_alive": "5m"})
    assert r.json()["done_reason"] == "load"


async def test_only_an_admin_key_unloads_through_ollamas_api(
    engine: Engine, tmp_path: Path
) -> None:
    with TenantStore(tmp_path / "data") as store:
        store.add_tenant("ops")
        store.add_tenant("acme")
        keys = {
            "admin": store.create_key("ops", admin=True).key,
            "acme": store.create_key("acme").key,
        }
        transport = httpx.ASGITransport(app=create_app(engine, tenant_store=store))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            unload = {"model": "chat", "keep_alive": "0s"}
            for who, status in (("acme", 403), ("admin", 200)):
                headers = {"Authorization": f"Bearer {keys[who]}"}
                r = await client.post("/api/generate", json={"model": "chat"}, headers=headers)
                assert r.json()["done_reason"] == "load"  # any key that may use it loads it
                r = await client.post("/api/generate", json=unload, headers=headers)
                assert r.status_code == status, r.text
            assert (
                "admin key"
                in (
                    await client.post(
                        "/api/generate",
                        json=unload,
                        headers={"Authorization": f"Bearer {keys['acme']}"},
                    )
                ).json()["error"]
            )


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/api/embed", {"model": "nope", "input": "x"}, 404, "nope"),
        ("/api/embed", {"model": "embed", "input": ""}, 400, "empty"),
        ("/api/chat", {"model": "embed", "messages": []}, 400, "embed"),  # a load: no chat
        ("/api/generate", {"model": "nope"}, 404, "nope"),
        (
            "/api/chat",
            {
                "model": "chat",
                "messages": [{"role": "user", "content": "x"}],
                "format": "json",
                "stream": False,
            },
            400,
            "JSON",
        ),
        (
            "/api/chat",
            {
                "model": "chat",
                "messages": [{"role": "user", "content": "x", "images": ["not base64!"]}],
                "stream": False,
            },
            400,
            "base64",
        ),
        (
            "/api/generate",
            {"model": "chat", "prompt": "x", "options": {"temperature": 3}},
            400,
            "temperature",
        ),
        ("/api/generate", {"model": "embed", "prompt": "x", "stream": False}, 400, "embed"),
        (  # a generation's images are read as a chat's (they were ignored)
            "/api/generate",
            {"model": "chat", "prompt": "x", "images": ["not base64!"], "stream": False},
            400,
            "base64",
        ),
        (
            "/api/generate",
            {"model": "chat", "prompt": "x", "images": ["aGk="], "raw": True, "stream": False},
            400,
            "not with raw",
        ),
        ("/api/show", {"model": "nope"}, 404, "nope"),
        ("/api/show", {}, 400, "model is required"),
        ("/api/pull", {"model": "llama3:8b"}, 404, "llama3:8b"),
    ],
)
async def test_errors_read_as_ollamas(
    shared_client: httpx.AsyncClient, path: str, body: dict[str, object], status: int, says: str
) -> None:
    r = await shared_client.post(path, json=body)
    assert r.status_code == status, r.text
    assert list(r.json()) == ["error"]
    assert says in r.json()["error"]
