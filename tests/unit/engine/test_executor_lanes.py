"""The compute executor's long lane (``long_work: lane``): a long batch cannot
hold every worker. The default, ``steps``, is tested in ``test_executor_steps.py``.

Batches run on real threads, so these tests wait on events, never on time:
each batch records the thread it ran on and the order it ran in, and a gate
holds the long batch open until the test lets it go. A thread that waits on
the gate gives up after ``HANG_GUARD_S`` only when the code under test is
broken (then the test fails instead of hanging).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

from tessera.device import CpuDevice, CudaDevice
from tessera.engine.executor import CUDA_WORKERS, ComputeExecutor, default_workers

HANG_GUARD_S = 10.0

Batch = Callable[[Sequence[Any]], list[Any]]


class Log:
    """What ran, where, in what order."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.events: list[str] = []
        self.threads: dict[str, str] = {}
        self._lock = threading.Lock()

    def _note(self, event: str, name: str) -> None:
        with self._lock:
            self.events.append(event)
            self.threads[name] = threading.current_thread().name

    def blocking(self, name: str) -> Batch:
        def fn(items: Sequence[Any]) -> list[Any]:
            self.gate.wait(HANG_GUARD_S)
            self._note(f"{name} ended", name)
            return list(items)

        return fn

    def echo(self, name: str) -> Batch:
        def fn(items: Sequence[Any]) -> list[Any]:
            self._note(f"{name} ran", name)
            return [f"done {item}" for item in items]

        return fn


async def submitted(task: asyncio.Future[Any]) -> None:
    """Let ``task`` hand its batch to a worker (``run`` submits before it awaits)."""
    await asyncio.sleep(0)
    assert not task.done()


async def test_in_the_lane_a_short_batch_runs_while_a_long_one_holds_the_only_worker() -> None:
    executor = ComputeExecutor(
        CpuDevice(), num_threads=1, num_workers=1, long_batch_s=0.5, long_work="lane"
    )
    log = Log()
    try:
        long_run = asyncio.ensure_future(executor.run(log.blocking("long"), ["page"], 3.0))
        await submitted(long_run)
        short = await executor.run(log.echo("short"), ["s"], expected_s=0.01)
        assert short.outputs == ["done s"]
        assert log.events == ["short ran"]  # the long batch still holds its lane
        log.gate.set()
        assert (await long_run).outputs == ["page"]
        assert log.threads["long"].startswith("tessera-long")
        assert log.threads["short"].startswith("tessera-compute")
    finally:
        log.gate.set()
        executor.shutdown()


async def test_without_the_lane_a_short_batch_waits_for_the_long_one() -> None:
    executor = ComputeExecutor(CpuDevice(), num_threads=1, num_workers=1, long_batch_s=None)
    log = Log()
    try:
        long_run = asyncio.ensure_future(executor.run(log.blocking("long"), ["page"], 3.0))
        await submitted(long_run)
        short = asyncio.ensure_future(executor.run(log.echo("short"), ["s"], expected_s=0.01))
        await submitted(short)
        log.gate.set()
        assert (await short).outputs == ["done s"]
        await long_run
        # One worker ran both, one after the other.
        assert log.events == ["long ended", "short ran"]
        assert log.threads["long"] == log.threads["short"]
    finally:
        log.gate.set()
        executor.shutdown()


async def test_unpredicted_batches_take_the_short_lane() -> None:
    executor = ComputeExecutor(CpuDevice(), num_threads=1, num_workers=1, long_batch_s=0.5)
    log = Log()
    try:
        first = asyncio.ensure_future(executor.run(log.blocking("a"), ["a"], expected_s=None))
        await submitted(first)
        second = asyncio.ensure_future(executor.run(log.echo("b"), ["b"], expected_s=None))
        await submitted(second)
        log.gate.set()
        assert (await second).outputs == ["done b"]
        await first
        # The short lane, as the first: it waited for the only slot, which the
        # first held (the lane's threads outnumber its slots: a batch waits
        # for a slot on a thread of its own).
        assert log.events == ["a ended", "b ran"]
        assert all(log.threads[n].startswith("tessera-compute") for n in ("a", "b"))
    finally:
        log.gate.set()
        executor.shutdown()


async def test_a_batch_that_overlaps_a_load_is_not_measured() -> None:
    from tessera.runtimes.memory import reset_peak

    executor = ComputeExecutor(CpuDevice(), num_threads=1, num_workers=1)
    log = Log()
    try:
        alone = await executor.run(log.echo("a"), ["a"])
        with executor.loading():
            during = await executor.run(log.echo("b"), ["b"])
        assert during.peak_bytes is None
        assert (alone.peak_bytes is not None) == reset_peak()
    finally:
        executor.shutdown()


def test_a_gpu_runs_two_batches_at_once_unless_told_and_a_cpu_one_a_thread() -> None:
    # One launching while one is prepared or finished; more only contend for the GIL.
    assert default_workers(CudaDevice(0), 16) == CUDA_WORKERS == 2
    assert default_workers(CudaDevice(0), 1) == 1
    assert default_workers(CpuDevice(), 16) == 16


async def test_batches_across_models_run_beside_each_other_without_a_compute_slot() -> None:
    # One compute slot (steps); batches that may run with other models'
    # (runtimes/stacking.py) wait for a round's leader, not for a slot: two
    # that must meet (a barrier of two) meet, on threads of their own.
    executor = ComputeExecutor(
        CpuDevice(),
        num_threads=1,
        num_workers=1,
        long_batch_s=0.5,
        long_work="steps",
        across_models_threads=2,
    )
    log = Log()
    meet = threading.Barrier(2, timeout=HANG_GUARD_S)

    def meeting(name: str) -> Batch:
        def fn(items: Sequence[Any]) -> list[Any]:
            meet.wait()
            return log.echo(name)(items)

        return fn

    try:
        runs = await asyncio.gather(
            executor.run(meeting("a"), ["x"], 0.01, across_models=True),
            executor.run(meeting("b"), ["y"], 0.01, across_models=True),
        )
        assert [r.outputs for r in runs] == [["done x"], ["done y"]]
        assert all(log.threads[n].startswith("tessera-across") for n in ("a", "b"))
        plain = await executor.run(log.echo("plain"), ["z"], 0.01)
        assert plain.outputs == ["done z"]
        assert log.threads["plain"].startswith("tessera-compute")
        # A long one goes where long batches go, whatever it may share.
        long_run = await executor.run(log.echo("long"), ["p"], 3.0, across_models=True)
        assert long_run.outputs == ["done p"]
        assert log.threads["long"].startswith("tessera-long")
    finally:
        executor.shutdown()
