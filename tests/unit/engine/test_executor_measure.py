"""A load's measurement (``measure_exclusive``) beside batches: quiet batches
(short, a few MB reserved) run on through it, loud ones wait for it and it
waits for them.

Measurements and batches run on real threads; the tests wait on events, and a
thread gives up on its gate after ``HANG_GUARD_S`` only when the code under
test is broken (then the test fails instead of hanging).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from tessera.device import CpuDevice
from tessera.engine.executor import QUIET_BYTES, ComputeExecutor

HANG_GUARD_S = 10.0
SHORT_S = 0.01  # predicted run time of a short batch (long ones: 0.5 s and more)


def echo(items: Sequence[Any]) -> list[Any]:
    return list(items)


class Measuring:
    """A load's measurement on a thread of its own, held open until ``end``."""

    def __init__(self, executor: ComputeExecutor) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._measure, args=(executor,))

    def _measure(self, executor: ComputeExecutor) -> None:
        def load() -> None:
            self.started.set()
            self.gate.wait(HANG_GUARD_S)

        executor.measure_exclusive(load)
        self.done.set()

    def start(self) -> None:
        self._thread.start()

    def end(self) -> None:
        self.gate.set()
        self._thread.join(HANG_GUARD_S)


async def until(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, HANG_GUARD_S)


async def submitted(task: asyncio.Future[Any]) -> None:
    """Let ``task`` hand its batch to a worker (``run`` submits before it awaits)."""
    await asyncio.sleep(0)
    assert not task.done()


async def quiet_batch(executor: ComputeExecutor) -> None:
    assert (await executor.run(echo, ["q"], SHORT_S, QUIET_BYTES)).outputs == ["q"]


@pytest.fixture
def executor() -> Any:
    # Two workers: a quiet batch finds one free while a loud one waits or runs.
    executor = ComputeExecutor(CpuDevice(), num_threads=2, num_workers=2, long_batch_s=0.5)
    yield executor
    executor.shutdown()


async def test_a_quiet_batch_runs_while_a_load_is_measured(executor: ComputeExecutor) -> None:
    measuring = Measuring(executor)
    measuring.start()
    try:
        await until(measuring.started)
        run = await executor.run(echo, ["a"], SHORT_S, QUIET_BYTES)
        assert run.outputs == ["a"]
        assert not measuring.done.is_set()
    finally:
        measuring.end()


@pytest.mark.parametrize(
    ("expected_s", "activation_bytes"),
    [
        (1.0, 2**20),  # long
        (None, 2**20),  # not predicted yet
        (SHORT_S, QUIET_BYTES + 1),  # too many bytes
        (SHORT_S, 0),  # no activation measurement yet
        (SHORT_S, None),  # reserved nothing it could tell
    ],
)
async def test_a_loud_batch_waits_for_the_measurement(
    executor: ComputeExecutor, expected_s: float | None, activation_bytes: int | None
) -> None:
    measuring = Measuring(executor)
    measuring.start()
    try:
        await until(measuring.started)
        batch = asyncio.ensure_future(executor.run(echo, ["a"], expected_s, activation_bytes))
        await submitted(batch)
        await quiet_batch(executor)  # submitted after it, run through the measurement
        assert not batch.done()
        measuring.end()
        assert (await batch).outputs == ["a"]
    finally:
        measuring.end()


async def test_a_measurement_waits_for_a_running_loud_batch_only(
    executor: ComputeExecutor,
) -> None:
    gate = threading.Event()
    running = threading.Event()

    def blocking(items: Sequence[Any]) -> list[Any]:
        running.set()
        gate.wait(HANG_GUARD_S)
        return list(items)

    for activation_bytes, waits in ((2**20, False), (QUIET_BYTES * 4, True)):
        gate.clear()
        running.clear()
        batch = asyncio.ensure_future(executor.run(blocking, ["a"], SHORT_S, activation_bytes))
        await until(running)
        measuring = Measuring(executor)
        measuring.start()
        try:
            if waits:
                await quiet_batch(executor)  # the measurement had as long to start
                assert not measuring.started.is_set()
            else:
                await until(measuring.started)
        finally:
            gate.set()
            await batch
            measuring.end()
        assert measuring.done.is_set()


async def test_a_lone_batch_on_cuda_is_measured_from_the_allocators_nested_stats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The CUDA branch on the CPU, torch.cuda's statistics stood in for: the
    # peak a lone batch reaches above what was allocated when it began, read
    # from the nested stats (not the flattened dict memory_allocated builds).
    import torch

    from tessera.device import CudaDevice

    stats = {"allocated_bytes": {"all": {"current": 1000, "peak": 1000}}}
    resets: list[int | None] = []

    def reset_peak(index: int | None = None) -> None:
        resets.append(index)
        for counts in stats.get("allocated_bytes", {}).values():
            counts["peak"] = counts["current"]

    def nested(index: int | None = None) -> dict[str, Any]:
        return stats

    def batch(items: Sequence[Any]) -> list[Any]:
        stats["allocated_bytes"]["all"]["peak"] = 1000 + 4096  # its activations, freed after
        return list(items)

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset_peak)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", nested)
    executor = ComputeExecutor(CudaDevice(3), num_threads=1, num_workers=1)
    try:
        run = await executor.run(batch, [1, 2])
    finally:
        executor.shutdown()
    assert run.outputs == [1, 2]
    assert run.peak_bytes == 4096
    assert resets == [3]
    stats.clear()  # CUDA not initialised: torch's stats are empty, the peak 0
    executor = ComputeExecutor(CudaDevice(3), num_threads=1, num_workers=1)
    try:
        assert (await executor.run(echo, [1])).peak_bytes == 0
    finally:
        executor.shutdown()
