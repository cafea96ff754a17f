"""A request of more items than a batch holds (OpenAI takes 2,048 inputs, and
LangChain's OpenAIEmbeddings sends 1,000 at a time) is queued as parts of a
batch's worth each: its outputs come whole and in order, each batch stays
within the card's size, its tenant is charged its units once, and a part that
fails fails the request without leaving the others to run or to charge."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from builders import fake_engine
from harness.fake_models import fake_embedding
from tessera.admission import TenantLimits
from tessera.engine import Caller, Engine, RequestTrace
from tessera.gateway import create_app
from tessera.tasks.types import Task, TextInput, work_units

BATCH = 8
MODELS: dict[str, dict[str, Any]] = {
    "embed": {"task": "embedding", "batching": {"max_batch_size": BATCH}, "max_inputs": 2048},
    "picky": {
        "task": "embedding",
        "options": {"fail_on": "poison"},
        "batching": {"max_batch_size": BATCH},
    },
    "slow": {
        "task": "embedding",
        "options": {"run_s": 0.2},
        "batching": {"max_batch_size": BATCH, "max_concurrent_batches": 1},
    },
}


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    async with fake_engine(tmp_path / "repo", MODELS) as engine:
        yield engine


async def test_a_large_request_is_answered_whole_in_order_in_batches_of_the_cards_size(
    engine: Engine,
) -> None:
    texts = [f"text number {i}" for i in range(1000)]
    caller = Caller(TenantLimits("acme", daily_units=5000))
    trace = RequestTrace()
    items = [TextInput(t) for t in texts]
    outputs = await engine.infer("embed", Task.EMBEDDING, items, caller=caller, trace=trace)
    assert len(outputs) == 1000
    for text, vector in zip(texts, outputs, strict=True):
        np.testing.assert_allclose(vector, fake_embedding(text))
    model = engine.snapshot().model("embed")
    assert model is not None
    sizes = [size for size, _ in model.recent_batches]
    assert max(sizes) <= BATCH
    assert sum(sizes) == 1000
    inputs = engine.spec("embed").inputs
    assert trace.units == pytest.approx(sum(work_units(i, inputs) for i in items))  # all, once
    assert trace.batch_size <= BATCH


async def test_a_part_that_fails_fails_the_request_and_charges_only_what_ran(
    engine: Engine,
) -> None:
    items = [TextInput("fine")] * (3 * BATCH) + [TextInput("poison")]
    trace = RequestTrace()
    with pytest.raises(Exception, match="failed"):
        await engine.infer("picky", Task.EMBEDDING, items, trace=trace)
    assert trace.charge is not None
    for _ in range(200):
        if trace.charge.settled:
            break
        await asyncio.sleep(0.01)
    assert trace.charge.units is not None
    assert trace.charge.units <= len(items)


async def test_a_caller_who_leaves_drops_the_parts_not_yet_run(engine: Engine) -> None:
    items = [TextInput(f"t{i}") for i in range(10 * BATCH)]
    submission = engine.submit("slow", Task.EMBEDDING, items, timeout_s=0.3)
    assert len(submission.parts) == 10
    with pytest.raises(Exception, match="within"):
        await engine.wait(submission)
    ran = [part for part in submission.parts if part.charge.started]
    assert 1 <= len(ran) < 10  # one batch at a time, 0.2 s each, within 0.3 s
    assert all(part.future.done() for part in submission.parts)
    for _ in range(200):  # the charge is settled once the batch running ends
        if submission.request.charge.settled:
            break
        await asyncio.sleep(0.01)
    charged = submission.request.charge.units
    assert charged is not None
    assert 0 < charged <= sum(part.units for part in ran)  # what ran, not the whole


async def test_through_http_a_thousand_inputs_are_one_answer(engine: Engine) -> None:
    transport = httpx.ASGITransport(app=create_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
        texts = [f"doc {i}" for i in range(1000)]
        r = await client.post("/v1/embeddings", json={"model": "embed", "input": texts})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["index"] for d in data] == list(range(1000))
        np.testing.assert_allclose(data[999]["embedding"], fake_embedding("doc 999"), rtol=1e-5)
        r = await client.post("/v1/embeddings", json={"model": "embed", "input": ["x"] * 2049})
        assert r.status_code == 413
