"""Triton's statistics extension over fake models: HTTP (``/v2/models/stats``
and its per-model and per-version forms) and gRPC (``ModelStatistics``,
through tritonclient's aio client): requests answered and failed, their
queue and run time, and the batches by size."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from builders import fake_engine
from serverproc import free_port
from tessera.engine import Engine
from tessera.gateway import create_app

MODELS: dict[str, dict[str, Any]] = {
    "embed": {"task": "embedding", "preload": True, "options": {"run_s": 0.01}},
    "poisoned": {"task": "embedding", "options": {"fail_on": "poison"}},
    "idle": {"task": "embedding"},
}


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    """These models, under the conftest's ``client``."""
    async with fake_engine(tmp_path / "repo", MODELS) as engine:
        yield engine


def infer_body(*texts: str) -> dict[str, Any]:
    tensor = {"name": "TEXT", "datatype": "BYTES", "shape": [len(texts)], "data": list(texts)}
    return {"inputs": [tensor]}


async def test_requests_batches_and_failures_are_counted(client: httpx.AsyncClient) -> None:
    answers = await asyncio.gather(
        *(client.post("/v2/models/embed/infer", json=infer_body(f"t{i}", "x")) for i in range(5))
    )
    assert [r.status_code for r in answers] == [200] * 5
    r = await client.post("/v2/models/poisoned/infer", json=infer_body("poison"))
    assert r.status_code == 500

    r = await client.get("/v2/models/embed/stats")
    assert r.status_code == 200, r.text
    (embed,) = r.json()["model_stats"]
    assert (embed["name"], embed["version"]) == ("embed", "1")
    assert embed["inference_count"] == 10  # texts run
    assert 1 <= embed["execution_count"] <= 5
    stats = embed["inference_stats"]
    assert stats["success"]["count"] == 5
    assert stats["fail"]["count"] == 0
    assert stats["queue"]["count"] == stats["compute_infer"]["count"] == 5
    # Each answered request ran in a batch of at least 10 ms, and waited besides.
    assert stats["compute_infer"]["ns"] >= 5 * 10**7
    assert stats["success"]["ns"] == pytest.approx(
        stats["queue"]["ns"] + stats["compute_infer"]["ns"], abs=10
    )
    batches = embed["batch_stats"]
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in batches) == 10
    assert sum(b["compute_infer"]["count"] for b in batches) == embed["execution_count"]
    assert embed["last_inference"] > 0

    (poisoned,) = (await client.get("/v2/models/poisoned/stats")).json()["model_stats"]
    assert poisoned["inference_stats"]["fail"]["count"] == 1
    assert poisoned["inference_stats"]["success"]["count"] == 0
    assert poisoned["inference_count"] == 0

    everything = (await client.get("/v2/models/stats")).json()["model_stats"]
    assert {m["name"] for m in everything} == {"embed", "poisoned", "idle"}
    idle = next(m for m in everything if m["name"] == "idle")
    assert (idle["inference_count"], idle["last_inference"], idle["batch_stats"]) == (0, 0, [])


async def test_a_version_or_a_model_it_does_not_serve_is_a_404(client: httpx.AsyncClient) -> None:
    r = await client.get("/v2/models/embed/versions/1/stats")
    assert [m["version"] for m in r.json()["model_stats"]] == ["1"]
    for path in ("/v2/models/embed/versions/7/stats", "/v2/models/nope/stats"):
        r = await client.get(path)
        assert r.status_code == 404
        assert isinstance(r.json()["error"], str)


async def test_tritonclients_grpc_statistics(engine: Engine) -> None:
    triton = pytest.importorskip("tritonclient.grpc.aio")
    from tessera.gateway.grpc_kserve import start_grpc

    port = free_port()
    server = await start_grpc(create_app(engine), "127.0.0.1", port)
    try:
        async with triton.InferenceServerClient(f"127.0.0.1:{port}") as client:
            tensor = triton.InferInput("TEXT", [2], "BYTES")
            tensor.set_data_from_numpy(np.array([b"a", b"b"], dtype=object))
            await client.infer("embed", [tensor])
            found = await client.get_inference_statistics("embed", as_json=True)
            everything = await client.get_inference_statistics(as_json=True)
    finally:
        await server.stop(None)
    (embed,) = found["model_stats"]
    assert (embed["name"], embed["version"]) == ("embed", "1")
    assert embed["inference_count"] == "2"  # int64 as protobuf's JSON writes it
    assert embed["inference_stats"]["success"]["count"] == "1"
    assert {m["name"] for m in everything["model_stats"]} == {"embed", "poisoned", "idle"}
