"""One model's batcher: the single owner of that model's queue, and the
policy that forms its batches.

It runs nothing: its driver (the engine's loop, ``engine/step.py``) asks it
for the next batch (``next_batch``), runs it, and reports its end
(``finished``). Between the two the batch holds a slot.

Invariant: a batch is formed only when an execution slot is free (at
most ``max_concurrent_batches`` run at once: the spec's, else the caller's),
so requests that arrive while the model is busy join the next batch instead
of waiting behind many small ones. A batch closes when it is full
(``max_batch_size`` items or ``max_batch_units`` work units), or when its
oldest request has waited ``max_wait_ms`` and it has *gathered*: no other
batch of the model is running, or it holds at least as many items as the
largest one running, or the oldest running batch is halfway through a typical
batch's run time (a moving average of the model's measured ones). So while a
batch runs, the next one gathers the arrivals (as continuous batching does)
and starts in time to overlap it: at moderate load batches alternate at
similar sizes instead of a free slot taking fragments of one or two requests,
and every slot stays busy. The extra wait is at most half a batch. On a GPU
(``gather_idle`` false) a partial batch of a model with nothing running
closes at once: a small encoder's batch of 1 there costs what one of 32 does
(its kernel launches), so waiting for company buys only latency. While it
runs, the next batch gathers as above. Requests whose
caller has gone or whose deadline passed are dropped before the batch is
formed; the deadline ones fail with 504.

A tenant never waits for a slot that other tenants' work holds
(``step_past``): while every slot is busy, a request of a tenant none of
whose requests run now starts a batch beyond the slots (of such tenants'
requests only; at most ``num_slots`` beyond). The compute executor then
shares the cores between the batches, short work first (long work and parts
of large requests step aside), so a tenant's wait is bounded by a part of
work, not by whatever another tenant's requests hold. The engine turns it
off for a FIFO queue (no fairness) and where the card fixes
``max_concurrent_batches`` for a runtime that cannot take more batches at
once (an external engine's window has room for them).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from typing import TYPE_CHECKING

from tessera.batching.queue import FifoQueue, RequestQueue
from tessera.clock import Clock
from tessera.errors import DeadlineExceededError, OverloadedError
from tessera.repository.spec import BatchingSpec
from tessera.request import Batch, QueuedRequest

if TYPE_CHECKING:
    from tessera.scheduling.predictor import BatchTimePredictor

# Weight of the newest run in the moving average of a model's batch run times.
BATCH_S_WEIGHT = 0.2
# Measured batches of a model before its predicted wait may refuse a request.
MIN_SAMPLES = 8


class ModelBatcher:
    def __init__(
        self,
        name: str,
        batching: BatchingSpec,
        clock: Clock,
        *,
        max_queue: int = 100,
        queue: RequestQueue | None = None,
        max_concurrent_batches: int = 1,
        predictor: BatchTimePredictor | None = None,
        gather_idle: bool = True,
        step_past: bool = False,
    ) -> None:
        self.name = name
        self.gather_idle = gather_idle  # false: with nothing running, close at once
        self.batching = batching
        self._clock = clock
        self.max_queue = max_queue
        self._queue: RequestQueue = queue if queue is not None else FifoQueue()
        self._arrived = asyncio.Event()
        self.num_slots = batching.max_concurrent_batches or max_concurrent_batches
        # Batches beyond the slots for tenants with nothing running (module notes).
        self.step_past = step_past
        self._num_in_slots = 0
        self._num_beyond = 0
        self.num_stepped_past = 0  # batches started beyond the slots so far
        self._predictor = predictor
        # Batches formed and not yet finished, by ``id``; those beyond the slots.
        self._running: dict[int, Batch] = {}
        self._beyond: set[int] = set()
        # Each running batch's predicted seconds, made once: summing a batch's
        # units at every submit would cost O(batch) per request.
        self._running_s: dict[int, float] = {}
        self._batch_s: float | None = None  # moving average of batch run times
        self.num_batches = 0
        self.num_dropped = 0
        # Of those dropped, how many of each model (``QueuedRequest.model``):
        # an encoder group's queue holds several models' requests.
        self.dropped_by_model: Counter[str] = Counter()

    @property
    def depth(self) -> int:
        return len(self._queue)

    def depth_by_model(self) -> Counter[str]:
        """The requests waiting, by model (a pass over the queue)."""
        return Counter(request.model for request in self._queue)

    def submit(self, request: QueuedRequest, *, counted: bool = True) -> None:
        """Queue a request; ``OverloadedError`` if the queue is full: it holds
        ``max_queue`` requests (``counted`` false: not asked, for a part of a
        request whose first part was), or more work than ``request`` could
        wait for (its batch would start after its deadline)."""
        if counted and len(self._queue) >= self.max_queue:
            raise OverloadedError(
                f"queue of model {self.name!r} is full ({self.max_queue} requests)",
                retry_after_s=self._retry_after_s(),
            )
        left_s = None if request.deadline is None else request.deadline - request.arrival
        wait_s = self.predicted_wait_s(request, fits_s=left_s)
        if wait_s is not None and left_s is not None and wait_s > left_s:
            raise OverloadedError(
                f"model {self.name!r} has {wait_s:.3g}s of work before this request,"
                f" more than its {left_s:.3g}s deadline",
                retry_after_s=max(self._retry_after_s(), wait_s - left_s),
            )
        self._queue.push(request)
        self._arrived.set()

    def next_batch_units(self) -> float | None:
        """The work units of the batch the queue would give now (its requests
        in the queue's order, within the batch's limits: an estimate where a
        fair queue takes tenants in turn); None when nothing waits."""
        if not len(self._queue):
            return None
        max_items, max_units = self.batching.max_batch_size, self.batching.max_batch_units
        items, units = 0, 0.0
        for request in self._queue:  # as the queues' pop_batch takes them
            if items and not request.fits(items, units, max_items, max_units):
                break
            items += len(request.items)
            units += request.units
        return units

    def predicted_wait_s(self, request: QueuedRequest, fits_s: float | None = None) -> float | None:
        """Seconds before ``request``'s batch would start if it were queued now:
        what is left of the batches running now (at most their predicted run)
        and the full batches of the work ahead of it (batches of its kind:
        ``max_batch_size`` items like it, at most ``max_batch_units``; the rest
        of that work shares its batch), at the predicted run times, over the
        batches that run at once. None while the model's batch times are not
        known well enough (``MIN_SAMPLES`` measured batches): refusing on a
        guess would turn requests away that would have been answered. With
        ``fits_s``, a wait that fits within it may be figured from all the work
        queued (no more than ``fits_s`` either way; ``units_ahead``'s bound):
        the count of a fair queue's work ahead scans every backlogged tenant."""
        predictor = self._predictor
        if predictor is None or predictor.num_samples < MIN_SAMPLES:
            return None
        per_item = request.units / max(1, len(request.items))
        batch_units = max(
            request.units,
            min(self.batching.max_batch_units, per_item * self.batching.max_batch_size),
        )
        now = self._clock.now()
        running_s = 0.0
        for key, batch in self._running.items():
            run_s = self._running_s.get(key)
            if run_s is None:
                units = sum(r.units for r in batch.requests)
                run_s = self._running_s[key] = predictor.predict(units) or 0.0
            running_s += max(0.0, batch.formed_at + run_s - now)
        per_batch_s = predictor.predict(batch_units) or 0.0
        enough = 0.0  # units ahead below which the wait fits ``fits_s`` (none: count them)
        spare_s = None if fits_s is None else fits_s * self.num_slots - running_s
        if spare_s is not None and spare_s >= 0:
            fitting = math.floor(spare_s / per_batch_s) if per_batch_s > 0 else math.inf
            enough = (fitting + 1) * batch_units
        full = math.floor(self._queue.units_ahead(request, enough) / batch_units)
        return (running_s + full * per_batch_s) / self.num_slots

    def _retry_after_s(self) -> float:
        return max(1.0, self.batching.max_wait_ms / 1000)

    def close(self) -> None:
        """Fail what still waits (the batches running are their driver's)."""
        for request in self._queue.remove_if(lambda r: True):
            if not request.gone:
                request.future.set_exception(OverloadedError("server is shutting down", 1.0))

    async def next_batch(self) -> Batch:
        """The next batch to run, once a slot is free for it (or a tenant with
        nothing running may step past the slots); it holds its slot until
        ``finished``."""
        batch, beyond = await self._next_batch()
        key = id(batch)
        self._running[key] = batch
        if beyond:
            self._beyond.add(key)
            self._num_beyond += 1
            self.num_stepped_past += 1
        else:
            self._num_in_slots += 1
        self.num_batches += 1
        return batch

    def finished(self, batch: Batch) -> None:
        """``batch`` (from ``next_batch``) ended: its slot is free, and its run
        time joins the moving average."""
        key = id(batch)
        del self._running[key]
        self._running_s.pop(key, None)
        if key in self._beyond:
            self._beyond.discard(key)
            self._num_beyond -= 1
        else:
            self._num_in_slots -= 1
        run_s = self._clock.now() - batch.formed_at
        average = self._batch_s
        self._batch_s = run_s if average is None else average + BATCH_S_WEIGHT * (run_s - average)
        self._arrived.set()  # a gathering batch may close now

    async def _wait_arrival(self, within_s: float | None) -> None:
        """Wait for an arrival, a running batch's end, or ``within_s`` seconds:
        a timer that sets the arrival event (the caller checks again either
        way), no task of its own: a wait costs one timer, whatever the number
        of models waiting."""
        self._arrived.clear()
        timer = (
            self._clock.call_later(within_s, self._arrived.set) if within_s is not None else None
        )
        try:
            await self._arrived.wait()
        finally:
            if timer is not None:
                timer.cancel()

    def _drop_stale(self) -> None:
        now = self._clock.now()
        for request in self._queue.remove_if(lambda r: r.gone or r.expired(now)):
            self.num_dropped += 1
            self.dropped_by_model[request.model] += 1
            if not request.gone:
                request.future.set_exception(
                    DeadlineExceededError(
                        f"deadline passed after {now - request.arrival:.3f}s in the queue"
                    )
                )

    def _queued(self) -> tuple[int, float]:
        items, units = 0, 0.0
        for request in self._queue:
            items += len(request.items)
            units += request.units
        return items, units

    def _full(self, items: int, units: float) -> bool:
        return items >= self.batching.max_batch_size or units >= self.batching.max_batch_units

    def _gathered(self, items: int) -> bool:
        """Whether a partial batch of ``items`` may close: nothing of the model
        runs, it is as large as the largest batch running, or it is time to
        overlap the oldest one (``_overlap_in_s``)."""
        running = max((b.num_items for b in self._running.values()), default=0)
        if items >= min(running, self.batching.max_batch_size):
            return True
        overlap_in = self._overlap_in_s()
        return overlap_in is not None and overlap_in <= 0

    def _max_wait_s(self, units: float) -> float:
        """How long a partial batch of ``units`` may wait to gather: the card's
        ``max_wait_ms``, but no longer than the batch is predicted to run (once
        the model's batch times are known). Waiting longer than the device
        takes to run what waits cannot pay: what arrives meanwhile gathers for
        the next batch while this one runs."""
        wait = self.batching.max_wait_ms / 1000
        predictor = self._predictor
        if predictor is None or predictor.num_samples < MIN_SAMPLES:
            return wait
        predicted = predictor.predict(units)
        return wait if predicted is None else max(0.0, min(wait, predicted))

    def _overlap_in_s(self) -> float | None:
        """Seconds until the oldest running batch is halfway through a typical
        run; None while nothing runs or no run time is known yet."""
        if self._batch_s is None or not self._running:
            return None
        oldest = min(b.formed_at for b in self._running.values())
        return oldest + self._batch_s / 2 - self._clock.now()

    def _past_batch(self) -> Batch | None:
        """While every slot is busy: a batch of the tenants none of whose
        requests run now, if one waits and fewer than ``num_slots`` run beyond."""
        if not self.step_past or self._num_beyond >= self.num_slots:
            return None
        running = frozenset(r.tenant for b in self._running.values() for r in b.requests)
        if not self._queue.has_other_than(running):
            return None
        self._drop_stale()
        now = self._clock.now()
        requests = self._queue.pop_batch(
            self.batching.max_batch_size, self.batching.max_batch_units, now, skip=running
        )
        return Batch(requests, now) if requests else None

    async def _next_batch(self) -> tuple[Batch, bool]:
        """The next batch to run, and whether it runs beyond the slots."""
        while True:
            if self._num_in_slots >= self.num_slots:
                past = self._past_batch()
                if past is not None:
                    return past, True
                await self._wait_arrival(None)  # an arrival, or a batch's end
                continue
            self._drop_stale()
            oldest = self._queue.oldest_arrival()
            if oldest is None:
                await self._wait_arrival(None)
                continue
            items, units = self._queued()
            remaining = oldest + self._max_wait_s(units) - self._clock.now()
            idle = not self.gather_idle and not self._running
            if self._full(items, units) or ((remaining <= 0 or idle) and self._gathered(items)):
                now = self._clock.now()
                requests = self._queue.pop_batch(
                    self.batching.max_batch_size, self.batching.max_batch_units, now
                )
                if requests:
                    return Batch(requests, now), False
                continue
            # Past its wait, a batch that has not gathered waits for an arrival,
            # a running batch to end (``finished``) or the time to overlap it.
            await self._wait_arrival(remaining if remaining > 0 else self._overlap_in_s())
