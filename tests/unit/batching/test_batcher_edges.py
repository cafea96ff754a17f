"""The batcher and the FIFO queue at their edges, on a fake clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tessera.batching import FifoQueue, ModelBatcher, QueuePolicyName, make_queue
from tessera.clock import FakeClock
from tessera.errors import DeadlineExceededError, OverloadedError
from tessera.repository.spec import BatchingSpec
from tessera.request import Batch, QueuedRequest, RequestResult
from tessera.scheduling import BatchTimePredictor, FairQueue

from .driven import DrivenBatcher


class Recorder:
    """An execute function that records each batch and answers it, once its gate opens."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.gate: asyncio.Event | None = None
        self.running = 0
        self.max_running = 0

    async def __call__(self, batch: Batch) -> None:
        self.batches.append(batch)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.running -= 1
        for request in batch.requests:
            if not request.future.done():
                request.future.set_result(RequestResult(request.items, 0.0, 0.0, batch.num_items))


def make_request(
    clock: FakeClock, items: list[Any], *, units: float | None = None, **kw: Any
) -> QueuedRequest:
    future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
    return QueuedRequest(
        items=items,
        units=float(len(items)) if units is None else units,
        arrival=clock.now(),
        future=future,
        **kw,
    )


def make_batcher(
    clock: FakeClock, recorder: Recorder, *, max_queue: int = 100, slots: int = 1, **batching: Any
) -> DrivenBatcher:
    spec = BatchingSpec(**{"max_batch_size": 8, "max_wait_ms": 10.0, **batching})
    return DrivenBatcher(
        "m", spec, recorder, clock, max_queue=max_queue, max_concurrent_batches=slots
    )


async def spin(times: int = 5) -> None:
    for _ in range(times):
        await asyncio.sleep(0)


# -- the queue bound -------------------------------------------------------------


async def test_queue_holds_exactly_max_queue_requests() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_queue=3, max_wait_ms=3000.0)
    for i in range(3):
        batcher.submit(make_request(clock, [i]))
    assert batcher.depth == 3
    with pytest.raises(OverloadedError) as info:
        batcher.submit(make_request(clock, [3]))
    assert info.value.retry_after_s == 3.0  # one max wait, when above a second
    assert "model 'm'" in str(info.value)
    assert "(3 requests)" in str(info.value)
    await batcher.stop()


async def test_retry_after_is_at_least_a_second() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_queue=0, max_wait_ms=10.0)
    with pytest.raises(OverloadedError) as info:
        batcher.submit(make_request(clock, ["x"]))
    assert info.value.retry_after_s == 1.0
    await batcher.stop()


async def test_defaults_queue_100_requests_and_run_one_batch_at_a_time() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = DrivenBatcher("m", BatchingSpec(max_batch_size=1, max_wait_ms=0.0), recorder, clock)
    requests = [make_request(clock, [i]) for i in range(100)]
    for request in requests:
        batcher.submit(request)
    with pytest.raises(OverloadedError, match="100 requests"):
        batcher.submit(make_request(clock, ["over"]))
    await spin(10)
    assert len(recorder.batches) == 1  # one slot: the others wait
    recorder.gate.set()
    await asyncio.gather(*(r.future for r in requests))
    assert recorder.max_running == 1
    await batcher.stop()


async def test_the_given_queue_is_the_one_drawn_from() -> None:
    clock, recorder = FakeClock(), Recorder()
    queue = FairQueue()
    batcher = DrivenBatcher("m", BatchingSpec(max_wait_ms=1000.0), recorder, clock, queue=queue)
    request = make_request(clock, ["a"])
    batcher.submit(request)
    assert list(queue) == [request]
    await batcher.stop()


async def test_the_queue_is_given_the_clocks_time() -> None:
    # A fair queue with a latency tier reads ``now`` for the remaining budgets.
    clock, recorder = FakeClock(start=100.0), Recorder()
    queue = FairQueue(BatchTimePredictor())
    batcher = DrivenBatcher("m", BatchingSpec(max_wait_ms=10.0), recorder, clock, queue=queue)
    request = make_request(clock, ["vip"], latency_target_s=0.5)
    batcher.submit(request)
    assert (await clock.wait_for(request.future, 1.0)).outputs == ["vip"]
    assert recorder.batches[0].formed_at == pytest.approx(100.01)
    await batcher.stop()


