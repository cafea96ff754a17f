"""Per-model batching with a fake clock: limits, mixing callers, dropping the stale."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tessera.clock import FakeClock
from tessera.errors import DeadlineExceededError, OverloadedError
from tessera.repository.spec import BatchingSpec
from tessera.request import Batch, QueuedRequest, RequestResult
from tessera.scheduling import BatchTimePredictor

from .driven import DrivenBatcher


class Recorder:
    """An execute function that answers each item with (caller tag, item)."""

    def __init__(self) -> None:
        self.batches: list[list[QueuedRequest]] = []
        self.formed_at: list[float] = []
        self.gate: asyncio.Event | None = None
        self.clock: FakeClock | None = None
        self.run_s = 0.0  # fake seconds each batch takes (with ``clock``)

    async def __call__(self, batch: Batch) -> None:
        self.batches.append(batch.requests)
        self.formed_at.append(batch.formed_at)
        if self.gate is not None:
            await self.gate.wait()
        if self.clock is not None:
            await self.clock.sleep(self.run_s)
        for request in batch.requests:
            if not request.future.done():
                outputs = [(request.tenant, item) for item in request.items]
                queued_s = batch.formed_at - request.arrival
                request.future.set_result(RequestResult(outputs, queued_s, 0.0, batch.num_items))


def make_request(clock: FakeClock, items: list[Any], tenant: str = "t", **kw: Any) -> QueuedRequest:
    future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
    return QueuedRequest(
        items=items,
        units=float(len(items)),
        arrival=clock.now(),
        future=future,
        tenant=tenant,
        **kw,
    )


def make_batcher(
    clock: FakeClock, recorder: Recorder, max_queue: int = 100, **batching: Any
) -> DrivenBatcher:
    spec = BatchingSpec(**{"max_batch_size": 8, "max_wait_ms": 10.0, **batching})
    return DrivenBatcher("m", spec, recorder, clock, max_queue=max_queue)


async def test_batch_mixes_callers_and_each_gets_its_own_results() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder)
    requests = [make_request(clock, [f"{t}{i}" for i in range(2)], tenant=t) for t in "abc"]
    for request in requests:
        batcher.submit(request)
    results = await asyncio.gather(*(r.future for r in requests))
    assert len(recorder.batches) == 1
    for tenant, result in zip("abc", results, strict=True):
        assert result.outputs == [(tenant, f"{tenant}0"), (tenant, f"{tenant}1")]
    await batcher.stop()


async def test_batches_respect_max_batch_size_and_units() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_batch_size=4, max_batch_units=100)
    requests = [make_request(clock, [i, i]) for i in range(5)]  # 10 items
    for request in requests:
        batcher.submit(request)
    await asyncio.gather(*(r.future for r in requests))
    sizes = [sum(len(r.items) for r in batch) for batch in recorder.batches]
    assert sizes == [4, 4, 2]
    await batcher.stop()

    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_batch_size=100, max_batch_units=3)
    requests = [make_request(clock, [i, i]) for i in range(3)]  # 2 units each
    for request in requests:
        batcher.submit(request)
    await asyncio.gather(*(r.future for r in requests))
    assert [len(batch) for batch in recorder.batches] == [1, 1, 1]
    await batcher.stop()


async def test_the_next_batchs_units_are_those_the_queue_would_give() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()  # the first batch runs until the gate opens
    batcher = make_batcher(clock, recorder, max_batch_size=4, max_batch_units=100)
    assert batcher.next_batch_units() is None
    first = make_request(clock, [0])
    batcher.submit(first)
    await clock.sleep(0.02)  # it runs, alone
    queued = [make_request(clock, [i, i]) for i in range(3)]  # 2 items and 2 units each
    for request in queued:
        batcher.submit(request)
    assert batcher.next_batch_units() == 4.0  # two requests fit a batch of 4 items
    recorder.gate.set()
    await asyncio.gather(first.future, *(r.future for r in queued))
    assert batcher.next_batch_units() is None
    await batcher.stop()


async def test_partial_batch_waits_max_wait_then_runs() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_wait_ms=50.0)
    request = make_request(clock, ["x"])
    batcher.submit(request)
    await request.future
    # The fake clock moved by the wait, no more.
    assert clock.now() == pytest.approx(0.05)
    assert recorder.formed_at == [pytest.approx(0.05)]
    await batcher.stop()


async def test_full_batch_does_not_wait() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_batch_size=2, max_wait_ms=1000.0)
    requests = [make_request(clock, ["a"]), make_request(clock, ["b"])]
    for request in requests:
        batcher.submit(request)
    await asyncio.gather(*(r.future for r in requests))
    assert clock.now() == 0.0
    await batcher.stop()


async def test_requests_of_gone_callers_are_dropped_before_running() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_wait_ms=10.0)
    gone = make_request(clock, ["gone"])
    kept = make_request(clock, ["kept"])
    batcher.submit(gone)
    batcher.submit(kept)
    gone.future.cancel()
    assert (await kept.future).outputs == [("t", "kept")]
    assert [r.items for batch in recorder.batches for r in batch] == [["kept"]]
    assert batcher.num_dropped == 1
    await batcher.stop()


async def test_expired_requests_fail_with_deadline_error() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_batcher(clock, recorder, max_wait_ms=100.0)
    late = make_request(clock, ["late"], deadline=0.05)
    batcher.submit(late)
    with pytest.raises(DeadlineExceededError):
        await late.future
    assert recorder.batches == []
    await batcher.stop()


async def test_full_queue_refuses_with_retry_after() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_batcher(clock, recorder, max_queue=2, max_batch_size=1)
    first = make_request(clock, ["running"])
    batcher.submit(first)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(recorder.batches) == 1  # running, out of the queue
    batcher.submit(make_request(clock, ["q1"]))
    batcher.submit(make_request(clock, ["q2"]))
    with pytest.raises(OverloadedError) as info:
        batcher.submit(make_request(clock, ["q3"]))
    assert info.value.retry_after_s >= 1
    recorder.gate.set()
    await batcher.stop()


async def test_next_batch_forms_only_when_a_slot_frees() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_batcher(clock, recorder, max_batch_size=8, max_wait_ms=0.0)
    first = make_request(clock, ["a"])
    batcher.submit(first)
    for _ in range(3):
        await asyncio.sleep(0)
    later = [make_request(clock, [i]) for i in range(5)]
    for request in later:
        batcher.submit(request)
    recorder.gate.set()
    await asyncio.gather(first.future, *(r.future for r in later))
    # The five that arrived while the model was busy ran together.
    assert [len(batch) for batch in recorder.batches] == [1, 5]
    await batcher.stop()


def make_two_slot_batcher(
    clock: FakeClock, recorder: Recorder, *, gather_idle: bool = True
) -> DrivenBatcher:
    spec = BatchingSpec(max_batch_size=8, max_wait_ms=10.0)
    return DrivenBatcher(
        "m", spec, recorder, clock, max_concurrent_batches=2, gather_idle=gather_idle
    )


async def test_while_a_batch_runs_the_next_gathers_to_its_size() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_two_slot_batcher(clock, recorder)
    running = [make_request(clock, [f"r{i}"]) for i in range(4)]
    for request in running:
        batcher.submit(request)
    await clock.sleep(0.02)  # the first batch (4 items) formed and runs, held by the gate
    assert [len(b) for b in recorder.batches] == [4]
    later = [make_request(clock, [f"l{i}"]) for i in range(4)]
    batcher.submit(later[0])
    await clock.sleep(1.0)  # far past max_wait: one request alone does not close
    assert [len(b) for b in recorder.batches] == [4]
    for request in later[1:]:
        batcher.submit(request)
    await clock.sleep(0.02)  # as many as the running batch: it closes, on the free slot
    assert [len(b) for b in recorder.batches] == [4, 4]
    recorder.gate.set()
    await asyncio.gather(*(r.future for r in running + later))
    await batcher.stop()


async def test_a_gathering_batch_closes_when_the_running_one_ends() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_two_slot_batcher(clock, recorder)
    running = [make_request(clock, [f"r{i}"]) for i in range(4)]
    for request in running:
        batcher.submit(request)
    await clock.sleep(0.02)
    lone = make_request(clock, ["lone"])
    batcher.submit(lone)
    await clock.sleep(1.0)
    assert [len(b) for b in recorder.batches] == [4]
    recorder.gate.set()  # the running batch ends: nothing else runs, the lone one goes
    await lone.future
    assert [len(b) for b in recorder.batches] == [4, 1]
    await batcher.stop()


async def test_with_nothing_running_a_partial_batch_closes_after_max_wait() -> None:
    clock, recorder = FakeClock(), Recorder()
    batcher = make_two_slot_batcher(clock, recorder)
    lone = make_request(clock, ["lone"])
    batcher.submit(lone)
    await lone.future
    assert recorder.formed_at == [pytest.approx(0.01)]
    await batcher.stop()


async def test_on_a_gpu_an_idle_models_partial_batch_closes_at_once_and_the_next_gathers() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_two_slot_batcher(clock, recorder, gather_idle=False)
    lone = make_request(clock, ["lone"])
    batcher.submit(lone)
    await clock.sleep(0.001)
    assert recorder.formed_at == [0.0]  # nothing of the model ran: no wait for company
    later = [make_request(clock, [f"l{i}"]) for i in range(3)]
    for request in later:
        batcher.submit(request)
    await clock.sleep(0.005)  # one runs: the next gathers, as on a CPU
    assert len(recorder.batches) == 1
    await clock.sleep(0.01)  # past max_wait, as large as the running one: it closes
    assert [len(b) for b in recorder.batches] == [1, 3]
    recorder.gate.set()
    await asyncio.gather(lone.future, *(r.future for r in later))
    await batcher.stop()


async def test_a_partial_batch_waits_no_longer_than_it_is_predicted_to_run() -> None:
    clock, recorder = FakeClock(), Recorder()
    predictor = BatchTimePredictor()
    for units in (1.0, 2.0, 4.0, 8.0) * 2:  # 1 ms a batch, whatever its size
        predictor.observe(units, 0.001)
    spec = BatchingSpec(max_batch_size=8, max_wait_ms=50.0)
    batcher = DrivenBatcher("m", spec, recorder, clock, predictor=predictor)
    lone = make_request(clock, ["lone"])
    batcher.submit(lone)
    await lone.future
    assert recorder.formed_at == [pytest.approx(0.001)]  # not the card's 50 ms
    await batcher.stop()


async def test_a_gathering_batch_starts_halfway_through_a_typical_run() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.clock, recorder.run_s = clock, 1.0
    batcher = make_two_slot_batcher(clock, recorder)
    first = [make_request(clock, [f"f{i}"]) for i in range(4)]
    for request in first:
        batcher.submit(request)
    await asyncio.gather(*(r.future for r in first))  # a batch takes 1 s: now known
    running = [make_request(clock, [f"r{i}"]) for i in range(4)]
    for request in running:
        batcher.submit(request)
    await clock.sleep(0.02)
    started = recorder.formed_at[-1]
    lone = make_request(clock, ["lone"])
    batcher.submit(lone)
    await lone.future
    # It did not wait for the running batch to end (1 s) nor for 4 items: it
    # started halfway through, to overlap it on the other slot.
    assert recorder.formed_at[-1] == pytest.approx(started + 0.5)
    await asyncio.gather(*(r.future for r in running))
    await batcher.stop()
