"""The compute executor's long lane: a long batch cannot hold every worker."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from tessera.device import CpuDevice
from tessera.engine.executor import ComputeExecutor

HANG_GUARD_S = 10.0


def blocking(gate: threading.Event) -> Any:
    def fn(items: Sequence[Any]) -> list[Any]:
        gate.wait(HANG_GUARD_S)
        return list(items)

    return fn


def echo(items: Sequence[Any]) -> list[Any]:
    return [f"done {item}" for item in items]


async def test_short_batch_runs_while_a_long_one_holds_the_only_worker() -> None:
    executor = ComputeExecutor(CpuDevice(), num_threads=1, num_workers=1, long_batch_s=0.5)
    gate = threading.Event()
    try:
        long_run = asyncio.ensure_future(executor.run(blocking(gate), ["page"], expected_s=3.0))
        short = await asyncio.wait_for(executor.run(echo, ["s"], expected_s=0.01), HANG_GUARD_S)
        assert short.outputs == ["done s"]
        assert not long_run.done()  # the long batch still holds its lane
        gate.set()
        assert (await long_run).outputs == ["page"]
    finally:
        gate.set()
        executor.shutdown()


async def test_without_the_lane_a_short_batch_waits_for_the_long_one() -> None:
    executor = ComputeExecutor(CpuDevice(), num_threads=1, num_workers=1, long_batch_s=None)
    gate = threading.Event()
    try:
        long_run = asyncio.ensure_future(executor.run(blocking(gate), ["page"], expected_s=3.0))
        short = asyncio.ensure_future(executor.run(echo, ["s"], expected_s=0.01))
        await asyncio.sleep(0.05)
        assert not short.done()
        gate.set()
        assert (await short).outputs == ["done s"]
        await long_run
    finally:
        gate.set()
        executor.shutdown()


async def test_unpredicted_batches_take_the_short_lane() -> None:
    executor = ComputeExecutor(CpuDevice(), num_threads=1, num_workers=1, long_batch_s=0.5)
    gate = threading.Event()
    try:
        first = asyncio.ensure_future(executor.run(blocking(gate), ["a"], expected_s=None))
        second = asyncio.ensure_future(executor.run(echo, ["b"], expected_s=None))
        await asyncio.sleep(0.05)
        assert not second.done()  # same lane as the first: it waits
        gate.set()
        assert (await second).outputs == ["done b"]
        await first
    finally:
        gate.set()
        executor.shutdown()


async def test_a_batch_that_overlaps_a_load_is_not_measured() -> None:
    from tessera.runtimes.memory import reset_peak

    executor = ComputeExecutor(CpuDevice(), num_threads=1, num_workers=1)
    try:
        alone = await executor.run(echo, ["a"])
        with executor.loading():
            during = await executor.run(echo, ["b"])
        assert during.peak_bytes is None
        assert (alone.peak_bytes is not None) == reset_peak()
    finally:
        executor.shutdown()