async def test_a_part_not_counted_joins_a_full_queue_and_a_request_does_not() -> None:
    # The engine's own call: no loop around the batcher, ``counted`` as it defaults.
    clock = FakeClock()
    batcher = ModelBatcher("m", BatchingSpec(), clock, max_queue=2)
    for i in range(2):
        batcher.submit(make_request(clock, [i]))
    with pytest.raises(OverloadedError, match="is full"):
        batcher.submit(make_request(clock, ["over"]))
    batcher.submit(make_request(clock, ["part"]), counted=False)
    assert batcher.depth == 3
    batcher.close()


async def test_the_requests_waiting_are_counted_by_model() -> None:
    clock = FakeClock()
    batcher = ModelBatcher("group", BatchingSpec(), clock)
    for model in ("a", "b", "a"):
        batcher.submit(make_request(clock, [model], model=model))
    assert batcher.depth_by_model() == {"a": 2, "b": 1}
    batcher.close()


# -- when a batch closes ---------------------------------------------------------


async def test_batch_closes_at_its_units_limit_without_waiting() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_batch_size=100, max_batch_units=6.0)
    requests = [make_request(clock, [i], units=3.0) for i in range(2)]
    for request in requests:
        batcher.submit(request)
    await asyncio.gather(*(r.future for r in requests))
    assert clock.now() == 0.0
    assert [len(b.requests) for b in recorder.batches] == [2]
    await batcher.stop()


async def test_batch_closes_at_its_size_limit_counting_items_not_requests() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_batch_size=4, max_wait_ms=1000.0)
    requests = [make_request(clock, [i, i]) for i in range(2)]
    for request in requests:
        batcher.submit(request)
    await asyncio.gather(*(r.future for r in requests))
    assert clock.now() == 0.0
    assert recorder.batches[0].num_items == 4
    await batcher.stop()


@pytest.mark.parametrize(
    ("limits", "units"), [({"max_batch_size": 3}, None), ({"max_batch_units": 3.0}, 1.0)]
)
async def test_batch_one_short_of_a_limit_waits_its_max_wait(
    limits: dict[str, Any], units: float | None
) -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_wait_ms=50.0, **limits)
    requests = [make_request(clock, [i], units=units) for i in range(2)]
    for request in requests:
        batcher.submit(request)
    await asyncio.gather(*(r.future for r in requests))
    assert recorder.batches[0].formed_at == pytest.approx(0.05)
    await batcher.stop()


async def test_partial_batch_waits_from_its_oldest_request() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_wait_ms=40.0)
    first = make_request(clock, ["a"])
    batcher.submit(first)
    await spin()
    clock.advance(0.03)
    second = make_request(clock, ["b"])
    batcher.submit(second)
    await asyncio.gather(first.future, second.future)
    assert recorder.batches[0].formed_at == pytest.approx(0.04)  # not 0.07
    assert recorder.batches[0].requests == [first, second]
    assert batcher.num_batches == 1
    await batcher.stop()


async def test_request_that_waited_its_max_wait_runs_at_once() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_wait_ms=20.0)
    request = make_request(clock, ["a"])
    clock.advance(0.02)  # it arrived 20 ms ago
    batcher.submit(request)
    await request.future
    assert recorder.batches[0].formed_at == pytest.approx(0.02)
    await batcher.stop()


async def test_spec_concurrency_wins_over_the_callers() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_batcher(clock, recorder, slots=1, max_batch_size=1, max_concurrent_batches=2)
    requests = [make_request(clock, [i]) for i in range(3)]
    for request in requests:
        batcher.submit(request)
    await spin(10)
    assert len(recorder.batches) == 2  # two slots: two batches run, the third waits
    recorder.gate.set()
    await asyncio.gather(*(r.future for r in requests))
    assert recorder.max_running == 2
    assert batcher.num_batches == 3
    await batcher.stop()


