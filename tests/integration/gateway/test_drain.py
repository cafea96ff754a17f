"""A drain answers the requests still pending when its grace ends, saying
which grace ended: the configured one, or none left (a second signal)."""

from __future__ import annotations

from pathlib import Path

import pytest

from builders import fake_engine
from tessera.errors import ShuttingDownError
from tessera.tasks.types import Task, TextInput

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
