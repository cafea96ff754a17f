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
from harness import fake_models as fake
from harness.fake_models import fake_embedding
from tessera.tasks.types import Task, TextInput


async def test_fakes_that_stack_answer_each_caller_from_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds: list[tuple[int, str]] = []
    run_round = fake._run_round

    def counted(device: Any, calls: list[Callable[[], list[Any]]]) -> Callable[[], list[Any]]:
        rounds.append((len(calls), threading.current_thread().name))
        return run_round(device, calls)

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


async def test_a_fakes_device_model_costs_a_batch_or_a_whole_round_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Options host_calls and device_s (the engine ceiling bench's --device):
    # a batch alone makes its calls that hand the interpreter lock over and
    # takes its device time under the one device's lock; a stacked round
    # makes a round's once, whatever its batches, and its device time comes
    # in the round's finish (after the lead is handed on).
    sleeps: list[tuple[float, bool]] = []
    sleep = fake.time.sleep

    def recorded(seconds: float) -> None:
        sleeps.append((seconds, fake._DEVICE.locked()))
        sleep(seconds)

    monkeypatch.setattr(fake, "_ROUNDS", {})
    monkeypatch.setattr(fake.time, "sleep", recorded)
    card = {"task": "embedding", "preload": True, "batching": {"max_batch_size": 1}}
    alone = {**card, "options": {"host_calls": 3, "device_s": 0.002}}
    stacked = {"stack": 4, "host_calls": 3, "device_s": 0.002}
    stacked.update(round_host_calls=5, round_device_s=0.004)
    cards = {f"m{i}": {**card, "options": stacked} for i in range(4)}
    async with fake_engine(tmp_path, {**cards, "alone": alone}) as engine:
        sleeps.clear()
        await engine.infer("alone", Task.EMBEDDING, [TextInput("x")])
        assert sleeps == [(0, False)] * 3 + [(0.002, True)]
        sleeps.clear()
        before = engine.snapshot()
        texts = [f"text {i}" for i in range(8)]
        calls = [
            engine.infer(f"m{i % 4}", Task.EMBEDDING, [TextInput(t)]) for i, t in enumerate(texts)
        ]
        await asyncio.gather(*calls)
        after = engine.snapshot()
        rounds = [s for s in sleeps if s == (0.004, True)]
        # 5 calls a round (a launch may overlap the last round's device time)
        assert len([s for s, _ in sleeps if s == 0]) == 5 * len(rounds)
        assert {s for s, _ in sleeps} == {0, 0.004}  # none of a batch's own
        stacked_batches = after.stacked_batches_total - before.stacked_batches_total
        stacked_rounds = after.stacked_rounds_total - before.stacked_rounds_total
        assert stacked_batches + (len(rounds) - stacked_rounds) == 8  # rounds of one uncounted
