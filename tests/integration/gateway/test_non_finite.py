"""A model that answers NaN is failing, not serving: weights that answer NaN
at their warm-up fail to load (named in ``failed_models`` at start), and a
non-finite answer at request time is a JSON 500 on every face, never a 200
with ``null``s nor a bare ``NaN``. The real app in-process, over fake models."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from builders import fake_engine
from harness.fake_models import fake_embedding
from serverproc import free_port
from tessera.engine import Engine
from tessera.gateway import create_app

MODELS: dict[str, dict[str, Any]] = {
    # Every answer NaN, its warm-up's too: weights gone NaN.
    "nan-weights": {"task": "embedding", "preload": True, "options": {"nan_on": ""}},
    # NaN for an input holding "poison" only (its warm-up loads it).
    "nan-on": {
        "task": "embedding",
        "options": {"nan_on": "poison"},
        "batching": {"max_batch_size": 8, "max_wait_ms": 300},
    },
    "nan-rerank": {"task": "rerank", "options": {"nan_on": ""}},
    "fine": {"task": "embedding", "preload": True},
}

POISON = "poison pill"


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    async with fake_engine(tmp_path / "repo", MODELS) as engine:
        yield engine


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
        yield client


def strict_json(response: httpx.Response) -> Any:
    """The body as JSON that has no NaN nor Infinity (Python's parser takes them)."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the body: {response.text[:200]}")

    return json.loads(response.text, parse_constant=refuse)


async def test_weights_that_answer_nan_are_failed_at_start_and_never_served(
    client: httpx.AsyncClient,
) -> None:
    ready = await client.get("/v2/health/ready")
    assert ready.status_code == 200
    assert strict_json(ready)["failed_models"] == ["nan-weights"]
    residency = strict_json(await client.get("/admin/residency"))
    (row,) = [m for m in residency["models"] if m["name"] == "nan-weights"]
    assert row["state"] == "failed"
    assert "not finite" in row["error"]
    r = await client.post("/v1/embeddings", json={"model": "nan-weights", "input": "a"})
    assert r.status_code == 503, r.text
    assert strict_json(r)["error"]["type"] == "model_unavailable"
    assert "retry-after" in r.headers


# Each face's request for one text, and how its error body names the failure.
FACES: list[tuple[str, str, Any]] = [
    ("openai", "/v1/embeddings", lambda m, t: {"model": m, "input": t}),
    ("cohere", "/v2/embed", lambda m, t: {"model": m, "texts": [t], "input_type": "search_query"}),
    ("ollama", "/api/embed", lambda m, t: {"model": m, "input": t}),
    ("tei", "/tei/{model}/embed", lambda m, t: {"inputs": t}),
    (
        "kserve",
        "/v2/models/{model}/infer",
        lambda m, t: {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": [t]}]},
    ),
]


@pytest.mark.parametrize(("face", "path", "body"), FACES, ids=[f[0] for f in FACES])
async def test_a_nan_answer_is_a_json_500_on_every_face(
    client: httpx.AsyncClient, face: str, path: str, body: Any
) -> None:
    url = path.format(model="nan-on")
    r = await client.post(url, json=body("nan-on", POISON))
    assert r.status_code == 500, r.text
    error = strict_json(r)
    assert "not finite" in json.dumps(error), error
    # The same face answers a finite input of the same model.
    ok = await client.post(url, json=body("nan-on", "a b"))
    assert ok.status_code == 200, ok.text
    strict_json(ok)


async def test_a_nan_answer_fails_only_its_request_in_a_shared_batch(
    client: httpx.AsyncClient, engine: Engine
) -> None:
    import asyncio

    texts = ["a", "b", POISON, "c"]
    responses = await asyncio.gather(
        *(client.post("/v1/embeddings", json={"model": "nan-on", "input": t}) for t in texts)
    )
    for text, r in zip(texts, responses, strict=True):
        if text == POISON:
            assert r.status_code == 500, r.text
            assert strict_json(r)["error"]["type"] == "model_output_error"
        else:
            assert r.status_code == 200, r.text
            embedding = strict_json(r)["data"][0]["embedding"]
            np.testing.assert_allclose(embedding, fake_embedding(text), rtol=1e-6)
    stats = engine.snapshot().model("nan-on")
    assert stats is not None
    assert stats.num_failures >= 1  # counted as the model's failures


async def test_nan_scores_are_a_json_500_not_a_200(client: httpx.AsyncClient) -> None:
    # Warm-up of a reranker: its scores are NaN too, so it fails to load (503).
    r = await client.post(
        "/v1/rerank", json={"model": "nan-rerank", "query": "q", "documents": ["a", "b"]}
    )
    assert r.status_code in (500, 503), r.text
    strict_json(r)


async def test_grpc_infer_of_a_nan_answer_is_internal(engine: Engine) -> None:
    grpc = pytest.importorskip("grpc")
    triton = pytest.importorskip("tritonclient.grpc.aio")
    from tritonclient.utils import InferenceServerException

    from tessera.gateway.grpc_kserve import start_grpc

    port = free_port()
    server = await start_grpc(create_app(engine), "127.0.0.1", port)
    try:
        async with triton.InferenceServerClient(f"127.0.0.1:{port}") as client:
            tensor = triton.InferInput("TEXT", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([POISON.encode()], dtype=object))
            with pytest.raises(InferenceServerException) as raised:
                await client.infer("nan-on", [tensor])
            assert raised.value.status() == str(grpc.StatusCode.INTERNAL)
            assert "not finite" in raised.value.message()
    finally:
        await server.stop(None)


def test_nan_is_not_finite_in_any_output_shape() -> None:
    from tessera.tasks.finiteness import is_finite
    from tessera.tasks.types import ClassifyOutput, LabelScore

    assert not is_finite(np.array([1.0, math.nan], dtype=np.float32))
    assert not is_finite(np.array([math.inf], dtype=np.float16))
    assert not is_finite(math.nan)
    assert not is_finite(ClassifyOutput((LabelScore("a", math.nan),)))
    assert is_finite(np.array([1, 2], dtype=np.int16))
    assert is_finite("text")
    assert is_finite(ClassifyOutput((LabelScore("a", 0.5),)))
