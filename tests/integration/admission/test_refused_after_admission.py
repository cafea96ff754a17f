"""A request admitted (its estimate charged to its tenant's day) and then
refused by its model's queue (503: full, or more work ahead than its
deadline) costs nothing: the estimate is taken back, as for a request that
never ran, so the day's count agrees with the audit log's zero."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from builders import fake_engine
from tessera.admission import TenantLimits
from tessera.engine import Caller
from tessera.errors import OverloadedError, RateLimitedError
from tessera.tasks.types import Task, TextInput, work_units

MODELS = {
    "slow": {
        "task": "embedding",
        "options": {"run_s": 0.3},
        "batching": {"max_batch_size": 1, "max_concurrent_batches": 1},
    },
}


async def test_a_request_the_queue_refuses_gives_its_estimate_back(tmp_path: Path) -> None:
    async with fake_engine(tmp_path / "repo", MODELS, max_queue=1) as engine:
        item = TextInput("x")
        unit = work_units(item, engine.spec("slow").inputs)
        caller = Caller(TenantLimits("acme", daily_units=3 * unit))
        running = engine.submit("slow", Task.EMBEDDING, [item], caller=caller)
        await asyncio.sleep(0.05)  # taken into a batch: the queue is empty again
        queued = engine.submit("slow", Task.EMBEDDING, [item], caller=caller)
        with pytest.raises(OverloadedError, match="full"):
            engine.submit("slow", Task.EMBEDDING, [item], caller=caller)
        await asyncio.gather(engine.wait(running), engine.wait(queued))
        # Two charged, the refused one not: a third fits the quota of three.
        third = engine.submit("slow", Task.EMBEDDING, [item], caller=caller)
        with pytest.raises(RateLimitedError, match="daily quota"):
            engine.submit("slow", Task.EMBEDDING, [item], caller=caller)
        await engine.wait(third)