async def test_callers_concurrency_applies_when_the_spec_gives_none() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_batcher(clock, recorder, slots=3, max_batch_size=1)
    requests = [make_request(clock, [i]) for i in range(4)]
    for request in requests:
        batcher.submit(request)
    await spin(10)
    assert len(recorder.batches) == 3
    recorder.gate.set()
    await asyncio.gather(*(r.future for r in requests))
    await batcher.stop()


async def test_one_slot_runs_its_batches_one_after_another() -> None:
    clock = FakeClock()
    formed: list[float] = []

    async def one_second(batch: Batch) -> None:
        formed.append(batch.formed_at)
        await clock.sleep(1.0)
        for request in batch.requests:
            request.future.set_result(RequestResult(request.items, 0.0, 0.0, batch.num_items))

    spec = BatchingSpec(max_batch_size=1, max_wait_ms=0.0)
    batcher = DrivenBatcher("m", spec, one_second, clock)
    requests = [make_request(clock, [i]) for i in range(3)]
    for request in requests:
        batcher.submit(request)
    await clock.wait_for(asyncio.gather(*(r.future for r in requests)), 10.0)
    assert formed == [0.0, 1.0, 2.0]
    await batcher.stop()


async def test_a_finished_batch_is_forgotten() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_batch_size=1, max_wait_ms=0.0)
    requests = [make_request(clock, [i]) for i in range(3)]
    for request in requests:
        batcher.submit(request)
    await asyncio.gather(*(r.future for r in requests))
    await spin()
    assert batcher._running == {}  # no task object kept per batch served
    await batcher.stop()


async def test_a_finished_batch_leaves_neither_its_predicted_run_nor_its_place_beyond() -> None:
    # Both are kept by the batch's id, which a later batch may be given.
    clock, predictor = FakeClock(), BatchTimePredictor()
    for _ in range(8):
        predictor.observe(1.0, 0.1)
    spec = BatchingSpec(max_batch_size=1, max_wait_ms=0.0)
    batcher = ModelBatcher("m", spec, clock, queue=FairQueue(), predictor=predictor, step_past=True)
    for tenant in ("a", "b"):
        batcher.submit(make_request(clock, [tenant], tenant=tenant))
    in_slot, beyond = await batcher.next_batch(), await batcher.next_batch()
    assert batcher.num_stepped_past == 1
    assert batcher.predicted_wait_s(make_request(clock, ["c"])) == pytest.approx(0.2)
    batcher.finished(in_slot)
    batcher.finished(beyond)
    assert batcher._running_s == {}
    assert batcher._beyond == set()


async def test_a_gathering_batch_overlaps_at_half_the_moving_average_run() -> None:
    clock = FakeClock()
    formed: list[float] = []

    async def execute(batch: Batch) -> None:  # runs as many seconds as its first item
        formed.append(batch.formed_at)
        await clock.sleep(batch.requests[0].items[0])
        for request in batch.requests:
            request.future.set_result(RequestResult(request.items, 0.0, 0.0, batch.num_items))

    spec = BatchingSpec(max_batch_size=4, max_wait_ms=10.0)
    batcher = DrivenBatcher("m", spec, execute, clock, max_concurrent_batches=2)

    async def run(run_s: float, num: int) -> list[QueuedRequest]:
        requests = [make_request(clock, [run_s]) for _ in range(num)]
        for request in requests:
            batcher.submit(request)
        await clock.sleep(0.02)
        return requests

    full = await run(1.0, 4)  # 0 to 1 s
    lone = await run(1.0, 1)  # no run measured yet: it waits for the running one to end
    await clock.wait_for(asyncio.gather(*(r.future for r in full + lone)), 5.0)
    assert formed == [0.0, 1.0]
    await clock.wait_for(asyncio.gather(*(r.future for r in await run(3.0, 4))), 5.0)
    # Runs of 1, 1 and 3 s: a typical run is 1 + 0.2 x (3 - 1) = 1.4 s.
    started = clock.now()
    running = await run(10.0, 4)
    lone = await run(0.0, 1)
    await clock.wait_for(lone[0].future, 5.0)
    assert formed[-1] == pytest.approx(started + 0.7)
    await asyncio.gather(*(r.future for r in running))
    await batcher.stop()


