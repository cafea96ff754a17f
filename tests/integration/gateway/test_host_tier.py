"""The host tier through the real app and engine host, over fake models that can
wait there: a model evicted by another comes back from the tier with the same
answers, and /admin/residency and /metrics say so."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from builders import fake_engine
from tessera.gateway import create_app

MIB = 1024**2
# Each holds 40 MiB: one fits the 64 MiB budget at a time.
MODELS: dict[str, dict[str, Any]] = {
    "a": {"task": "embedding", "options": {"own_bytes": 40 * MIB, "host_tier": True}},
    "b": {"task": "embedding", "options": {"own_bytes": 40 * MIB, "host_tier": True}},
    "plain": {"task": "embedding", "options": {"own_bytes": 40 * MIB}},
}


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with fake_engine(tmp_path / "repo", MODELS, host_memory_budget_bytes=100 * MIB) as e:
        app = create_app(e, max_body_bytes=64 * 1024)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
            yield client


async def embed(client: httpx.AsyncClient, model: str) -> list[float]:
    r = await client.post("/v1/embeddings", json={"model": model, "input": "the same words"})
    assert r.status_code == 200, r.text
    vector: list[float] = r.json()["data"][0]["embedding"]
    return vector


async def residency(client: httpx.AsyncClient) -> tuple[dict[str, Any], dict[str, Any]]:
    body = (await client.get("/admin/residency")).json()
    return body, {m["name"]: m for m in body["models"]}


async def test_an_evicted_model_comes_back_from_the_host_tier_with_the_same_answers(
    client: httpx.AsyncClient,
) -> None:
    first = await embed(client, "a")
    await embed(client, "b")  # evicts a into the host tier
    body, models = await residency(client)
    assert body["host_budget_bytes"] == 100 * MIB
    assert body["host_used_bytes"] == 40 * MIB
    assert models["a"]["state"] == "unloaded"
    assert models["a"]["host_tier"] is True
    assert models["a"]["host_bytes"] == 40 * MIB

    assert await embed(client, "a") == first  # evicts b into the tier, a comes back
    body, models = await residency(client)
    assert models["a"]["state"] == "ready"
    assert models["a"]["host_tier"] is False
    assert models["a"]["host_loads"] == 1
    assert models["a"]["loads"] == 2
    assert models["a"]["files_load_s"] > 0
    assert models["a"]["host_load_s"] > 0
    assert models["b"]["host_tier"] is True
    assert body["host_loads_total"] == 1

    metrics = (await client.get("/metrics")).text
    assert 'tessera_model_host_tier_loads_total{model="a"} 1.0' in metrics
    assert 'tessera_model_host_tier_bytes{model="b"} 4.194304e+07' in metrics  # 40 MiB
    assert "tessera_host_tier_used_bytes 4.194304e+07" in metrics


async def test_a_model_that_cannot_wait_in_the_tier_is_loaded_from_files(
    client: httpx.AsyncClient,
) -> None:
    first = await embed(client, "plain")
    await embed(client, "a")  # evicts plain: unloaded
    body, models = await residency(client)
    assert models["plain"]["host_tier"] is False
    assert body["host_used_bytes"] == 0
    assert await embed(client, "plain") == first
    _, models = await residency(client)
    assert (models["plain"]["loads"], models["plain"]["host_loads"]) == (2, 0)
    assert models["a"]["host_tier"] is True


async def test_unloading_by_hand_drops_the_host_copy(client: httpx.AsyncClient) -> None:
    await embed(client, "a")
    await embed(client, "b")
    r = await client.post("/admin/models/a/unload")
    assert r.json()["was_loaded"] is False
    body, models = await residency(client)
    assert models["a"]["host_tier"] is False
    assert body["host_used_bytes"] == 0
