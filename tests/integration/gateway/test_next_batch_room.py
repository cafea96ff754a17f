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
from tessera.tasks.types import Task, TextInput, work_units

MODELS: dict[str, dict[str, Any]] = {
    "slow": {
        "task": "embedding",
        "preload": True,
        "batching": {"max_batch_size": 1, "max_wait_ms": 1, "max_concurrent_batches": 1},
        "options": {"run_s": 0.05},
    },
    "scaled": {  # a batch's time grows with its work
        "task": "embedding",
        "preload": True,
        "batching": {"max_batch_size": 8, "max_wait_ms": 1, "max_concurrent_batches": 1},
        "options": {"unit_s": 0.02},
    },
}


@pytest.fixture
def said(monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """What each lease's release says of its model's next batch."""
    told: list[float | None] = []
    release = ResidencyManager.release

    def recording(
        self: ResidencyManager, lease: Lease, *, next_batch_s: float | None = None
    ) -> None:
        told.append(next_batch_s)
        release(self, lease, next_batch_s=next_batch_s)

    monkeypatch.setattr(ResidencyManager, "release", recording)
    return told


async def test_each_batch_ends_saying_whether_another_is_queued(
    tmp_path: Path, said: list[float | None]
) -> None:
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


async def test_the_next_batch_is_predicted_from_its_own_work(
    tmp_path: Path, said: list[float | None]
) -> None:
    # A short batch followed by a long one said the room was wanted for as
    # long as the short one (its own time was taken as the next one's).
    text = "a few words of text"
    one = work_units(TextInput(text))
    async with fake_engine(tmp_path / "repo", MODELS) as engine:
        await engine.infer("scaled", Task.EMBEDDING, [TextInput(text)])  # a time to go by
        said.clear()
        short = asyncio.ensure_future(engine.infer("scaled", Task.EMBEDDING, [TextInput(text)]))
        await asyncio.sleep(0.005)  # the short batch runs; the long one queues behind it
        long = engine.infer("scaled", Task.EMBEDDING, [TextInput(text)] * 8)
        await asyncio.gather(short, long)
    assert len(said) == 2
    assert said[0] is not None
    assert said[0] >= 4 * 0.02 * one  # about 8 items' time, not one's
    assert said[1] is None
