"""The engine tells residency, as each batch ends, whether another batch of
the model is queued and how long it should take (``ResidencyManager.release``'s
``next_batch_s``): the room a batch held may be kept for the next one."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from builders import fake_engine
from tessera.residency import ResidencyManager
from tessera.residency.manager import Lease
from tessera.tasks.types import Task, TextInput

MODELS: dict[str, dict[str, Any]] = {
    "slow": {
        "task": "embedding",
        "preload": True,
        "batching": {"max_batch_size": 1, "max_wait_ms": 1, "max_concurrent_batches": 1},
        "options": {"run_s": 0.05},
    },
}


async def test_each_batch_ends_saying_whether_another_is_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[float | None] = []
    release = ResidencyManager.release

    def recording(
        self: ResidencyManager, lease: Lease, *, next_batch_s: float | None = None
    ) -> None:
        said.append(next_batch_s)
        release(self, lease, next_batch_s=next_batch_s)

    monkeypatch.setattr(ResidencyManager, "release", recording)
    async with fake_engine(tmp_path / "repo", MODELS) as engine:
        said.clear()  # the preload's lease
        await asyncio.gather(
            *(engine.infer("slow", Task.EMBEDDING, [TextInput(f"x{i}")]) for i in range(3))
        )
    # Three batches of one: the first has no run time to go by yet, the second
    # is followed by the third (about as long as itself), the third by nothing.
    assert len(said) == 3
    assert said[0] is None
    assert said[1] == pytest.approx(0.05, abs=0.04)
    assert said[2] is None