# -- stale requests ---------------------------------------------------------------


async def test_deadline_is_passed_at_the_deadline_itself() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_wait_ms=50.0)
    late = make_request(clock, ["late"], deadline=0.05)  # the batch would form at 0.05
    kept = make_request(clock, ["kept"], deadline=0.051)
    batcher.submit(late)
    batcher.submit(kept)
    with pytest.raises(DeadlineExceededError, match=r"deadline passed after 0\.050s"):
        await late.future
    assert (await kept.future).outputs == ["kept"]
    assert batcher.num_dropped == 1
    assert [b.requests for b in recorder.batches] == [[kept]]
    await batcher.stop()


async def test_deadline_message_gives_the_time_spent_in_the_queue() -> None:
    clock, recorder = FakeClock(start=100.0), Recorder()
    batcher = make_batcher(clock, recorder, max_wait_ms=50.0)
    late = make_request(clock, ["late"], deadline=100.02)
    batcher.submit(late)
    with pytest.raises(DeadlineExceededError, match=r"after 0\.050s in the queue"):
        await late.future
    await batcher.stop()


async def test_dropped_requests_are_counted_by_model() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_wait_ms=10.0)
    gone = [make_request(clock, [m], model=m) for m in ("a", "b", "a")]
    for request in gone:
        batcher.submit(request)
        request.future.cancel()
    kept = make_request(clock, ["kept"], model="b")
    batcher.submit(kept)
    await kept.future
    assert batcher.num_dropped == 3
    assert batcher.dropped_by_model == {"a": 2, "b": 1}
    await batcher.stop()


async def test_all_gone_batch_forms_nothing_and_the_batcher_goes_on() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_wait_ms=10.0)
    gone = [make_request(clock, [i]) for i in range(3)]
    for request in gone:
        batcher.submit(request)
        request.future.cancel()
    await spin(10)
    assert batcher.num_dropped == 3
    assert recorder.batches == []
    later = make_request(clock, ["later"])
    batcher.submit(later)
    assert (await later.future).outputs == ["later"]
    await batcher.stop()


# -- close ---------------------------------------------------------------------


async def test_close_fails_what_waits_and_waits_for_what_runs() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_batcher(clock, recorder, max_batch_size=1, max_wait_ms=0.0)
    running = make_request(clock, ["running"])
    batcher.submit(running)
    await spin()
    waiting = make_request(clock, ["waiting"])
    gone = make_request(clock, ["gone"])
    batcher.submit(waiting)
    batcher.submit(gone)
    gone.future.cancel()
    closing = asyncio.ensure_future(batcher.stop())
    await spin()
    assert not closing.done()  # the running batch holds it
    with pytest.raises(OverloadedError) as info:
        await waiting.future
    assert str(info.value) == "server is shutting down"
    assert info.value.retry_after_s == 1.0
    assert gone.future.cancelled()
    recorder.gate.set()
    await closing
    assert (await running.future).outputs == ["running"]
    assert batcher.depth == 0
    await batcher.stop()  # twice is fine


async def test_close_waits_for_a_batch_that_fails_and_does_not_raise() -> None:
    clock, gate = FakeClock(), asyncio.Event()

    async def failing(batch: Batch) -> None:
        await gate.wait()
        raise RuntimeError("the batch failed")

    batcher = DrivenBatcher("m", BatchingSpec(max_batch_size=1, max_wait_ms=0.0), failing, clock)
    batcher.submit(make_request(clock, ["x"]))
    await spin()
    closing = asyncio.ensure_future(batcher.stop())
    await spin()
    assert not closing.done()
    gate.set()
    await closing  # the batch's error is its own, not close's


# -- FifoQueue and make_queue ----------------------------------------------------------


