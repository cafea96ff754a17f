"""Queues bounded by time, not count: a request is refused (503, Retry-After from
the prediction) only when the work queued before it, at the model's measured
batch times, would pass its deadline; the work before it is its place in the
queue's own order (FIFO: everything; fair: what the weights serve first)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tessera.batching import FifoQueue, ModelBatcher, RequestQueue
from tessera.batching.batcher import MIN_SAMPLES
from tessera.clock import FakeClock
from tessera.errors import OverloadedError
from tessera.repository.spec import BatchingSpec
from tessera.request import Batch, QueuedRequest, RequestResult
from tessera.scheduling import BatchTimePredictor, FairQueue

from .driven import DrivenBatcher


def request(
    *, tenant: str = "t", units: float = 1.0, items: int = 1, weight: float = 1.0,
    deadline: float | None = None, arrival: float = 0.0,
) -> QueuedRequest:  # fmt: skip
    future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
    return QueuedRequest(
        items=list(range(items)),
        units=units,
        arrival=arrival,
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


def held_batcher(
    predictor: BatchTimePredictor,
    *,
    clock: FakeClock | None = None,
    queue: RequestQueue | None = None,
    slots: int = 1,
) -> ModelBatcher:
    """A batcher with no loop around it: the test takes its batches (``next_batch``)
    and they run until it reports their end."""
    return ModelBatcher(
        "m",
        BatchingSpec(max_batch_size=8, max_batch_units=1000, max_wait_ms=0.0),
        clock or FakeClock(autojump=False),
        max_queue=1000,
        queue=queue if queue is not None else FifoQueue(),
        max_concurrent_batches=slots,
        predictor=predictor,
    )


async def test_a_request_of_several_items_waits_for_full_batches_of_its_kind() -> None:
    b = batcher(measured(10, 1.0))  # 0.1 s a unit; batches of 10 items
    queued = [request(units=2.0) for _ in range(50)]  # 100 units
    for r in queued:
        b.submit(r)
    # Two items of 2 units each: a batch of 10 items is 20 units, 2 s; 5 of them ahead.
    assert b.predicted_wait_s(request(units=4.0, items=2)) == pytest.approx(10.0)
    await close(b, queued)


async def test_the_batches_running_on_every_slot_count_what_is_left_of_each() -> None:
    clock = FakeClock(autojump=False)
    b = held_batcher(measured(8, 1.0), clock=clock, slots=2)  # 0.125 s a unit
    for _ in range(8):
        b.submit(request())
    await b.next_batch()  # 8 units: 1 s, from 0
    clock.advance(0.5)
    for _ in range(8):
        b.submit(request())
    await b.next_batch()  # 1 s, from 0.5
    # 0.5 s left of the first and 1 s of the second, over two slots.
    assert b.predicted_wait_s(request()) == pytest.approx(0.75)


async def test_a_running_batchs_predicted_run_is_made_once() -> None:
    predictor = measured(8, 1.0)
    b = held_batcher(predictor)
    for _ in range(8):
        b.submit(request())
    await b.next_batch()
    assert b.predicted_wait_s(request()) == pytest.approx(1.0)
    for _ in range(MIN_SAMPLES):  # the model slows down: 8 units now predicted at 2 s
        predictor.observe(8, 3.0)
    assert predictor.predict(8) == pytest.approx(2.0)
    # The running batch keeps the run it was predicted when first asked.
    assert b.predicted_wait_s(request()) == pytest.approx(1.0)


async def test_a_model_measured_at_no_time_predicts_no_wait_and_refuses_no_deadline() -> None:
    b = held_batcher(measured(8, 0.0))
    for _ in range(8):
        b.submit(request())
    await b.next_batch()
    queued = [request(deadline=0.001) for _ in range(40)]
    for r in queued:  # five batches of 8, each of no time
        b.submit(r)
    assert b.depth == 40
    assert b.predicted_wait_s(request(), fits_s=0.001) == 0.0
    assert b.predicted_wait_s(request()) == 0.0


async def test_a_deadline_counts_from_the_requests_arrival() -> None:
    clock = FakeClock(start=100.0)
    b = ModelBatcher(
        "m",
        BatchingSpec(max_batch_size=10, max_batch_units=1000, max_wait_ms=1.0),
        clock,
        max_queue=1000,
        predictor=measured(10, 1.0),
    )

    def arrived_now(deadline_in_s: float) -> QueuedRequest:
        return request(arrival=clock.now(), deadline=clock.now() + deadline_in_s)

    # At 100 s, a deadline 8 s away leaves 8 s (not 108): 9 batches of 1 s do not fit.
    for _ in range(90):
        b.submit(arrived_now(60.0))
    b.submit(arrived_now(9.0))
    with pytest.raises(OverloadedError, match="more than its 8s deadline"):
        b.submit(arrived_now(8.0))
    assert b.depth == 91


class BoundRecorder(FifoQueue):
    """A FIFO queue that records the ``enough`` each count of the work ahead is given."""

    def __init__(self) -> None:
        super().__init__()
        self.enough: list[float] = []

    def units_ahead(self, request: QueuedRequest, enough: float = 0.0) -> float:
        self.enough.append(enough)
        return super().units_ahead(request, enough)


async def test_submit_lets_the_queue_give_its_whole_work_where_that_fits_the_deadline() -> None:
    queue = BoundRecorder()
    b = held_batcher(measured(8, 1.0), queue=queue)  # a batch of 8 units: 1 s
    b.submit(request())
    assert queue.enough == [0.0]  # no deadline: the work ahead is counted
    b.submit(request(deadline=5.0))
    # Up to 5 batches ahead fit its 5 s: under 6 batches' units the total will do.
    assert queue.enough[-1] == pytest.approx(48.0)


def fair_flood(num: int, *, slots: int = 1) -> ModelBatcher:
    """A fair queue holding ``num`` requests of one tenant, 1/16 of a unit each;
    a batch of 8 (0.5 units) runs 0.5 s. A newcomer waits behind none of them."""
    b = held_batcher(measured(0.5, 0.5), queue=FairQueue(), slots=slots)
    for _ in range(num):
        b.submit(request(tenant="flood", units=1 / 16))
    return b


async def test_the_whole_fair_queue_counts_as_work_ahead_exactly_where_its_wait_fits() -> None:
    newcomer = request(tenant="other", units=1 / 16)
    b = fair_flood(8)  # one batch queued
    assert b.predicted_wait_s(newcomer) == 0.0
    assert b.predicted_wait_s(newcomer, fits_s=0.5) == 0.5  # the whole queue fits
    assert b.predicted_wait_s(newcomer, fits_s=0.49) == 0.0  # it does not: counted, none
    for _ in range(72):  # ten batches queued
        b.submit(request(tenant="flood", units=1 / 16))
    assert b.predicted_wait_s(newcomer, fits_s=5.0) == 5.0
    assert b.predicted_wait_s(newcomer, fits_s=4.99) == 0.0


async def test_the_whole_fair_queue_counts_as_work_ahead_where_it_fits_every_slot() -> None:
    newcomer = request(tenant="other", units=1 / 16)
    b = fair_flood(80, slots=2)  # ten batches queued, two at a time: 2.5 s
    assert b.predicted_wait_s(newcomer, fits_s=2.5) == 2.5
    assert b.predicted_wait_s(newcomer, fits_s=2.49) == 0.0


async def test_the_whole_fair_queue_counts_as_work_ahead_where_it_fits_behind_a_run() -> None:
    newcomer = request(tenant="other", units=1 / 16)
    b = fair_flood(88)
    await b.next_batch()  # 0.5 s running; ten batches queued behind it
    assert b.predicted_wait_s(newcomer, fits_s=5.5) == 5.5
    assert b.predicted_wait_s(newcomer, fits_s=5.0) == 0.5  # the rest is counted
