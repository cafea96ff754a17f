"""Where batches run: a fixed pool of compute workers sharing one thread budget.

The process has ``num_threads`` cores to spend. ``num_workers`` batches run
at once, each with ``num_threads // num_workers`` intra-op threads (torch's
global setting, onnxruntime's session option, a native engine's option), so
torch, onnxruntime and native engines together never oversubscribe the cores.

A batch predicted to run for ``long_batch_s`` or more (a page of OCR, a
chat generation) is *long*; how long work shares the workers with short
work is ``long_work``:

- ``steps`` (the default): a batch computes only while it holds one of
  ``num_workers`` compute slots (``scheduling/slot.py``). Short batches are
  granted first: one that finds every slot held, some by long batches, takes
  one beyond them. While a long batch that has waited out its share (*owed*)
  holds one, a short batch takes one beyond it only once *overdue*: it has
  waited ``run``'s ``wait_limit_s`` (a share of its requests' tightest
  latency target, ``step.py``). An overdue batch also takes a slot beyond
  the short batches that hold every slot, up to ``num_workers`` beyond
  (``OVERDUE_BEYOND_PER_WORKER``), unless an owed long batch waits for the
  next one: short work with a target waits for a slot about its limit at
  most, and the operating system shares the cores among the batches, as
  among one process per model. The short batches' threads have room for
  those, and for batches waiting for a slot (``WAITING_THREADS``): a
  waiting batch holds a thread, and a batch with a tight target must reach
  the slots to become overdue, not queue behind it for a thread. A batch
  waiting for a slot wakes at its overdue time to be granted then, not at
  another batch's next call. Long
  batches compute a step at a time, and at each step boundary
  (``step.step_boundary``: a decode step, OCR's detection and each
  recognition batch) one gives its slot up while batches hold more slots
  than there are, and waits until one is free. On the CPU their threads run
  at a lower priority (``LONG_WORK_NICE``), so that a short batch sharing a
  core with a long one until its next step has that core at once. A long
  batch's run time leaves out its waits at boundaries. Long batches run on
  threads of their own (a paused one holds its thread, not a slot).
- ``lane``: long batches run in a lane of ``num_workers`` more threads and
  the operating system shares the cores between them and the short ones, as
  it would between one process per model: short batches never wait for a
  long one, but run slower beside it (the cores are oversubscribed).

Memory measurements need quiet: ``measure_exclusive`` waits until no loud
batch runs and holds new loud ones back while it measures a load. A batch is
*quiet* when it is predicted short and its reserved activation bytes are
known and at most ``QUIET_BYTES``: its bytes blur a measurement by no more
than that, and it runs on. Holding every batch back stopped the server for a
whole cold start: each first load waited for the OCR pages and chat answers
running to end while every embedding queued behind it (``mixed-zipf``: a
resident model's requests waited up to 12 s in the first 20 s). A batch's own
activation peak is measured only when it runs alone from start to end: no
other batch and no load begins meanwhile (their bytes would blur it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tessera.device import Device
from tessera.runtimes.forward import DEFAULT_STACK
from tessera.runtimes.memory import Measured, measure_rss, start_peak
from tessera.scheduling.slot import ComputeSlots, SlotClaim
from tessera.step import stepping

LONG_WORK_MODES = ("steps", "lane")
# How much nicer long batches' threads are than the process on the CPU
# (long_work: steps): a short batch's thread then has about 90% of a core it
# shares with one (the kernel's weights for nice 0 and 10: 1024 and 110).
LONG_WORK_NICE = 10
# Slots overdue short batches may take beyond the short batches that hold
# every slot, per worker (``scheduling/slot.py``): as many again. An overdue
# batch has waited a quarter of its latency target; the cores are then shared
# among at most twice as many batches, each slower, rather than one waiting a
# whole batch of another model's (on the CPU's two slots a TTS batch of
# ~120 ms and a chat of ~175 ms held both, and MiniLM batches with 200 ms
# targets missed them).
OVERDUE_BEYOND_PER_WORKER = 1
# Threads for short batches beyond those computing: a batch waiting for a slot
# holds one (not a core), and a batch queued for a thread cannot become
# overdue. Each model has at most ``num_workers`` batches in flight; threads
# start as work comes.
WAITING_THREADS = 32
# The most activation bytes a batch may reserve and still run beside a load's
# measurement (a quiet batch: see the module notes).
QUIET_BYTES = 8 * 2**20

# Batches at once on a CUDA device where the config names no figure: one
# launches while another is prepared or finished. More threads launching
# kernels contend for the interpreter lock, and a device runs one stream's
# kernels in order anyway.
CUDA_WORKERS = 2
# Threads for batches that may run in one forward with other models' (a
# model's ``stacks_across_models``, ``runtimes/stacking.py``): two rounds of
# ``stack: true`` (a round's batches hold their threads until its vectors are
# back, while the next round gathers). A round is led by one of them; the
# others wait for it off the interpreter lock.
ACROSS_MODELS_THREADS = 2 * DEFAULT_STACK

log = logging.getLogger(__name__)


def default_workers(device: Device, num_threads: int) -> int:
    """Batches at once where the config names no figure: one a thread on the
    CPU (each with its share of the cores), ``CUDA_WORKERS`` on a GPU."""
    if device.kind == "cuda":
        return min(CUDA_WORKERS, num_threads)
    return num_threads


@dataclass(frozen=True, slots=True)
class BatchRun:
    outputs: list[Any]
    run_s: float  # computing: the seconds it waited at step boundaries are not counted
    peak_bytes: int | None  # activation peak above the level before the batch
    # The device-seconds the engine that ran it reported, for a model whose
    # batches run on another machine (``runtimes.base.RemoteModel``): there
    # ``run_s`` is a wait for that engine, not device time.
    reported_s: float | None = None

    @property
    def device_s(self) -> float:
        """The device time it cost (``tessera.costs``): what its engine
        reported where it ran elsewhere, else its measured run."""
        return self.reported_s if self.reported_s is not None else self.run_s


class ComputeExecutor:
    def __init__(
        self,
        device: Device,
        num_threads: int,
        num_workers: int,
        long_batch_s: float | None = None,
        long_work: str = "steps",
        across_models_threads: int = ACROSS_MODELS_THREADS,
    ) -> None:
        if num_workers < 1 or num_threads < 1 or across_models_threads < 1:
            raise ValueError("num_threads, num_workers and across_models_threads must be >= 1")
        if long_work not in LONG_WORK_MODES:
            raise ValueError(f"long_work must be one of {LONG_WORK_MODES}, not {long_work!r}")
        self.device = device
        self.num_workers = num_workers
        self.num_threads = num_threads
        self.threads_per_worker = max(1, num_threads // num_workers)
        self.long_batch_s = long_batch_s
        self.long_work = long_work
        stepped = long_batch_s is not None and long_work == "steps"
        overdue_beyond = OVERDUE_BEYOND_PER_WORKER * num_workers
        # Short batches. Without compute slots its threads are the bound: one a
        # worker. With them, the slots bound what computes, and the threads
        # are for those (overdue ones beyond every slot included) and those
        # waiting for a slot (module notes).
        self._pool = ThreadPoolExecutor(
            num_workers + overdue_beyond + WAITING_THREADS if stepped else num_workers,
            thread_name_prefix="tessera-compute",
        )
        # In steps, long batches' threads on the CPU run at a lower priority.
        lower = long_work == "steps" and device.kind == "cpu"
        self._long_pool = (
            ThreadPoolExecutor(
                num_workers,
                thread_name_prefix="tessera-long",
                initializer=_lower_priority if lower else None,
            )
            if long_batch_s is not None
            else None
        )
        # Parts of large requests (``run``'s ``bulk``) that are not long: long
        # work to the compute slots, so short batches step past them, on
        # threads of the process's own priority (a niced thread holding the
        # interpreter lock when the kernel passes it over stalls every other).
        self._bulk_pool = (
            ThreadPoolExecutor(num_workers, thread_name_prefix="tessera-bulk")
            if long_batch_s is not None
            else None
        )
        # Batches that may run with other models' (``run``'s ``across_models``);
        # its threads start as work comes.
        self._across_pool = ThreadPoolExecutor(
            across_models_threads, thread_name_prefix="tessera-across"
        )
        # Compute slots (long_work: steps): guarded by _cond, as the counts below.
        self._slots = (
            ComputeSlots(num_workers, long_batch_s, overdue_beyond=overdue_beyond)
            if stepped and long_batch_s is not None
            else None
        )
        self._cond = threading.Condition()
        self._active = 0
        self._loading = 0
        # Counts batch and load starts: a measured batch whose count moved while
        # it ran shared the process with other work, and its peak is discarded.
        self._starts = 0
        self._exclusive = False
        self._exclusive_waiting = 0
        self._active_loud = 0  # running batches that are not quiet

    @property
    def num_yields(self) -> int:
        """Compute slots long batches gave up at step boundaries so far."""
        return self._slots.num_yields if self._slots is not None else 0

    @property
    def num_waiting(self) -> int:
        """Batches waiting for a compute slot now (at their start or at a boundary)."""
        with self._cond:
            return self._slots.num_waiting if self._slots is not None else 0

    async def run(
        self,
        fn: Callable[[Sequence[Any]], list[Any]],
        items: Sequence[Any],
        expected_s: float | None = None,
        activation_bytes: int | None = None,
        *,
        across_models: bool = False,
        bulk: bool = False,
        wait_limit_s: float | None = None,
    ) -> BatchRun:
        """Run ``fn(items)`` on a worker; ``expected_s``, the predicted run time,
        makes it long when it is at least ``long_batch_s``; with
        ``activation_bytes`` (what it reserved) it may be quiet.
        ``across_models``: a batch that may run in one forward with other
        models' (``runtimes/stacking.py``); unless long, it runs on one of
        ``across_models_threads`` threads of its own, without a compute slot
        (a round's batches wait for its one leader, which computes for them).
        ``bulk``: parts of large requests, long work to the compute slots
        whatever their length (short batches step past them).
        ``wait_limit_s``: a short batch that waits that long for a compute
        slot is overdue, and owed long work no longer holds it back
        (``scheduling/slot.py``; None: it waits as long as the rules say)."""
        pool = self._pool
        predicted_long = (
            self.long_batch_s is not None
            and expected_s is not None
            and expected_s >= self.long_batch_s
        )
        long = predicted_long or (bulk and self.long_batch_s is not None)
        if predicted_long and self._long_pool is not None:
            pool = self._long_pool
        elif long and self._bulk_pool is not None:
            pool = self._bulk_pool
        elif across_models and not long:
            pool = self._across_pool
        slotless = pool is self._across_pool
        loop = asyncio.get_running_loop()
        quiet = self._quiet(expected_s, activation_bytes)
        return await loop.run_in_executor(
            pool,
            self._run_sync,
            fn,
            items,
            expected_s,
            quiet and not long,
            slotless,
            long,
            wait_limit_s,
        )

    def _quiet(self, expected_s: float | None, activation_bytes: int | None) -> bool:
        """Whether a batch may run beside a load's measurement (module notes)."""
        return (
            self.long_batch_s is not None
            and expected_s is not None
            and expected_s < self.long_batch_s
            and activation_bytes is not None
            and 0 < activation_bytes <= QUIET_BYTES
        )

    def _run_sync(
        self,
        fn: Callable[[Sequence[Any]], list[Any]],
        items: Sequence[Any],
        expected_s: float | None,
        quiet: bool = False,
        slotless: bool = False,
        long: bool = False,
        wait_limit_s: float | None = None,
    ) -> BatchRun:
        with self._cond:
            while not quiet and (self._exclusive or self._exclusive_waiting):
                self._cond.wait()
            self._active += 1
            self._active_loud += not quiet
            self._starts += 1
            started = self._starts
            alone = self._active == 1 and self._loading == 0
        hook: _SlotHook | None = None
        try:
            hook = None if slotless else self._take_slot(expected_s, long, wait_limit_s)
            measure = self._start_peak() if alone else None
            start = time.perf_counter()
            with stepping(hook) if hook is not None else contextlib.nullcontext():
                outputs = fn(items)
            run_s = time.perf_counter() - start - (hook.paused_s if hook is not None else 0.0)
            peak = measure() if measure is not None else None
            if peak is not None and self._starts != started:
                peak = None  # another batch or a load began meanwhile: its bytes, not ours
            return BatchRun(outputs, run_s, peak)
        except BaseException as e:
            if self.device.kind == "cuda" and type(e).__name__ == "OutOfMemoryError":
                import torch

                # The allocator's cached blocks go back before the engine retries in halves.
                torch.cuda.empty_cache()
            raise
        finally:
            with self._cond:
                if hook is not None:
                    hook.release()
                self._active -= 1
                self._active_loud -= not quiet
                self._cond.notify_all()

    def _take_slot(
        self, expected_s: float | None, long: bool, wait_limit_s: float | None = None
    ) -> _SlotHook | None:
        """Wait for a compute slot for a batch about to run (``long``: as long
        work; ``wait_limit_s``: overdue after that long); its hook for the
        batch's step boundaries (None: no slots, ``long_work: lane``)."""
        if self._slots is None:
            return None
        with self._cond:
            claim = self._slots.claim(
                expected_s, time.monotonic(), long=long, wait_limit_s=wait_limit_s
            )
            _wait_for_slot(self._cond, self._slots, claim)
        return _SlotHook(self._cond, self._slots, claim)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Held while a model loads: batches that overlap it are not measured."""
        with self._cond:
            self._loading += 1
            self._starts += 1
        try:
            yield
        finally:
            with self._cond:
                self._loading -= 1

    def _start_peak(self) -> Callable[[], int] | None:
        """Start measuring a batch's peak: the call returned reads it."""
        if self.device.kind == "cuda":
            import torch

            index = self.device.index

            def allocated(which: str) -> int:
                # The allocator's nested stats: ``memory_allocated`` and
                # ``max_memory_allocated`` each flatten and sort all of them
                # in Python, twice a batch that runs alone (every batch at c=1).
                # (Empty before CUDA is initialised: then 0, as theirs.)
                stats = torch.cuda.memory_stats_as_nested_dict(index)
                return int(stats.get("allocated_bytes", {}).get("all", {}).get(which, 0))

            torch.cuda.reset_peak_memory_stats(index)
            before = allocated("current")
            return lambda: max(0, allocated("peak") - before)
        return start_peak()

    def measure_exclusive(self, fn: Callable[[], Any]) -> Measured:
        """Run ``fn`` (in the calling thread) while no loud batch runs, and measure it."""
        with self._cond:
            self._exclusive_waiting += 1
            while self._active_loud or self._exclusive:
                self._cond.wait()
            self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            if self.device.kind == "cuda":
                return self._measure_cuda(fn)
            return measure_rss(fn)
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    def _measure_cuda(self, fn: Callable[[], Any]) -> Measured:
        import torch

        index = self.device.index
        free_before, _ = torch.cuda.mem_get_info(index)
        torch.cuda.reset_peak_memory_stats(index)
        allocated = int(torch.cuda.memory_allocated(index))
        value = fn()
        free_after, _ = torch.cuda.mem_get_info(index)
        peak = int(torch.cuda.max_memory_allocated(index)) - allocated
        # The card's free bytes see allocations outside torch; torch's own count
        # sees tensors placed in blocks its cache held already (an eviction's).
        grown = int(torch.cuda.memory_allocated(index)) - allocated
        return Measured(value, max(0, int(free_before - free_after), grown), max(0, peak))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._across_pool.shutdown(wait=True, cancel_futures=True)
        for pool in (self._long_pool, self._bulk_pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)


def _wait_for_slot(cond: threading.Condition, slots: ComputeSlots, claim: SlotClaim) -> None:
    """Wait (holding ``cond``, which guards the slots) until ``claim`` holds a slot:
    every grant comes with a claim, a release, a boundary or a suspension,
    each of which notifies ``cond``, or with a claim falling overdue: a claim
    with a wait limit waits until its overdue time at most, then ticks the
    slots (which may grant it, or another) and notifies ``cond`` for a grant.
    From then on any call grants it where the rules allow: it waits as any."""
    ticked = False
    while not claim.holding:
        overdue_at = claim.overdue_at
        if overdue_at is None or ticked:
            cond.wait()
            continue
        now = time.monotonic()
        if now < overdue_at:
            cond.wait(overdue_at - now)
            continue
        ticked = True
        grants = slots.num_grants
        slots.tick(now)
        if slots.num_grants != grants:
            cond.notify_all()


def _lower_priority() -> None:
    """Run this thread (a long batch's) LONG_WORK_NICE nicer than it was (at most
    19): the kernel then gives a short batch that shares a core with it that
    core at once, and the long batch whatever short ones leave (Linux: a
    thread's own nice value)."""
    try:
        thread = threading.get_native_id()
        nice = min(19, os.getpriority(os.PRIO_PROCESS, thread) + LONG_WORK_NICE)
        os.setpriority(os.PRIO_PROCESS, thread, nice)
    except (AttributeError, OSError) as e:  # not Linux, or not allowed: the same priority
        log.debug("long work runs at the usual priority: %s", e)


class _SlotHook:
    """A batch's step hook (``step.StepHook``): gives its compute slot up where
    the slots say so, and counts the seconds it waited for one again, which
    are not its run time."""

    def __init__(self, cond: threading.Condition, slots: ComputeSlots, claim: SlotClaim) -> None:
        self._cond = cond
        self._slots = slots
        self._claim = claim
        self.paused_s = 0.0

    def boundary(self) -> None:
        with self._cond:
            begun = time.monotonic()
            grants = self._slots.num_grants
            stepped_aside = self._slots.boundary(self._claim, begun)
            if self._slots.num_grants != grants:
                self._cond.notify_all()  # a waiting batch got a slot
            if not stepped_aside:
                return
            _wait_for_slot(self._cond, self._slots, self._claim)
            self.paused_s += time.monotonic() - begun

    def release(self) -> None:
        """The batch has ended (called holding ``cond``)."""
        self._slots.release(self._claim, time.monotonic())

    @contextlib.contextmanager
    def blocked(self) -> Iterator[None]:
        with self._cond:
            begun = time.monotonic()
            self._slots.suspend(self._claim, begun)
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._slots.resume(self._claim, time.monotonic())
                _wait_for_slot(self._cond, self._slots, self._claim)
                self.paused_s += time.monotonic() - begun
