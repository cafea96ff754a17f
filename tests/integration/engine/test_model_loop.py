"""A served version's loop (``engine/step.py``) over the real engine and the fake runtime."""

from __future__ import annotations

import logging
from pathlib import Path

from builders import fake_engine
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
