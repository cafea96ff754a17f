"""A served version's loop (``engine/step.py``) over the real engine and the fake runtime."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from builders import fake_engine, wait_limits
from tessera.admission import TenantLimits
from tessera.engine import Caller
from tessera.engine.step import SLOT_WAIT_SHARE
from tessera.logs import request_id
from tessera.tasks.types import Task, TextInput


class _Seeing(logging.Handler):
    """Records each message with the request id in the context that logged it."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[tuple[str, str | None]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.getMessage(), request_id.get()))


async def test_batches_run_outside_the_context_of_the_request_that_started_the_loop(
    tmp_path: Path,
) -> None:
    """The loop runs in a context of its own: the id of whichever request came
    first would otherwise mark every later batch's log lines (loads, evictions)."""
    handler = _Seeing()
    logger = logging.getLogger("tessera.engine.host")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        async with fake_engine(tmp_path, {"m": {"task": "embedding"}}) as engine:
            token = request_id.set("first-request")
            try:
                outputs = await engine.infer("m", Task.EMBEDDING, [TextInput("x")])
            finally:
                request_id.reset(token)
            assert len(outputs) == 1
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    loads = [rid for message, rid in handler.seen if message.startswith("loaded m")]
    assert loads == [None]


@pytest.mark.parametrize(
    ("model_target_ms", "tier_target_s", "limit_s"),
    [
        (None, None, None),  # no target: the batch waits as the slots say
        (200, None, 0.2 * SLOT_WAIT_SHARE),
        (None, 0.4, 0.4 * SLOT_WAIT_SHARE),
        (200, 0.1, 0.1 * SLOT_WAIT_SHARE),  # the tighter of the two
        (200, 0.4, 0.2 * SLOT_WAIT_SHARE),
    ],
)
async def test_a_batch_waits_for_a_slot_at_most_a_share_of_its_tightest_latency_target(
    tmp_path: Path, model_target_ms: int | None, tier_target_s: float | None, limit_s: float | None
) -> None:
    model: dict[str, Any] = {"task": "embedding"}
    if model_target_ms is not None:
        model["latency_target_ms"] = model_target_ms
    caller = Caller(TenantLimits("t"), latency_target_s=tier_target_s)
    async with fake_engine(tmp_path, {"m": model}) as engine:
        with wait_limits() as seen:
            await engine.infer("m", Task.EMBEDDING, [TextInput("x")], caller=caller)
    assert seen == [pytest.approx(limit_s)] if limit_s is not None else [None]
