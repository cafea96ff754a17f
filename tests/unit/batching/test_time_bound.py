"""Queues bounded by time, not count: a request is refused (503, Retry-After from
the prediction) only when the work queued before it, at the model's measured
batch times, would pass its deadline; the work before it is its place in the
queue's own order (FIFO: everything; fair: what the weights serve first)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tessera.batching import FifoQueue
from tessera.batching.batcher import MIN_SAMPLES
from tessera.clock import FakeClock
from tessera.errors import OverloadedError
from tessera.repository.spec import BatchingSpec
from tessera.request import Batch, QueuedRequest, RequestResult
from tessera.scheduling import BatchTimePredictor, FairQueue

from .driven import DrivenBatcher


def request(
    *, tenant: str = "t", units: float = 1.0, items: int = 1, weight: float = 1.0,
    deadline: float | None = None,
) -> QueuedRequest:  # fmt: skip
    future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
    return QueuedRequest(
        items=list(range(items)),
        units=units,
        arrival=0.0,
        future=future,
        tenant=tenant,
        weight=weight,
        deadline=deadline,
    )


async def test_fifo_work_ahead_is_everything_queued() -> None:
    queue = FifoQueue()
    assert queue.units_ahead(request()) == 0
    for units in (3.0, 4.0, 5.0):
        queue.push(request(units=units))
    assert queue.units_ahead(request()) == 12
    queue.pop_batch(max_items=1, max_units=100, now=0.0)
    assert queue.units_ahead(request()) == 9
    queue.remove_if(lambda r: r.units == 4.0)
    assert queue.units_ahead(request()) == 5
    queue.pop_batch(max_items=10, max_units=100, now=0.0)
    assert queue.units_ahead(request()) == 0


async def test_under_fair_queueing_a_quiet_tenant_waits_behind_a_share_not_the_flood() -> None:
    queue = FairQueue()
    for _ in range(100):
        queue.push(request(tenant="flood", units=10.0))
    # The flood's next request waits behind its whole backlog ...
    assert queue.units_ahead(request(tenant="flood", units=10.0)) == 1000
    # ... a newcomer behind none of it: it is lifted to the flood's counter.
    assert queue.units_ahead(request(tenant="quiet", units=10.0)) == 0
    queue.push(request(tenant="quiet", units=10.0))
    queue.push(request(tenant="quiet", units=10.0))
    # Its third waits for its own two and as much of the flood as they took.
    assert queue.units_ahead(request(tenant="quiet", units=10.0)) == 20 + 20


async def test_weights_set_how_much_of_the_others_goes_first() -> None:
    queue = FairQueue()
    for _ in range(10):
        queue.push(request(tenant="light", units=1.0, weight=1.0))
    for _ in range(10):
        queue.push(request(tenant="heavy", units=1.0, weight=4.0))
    # Behind heavy's 10 units (2.5 of its virtual time), light gets 2.5 units.
    assert queue.units_ahead(request(tenant="heavy", weight=4.0)) == pytest.approx(12.5)
    # Behind light's 10 units (10 of its virtual time), heavy is served out.
    assert queue.units_ahead(request(tenant="light")) == 20


def measured(units: float, seconds: float, times: int = MIN_SAMPLES) -> BatchTimePredictor:
    """A model's predictor after ``times`` batches of ``units`` that took ``seconds``."""
    predictor = BatchTimePredictor()
    for _ in range(times):
        predictor.observe(units, seconds)
    return predictor


async def answer(batch: Batch) -> None:
    for r in batch.requests:
        r.future.set_result(RequestResult(r.items, 0.0, 0.0, batch.num_items))


async def close(b: DrivenBatcher, requests: list[QueuedRequest]) -> None:
    """Stop ``b`` (what still waits is refused) and read every outcome."""
    await b.stop()
    for r in requests:
        r.future.exception()


def batcher(
    predictor: BatchTimePredictor, *, max_queue: int = 1000, slots: int = 1
) -> DrivenBatcher:
    return DrivenBatcher(
        "m",
        BatchingSpec(max_batch_size=10, max_batch_units=1000, max_wait_ms=1.0),
        answer,
        FakeClock(),
        max_queue=max_queue,
        queue=FifoQueue(),
        max_concurrent_batches=slots,
        predictor=predictor,
    )