async def test_fifo_pop_batch_limits_and_order() -> None:
    clock = FakeClock()
    queue = FifoQueue()
    assert queue.oldest_arrival() is None
    assert queue.pop_batch(10, 100, now=0.0) == []
    requests = []
    for i in range(5):
        clock.advance(1.0)
        requests.append(make_request(clock, [i, i], units=3.0))
        queue.push(requests[-1])
    assert queue.oldest_arrival() == 1.0
    assert list(queue) == requests
    assert queue.pop_batch(4, 100, now=0.0) == requests[:2]  # 4 items exactly
    assert queue.pop_batch(100, 3, now=0.0) == requests[2:3]  # 3 units exactly
    assert queue.oldest_arrival() == 4.0
    assert queue.pop_batch(1, 1, now=0.0) == requests[3:4]  # over both, alone: whole
    assert len(queue) == 1
    more = [make_request(clock, [i], units=2.0) for i in range(3)]
    for request in more:
        queue.push(request)
    assert queue.pop_batch(100, 6, now=0.0) == [requests[4], more[0]]  # 3 + 2 units of 6
    assert queue.pop_batch(100, 4, now=0.0) == more[1:]  # 4 units exactly


async def test_fifo_remove_if() -> None:
    clock = FakeClock()
    queue = FifoQueue()
    requests = [make_request(clock, [i]) for i in range(4)]
    for request in requests:
        queue.push(request)
    assert queue.remove_if(lambda r: False) == []
    assert len(queue) == 4
    assert queue.remove_if(lambda r: r.items[0] % 2 == 1) == [requests[1], requests[3]]
    assert list(queue) == [requests[0], requests[2]]
    assert len(queue) == 2


async def test_make_queue_by_name() -> None:
    assert isinstance(make_queue("fifo"), FifoQueue)
    assert isinstance(make_queue(QueuePolicyName.FIFO), FifoQueue)
    predictor = BatchTimePredictor()
    fair = make_queue("fair", predictor, quantum_s=0.5)
    assert isinstance(fair, FairQueue)
    assert fair._predictor is predictor
    assert fair._quantum_s == 0.5
    with pytest.raises(ValueError, match="lifo"):
        make_queue("lifo")


async def test_fifo_pop_skipping_tenants_keeps_the_limits_and_the_count_of_work() -> None:
    clock = FakeClock()
    queue = FifoQueue()
    a0, a1 = (make_request(clock, ["a"], tenant="a", units=4.0) for _ in range(2))
    b0 = make_request(clock, ["b", "b"], tenant="b", units=1.5)
    c0 = make_request(clock, ["c"], tenant="c", units=1.5)
    b1 = make_request(clock, ["b"], tenant="b", units=1.0)
    c1 = make_request(clock, ["c", "c"], tenant="c", units=1.0)
    for request in (a0, b0, c0, a1, b1, c1):
        queue.push(request)
    skip = frozenset({"a"})
    # 2 + 1 + 1 items make 4; c1's two more would not fit.
    assert queue.pop_batch(4, 100.0, now=0.0, skip=skip) == [b0, c0, b1]
    assert list(queue) == [a0, a1, c1]
    assert queue.units_ahead(make_request(clock, ["x"])) == 9.0
    for request in (b0, c0, b1):
        queue.push(request)
    # 1 + 1.5 units; c0's 1.5 more would pass 3.
    assert queue.pop_batch(100, 3.0, now=0.0, skip=skip) == [c1, b0]
    assert list(queue) == [a0, a1, c0, b1]
    assert queue.units_ahead(make_request(clock, ["x"])) == 10.5


async def test_an_emptied_fifo_queue_counts_no_work_ahead_whatever_the_rounding() -> None:
    clock = FakeClock()
    queue = FifoQueue()
    for units in (0.1, 0.2, 0.3):  # 0.1 + 0.2 + 0.3 - 0.1 - (0.2 + 0.3) is not 0 in floats
        queue.push(make_request(clock, ["x"], units=units))
    queue.pop_batch(1, 100.0, now=0.0)
    queue.pop_batch(10, 100.0, now=0.0)
    assert queue.units_ahead(make_request(clock, ["x"])) == 0.0
