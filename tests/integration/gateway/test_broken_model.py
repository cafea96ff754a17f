"""A broken model is its own problem: a poisoned input fails only its request,
a batch out of memory is split and retried, missing weights answer 503 with
Retry-After and no server path. The real app in-process, over fake models."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from builders import fake_engine
from harness.fake_models import fake_embedding
from tessera.engine import Engine
from tessera.gateway import create_app
from tessera.tasks.types import Task, TextInput

GATHER = {"max_batch_size": 8, "max_wait_ms": 300}  # concurrent requests form one batch
MODELS: dict[str, dict[str, Any]] = {
    "picky": {"task": "embedding", "options": {"fail_on": "poison"}, "batching": GATHER},
    # Its warm-up (8 short sentences) fits; 4 texts of 400 characters do not, 2 do.
    "small-memory": {"task": "embedding", "options": {"max_batch_chars": 1000}, "batching": GATHER},
    "no-memory": {"task": "embedding", "options": {"max_batch_chars": 1000}},
    # As picky, with batches that take wall time: a caller can leave while one runs.
    "slow-picky": {
        "task": "embedding",
        "options": {"fail_on": "poison", "run_s": 0.3},
        "batching": GATHER,
    },
    # Raises on every input sent (its warm-up's sentence excepted, or it would not load).
    "broken": {"task": "embedding", "options": {"fail_on": "#"}, "batching": GATHER},
    # Fails a chat that holds "poison", before its first token.
    "picky-chat": {"task": "generate", "options": {"fail_on": "poison"}},
    "missing": {
        "task": "embedding",
        "runtime": "onnx",
        "adapter": "onnx-encoder",
        "source": {"path": "weights/model.onnx"},  # not there
    },
}


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    async with fake_engine(tmp_path / "repo", MODELS) as engine:
        yield engine


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
        yield client


async def _embed_all(
    client: httpx.AsyncClient, model: str, texts: list[str]
) -> list[httpx.Response]:
    """One request per text, all at once (so that they share a batch), each
    with its own request id ``r<index>``."""
    return list(
        await asyncio.gather(
            *(
                client.post(
                    "/v1/embeddings",
                    json={"model": model, "input": text},
                    headers={"x-request-id": f"r{i}"},
                )
                for i, text in enumerate(texts)
            )
        )
    )


async def test_a_poisoned_input_fails_alone_and_its_neighbours_are_answered(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    texts = ["a", "b", "c", "poison pill", "d", "e"]
    with caplog.at_level(logging.INFO):
        responses = await _embed_all(client, "picky", texts)
    for text, r in zip(texts, responses, strict=True):
        if text == "poison pill":
            assert r.status_code == 500, r.text
            assert r.json()["error"]["type"] == "inference_error"
            assert "fake model failure" not in r.text  # the cause is the log's
            assert r.headers["x-request-id"] == "r3"
        else:
            assert r.status_code == 200, r.text
            embedding = r.json()["data"][0]["embedding"]
            np.testing.assert_allclose(embedding, fake_embedding(text), rtol=1e-6)
    # They did share a batch: it failed whole first, then was split.
    assert "batch of model picky (6 requests) failed, retried in halves" in caplog.text
    failures = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert failures == [
        "model picky failed on request(s) r3: RuntimeError:"
        " fake model failure on an input holding 'poison'"
    ]


async def test_a_batch_out_of_memory_is_split_and_every_request_answered(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    texts = [letter * 400 for letter in "abcd"]
    with caplog.at_level(logging.WARNING):
        responses = await _embed_all(client, "small-memory", texts)
    assert [r.status_code for r in responses] == [200] * 4
    assert "small-memory (4 requests) failed, retried in halves: MemoryError" in caplog.text


async def test_a_request_out_of_memory_alone_gets_503_with_retry_after(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post("/v1/embeddings", json={"model": "no-memory", "input": "a" * 1001})
    assert r.status_code == 503, r.text
    assert "out of memory" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "1"
    assert r.headers["x-request-id"]


async def test_a_broken_model_fails_each_batch_in_three_runs_not_one_per_request(
    client: httpx.AsyncClient, engine: Engine
) -> None:
    responses = await _embed_all(client, "broken", [f"#{i}" for i in range(6)])
    assert [r.status_code for r in responses] == [500] * 6
    stats = engine.snapshot().model("broken")
    assert stats is not None
    # The whole batch failed, then both halves: the model's fault, no more retries.
    assert stats.num_failures == 2


async def test_missing_weights_answer_503_with_retry_after_and_no_server_path(
    client: httpx.AsyncClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        r = await client.post("/v1/embeddings", json={"model": "missing", "input": "a"})
    assert r.status_code == 503, r.text
    assert str(tmp_path) not in r.text
    assert "weights" not in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-request-id"]
    assert "model missing failed to load, retried in 2 s: ModelUnavailableError" in caplog.text
    assert str(tmp_path) in caplog.text  # the operator gets the path
    again = await client.post("/v1/embeddings", json={"model": "missing", "input": "a"})
    assert again.status_code == 503  # within the backoff: not tried again
    assert "retried in" in again.json()["error"]["message"]
    ready = await client.get("/v2/models/missing/ready")
    assert ready.status_code == 503
    assert (await client.get("/v2/health/ready")).json()["failed_models"] == ["missing"]


async def test_a_caller_gone_from_a_failed_batch_is_charged_nothing(engine: Engine) -> None:
    """A request whose caller left while its batch ran, and the batch failed, is
    not retried in the halves; its charge is settled (at nothing), so its audit
    row is written and the quota gives its estimate back."""
    leaving = engine.submit("slow-picky", Task.EMBEDDING, [TextInput("a")])
    poisoned = engine.submit("slow-picky", Task.EMBEDDING, [TextInput("poison")])
    waits = [asyncio.ensure_future(engine.wait(s)) for s in (leaving, poisoned)]
    for _ in range(1000):  # until its batch is running
        if leaving.request.charge.started:
            break
        await asyncio.sleep(0.01)
    waits[0].cancel()
    results = await asyncio.gather(*waits, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert isinstance(results[1], Exception)
    assert leaving.request.charge.units == 0.0
    assert poisoned.request.charge.units == 0.0


def chat(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat),
        ("/v1/completions", lambda text: {"prompt": text}),
        ("/v1/responses", lambda text: {"input": text}),
    ],
)
async def test_a_stream_that_fails_before_its_first_piece_is_an_http_error(
    client: httpx.AsyncClient, path: str, body: Callable[[str], dict[str, Any]]
) -> None:
    """As OpenAI's and vLLM's servers answer a prompt over the context: a
    status the client raises as such, not 200 and an error event."""
    r = await client.post(path, json={"model": "picky-chat", "stream": True, **body("poison")})
    assert r.status_code == 500, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "inference_error"
    r = await client.post(path, json={"model": "picky-chat", "stream": True, **body("hi")})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