async def test_a_request_is_refused_only_when_its_predicted_wait_passes_its_deadline() -> None:
    b = batcher(measured(10, 1.0))  # a batch of 10 units: 1 s
    # 95 queued (1 unit each): 9 full batches of 10 before its own, 9 s.
    queued = [request(deadline=60.0) for _ in range(95)]
    for r in queued:
        b.submit(r)
    assert b.predicted_wait_s(request(deadline=60.0)) == pytest.approx(9.0)
    queued.append(request(deadline=9.0))
    b.submit(queued[-1])  # exactly fits
    with pytest.raises(OverloadedError, match="more than its 5s deadline") as refused:
        b.submit(request(deadline=5.0))
    assert refused.value.retry_after_s == pytest.approx(4.0)  # when it would fit again
    await close(b, queued)


async def test_more_slots_drain_the_queue_sooner() -> None:
    predictor = measured(10, 1.0)
    one, two = batcher(predictor), batcher(predictor, slots=2)
    queued = {one: [request() for _ in range(39)], two: [request() for _ in range(39)]}
    for b, requests in queued.items():
        for r in requests:
            b.submit(r)
    assert one.predicted_wait_s(request()) == pytest.approx(3.0)
    assert two.predicted_wait_s(request()) == pytest.approx(1.5)
    for b, requests in queued.items():
        await close(b, requests)


async def test_a_running_batch_counts_what_is_left_of_its_own_run() -> None:
    release = asyncio.Event()

    async def held(batch: Batch) -> None:
        await release.wait()
        await answer(batch)

    clock = FakeClock(autojump=False)
    b = DrivenBatcher(
        "m",
        BatchingSpec(max_batch_size=10, max_batch_units=1000, max_wait_ms=0.0),
        held,
        clock,
        predictor=measured(10, 1.0),  # 0.1 s a unit
    )
    first = request()
    b.submit(first)
    for _ in range(5):  # the loop forms the batch and starts it
        await asyncio.sleep(0)
    # One unit runs: 0.1 s of it, not a full batch's second.
    assert b.predicted_wait_s(request()) == pytest.approx(0.1)
    clock.advance(0.06)
    assert b.predicted_wait_s(request()) == pytest.approx(0.04)
    release.set()
    await first.future
    await close(b, [first])


async def test_before_enough_measured_batches_only_the_count_bounds_the_queue() -> None:
    assert batcher(measured(10, 100.0, times=MIN_SAMPLES - 1)).predicted_wait_s(request()) is None
    b = batcher(BatchTimePredictor(), max_queue=3)
    queued = [request(deadline=0.001) for _ in range(3)]
    for r in queued:
        b.submit(r)
    with pytest.raises(OverloadedError, match="is full"):
        b.submit(request(deadline=60.0))
    await close(b, queued)


async def test_many_waiting_on_a_fast_model_are_not_an_overload() -> None:
    predictor = measured(32, 0.003)  # 32 sentences in 3 ms, a GPU's pace
    b = DrivenBatcher(
        "m",
        BatchingSpec(max_batch_size=32, max_wait_ms=1.0),
        answer,
        FakeClock(),
        max_queue=1000,
        predictor=predictor,
    )
    queued = [request(deadline=1.0) for _ in range(256)]
    for r in queued:  # c=256: 8 batches, 24 ms of work
        b.submit(r)
    assert b.depth == 256
    wait_s: Any = b.predicted_wait_s(request())
    assert wait_s < 0.05
    await close(b, queued)


async def test_a_fair_queue_counts_the_work_ahead_only_where_the_whole_queue_is_too_much() -> None:
    # A flood of 100 batches' work (1 s a batch): a quiet tenant's request with
    # a 5 s deadline waits for none of it (lifted to the flood's counter), so
    # it is admitted though the whole queue would take 100 s; the flood's next
    # is refused, its Retry-After from its own backlog.
    b = DrivenBatcher(
        "m",
        BatchingSpec(max_batch_size=10, max_batch_units=1000, max_wait_ms=1.0),
        answer,
        FakeClock(),
        max_queue=1000,
        queue=FairQueue(),
        predictor=measured(10.0, 1.0),
    )
    flood = [request(tenant="flood", units=10.0) for _ in range(100)]
    for r in flood:
        b.submit(r)
    quiet = request(tenant="quiet", units=10.0, deadline=5.0)
    assert b.predicted_wait_s(quiet, fits_s=5.0) == 0.0
    b.submit(quiet)
    late = request(tenant="flood", units=10.0, deadline=5.0)
    with pytest.raises(OverloadedError) as refused:
        b.submit(late)
    assert refused.value.retry_after_s == pytest.approx(95.0)
    # Where the whole queue fits, its total (10 batches of 10 s) stands for
    # the count ahead, which is none for a newcomer.
    other = request(tenant="other", units=10.0)
    assert b.predicted_wait_s(other) == 0.0
    assert b.predicted_wait_s(other, fits_s=1000.0) == 100.0
    await close(b, [*flood, quiet])
