"""The fake model's ``stack`` option (the engine ceiling bench's stacked forms):
its batches meet in rounds (``runtimes/stacking.Rendezvous``) on the executor's
threads for batches across models, and each caller gets its own answer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from builders import fake_engine
from tessera.runtimes import fake
from tessera.runtimes.fake import fake_embedding
from tessera.tasks.types import Task, TextInput


async def test_fakes_that_stack_answer_each_caller_from_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds: list[tuple[int, str]] = []
    run_round = fake._run_round

    def counted(calls: list[Callable[[], list[Any]]]) -> Callable[[], list[Any]]:
        rounds.append((len(calls), threading.current_thread().name))
        return run_round(calls)

    monkeypatch.setattr(fake, "_ROUNDS", {})
    monkeypatch.setattr(fake, "_run_round", counted)
    card = {"task": "embedding", "preload": True, "batching": {"max_batch_size": 1}}
    cards = {f"m{i}": {**card, "options": {"stack": 4, "run_s": 0.005}} for i in range(4)}
    async with fake_engine(tmp_path, {**cards, "plain": card}) as engine:
        rounds.clear()  # the preloads' warm-up batches
        texts = [f"text {i}" for i in range(24)]
        calls = [
            engine.infer(f"m{i % 4}", Task.EMBEDDING, [TextInput(t)]) for i, t in enumerate(texts)
        ]
        got = await asyncio.gather(*calls)
        for (vector,), text in zip(got, texts, strict=True):
            np.testing.assert_array_equal(vector, fake_embedding(text))
        assert sum(size for size, _ in rounds) == 24  # a batch a request
        assert max(size for size, _ in rounds) >= 2  # some met (each sleeps 5 ms)
        assert all(thread.startswith("tessera-across") for _, thread in rounds)
        count = len(rounds)
        (alone,) = await engine.infer("plain", Task.EMBEDDING, [TextInput("x")])
        np.testing.assert_array_equal(alone, fake_embedding("x"))
        assert len(rounds) == count  # a model without the option meets none
