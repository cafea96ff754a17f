"""A tenant with nothing running steps past a model's busy slots (``step_past``)."""

from __future__ import annotations

import asyncio
from typing import Any

from tessera.batching.queue import FifoQueue
from tessera.clock import FakeClock
from tessera.repository.spec import BatchingSpec
from tessera.request import Batch, QueuedRequest, RequestResult
from tessera.scheduling.fair import FairQueue

from .driven import DrivenBatcher
from .test_batcher import Recorder, make_request


def make_past_batcher(
    clock: FakeClock, recorder: Recorder, *, step_past: bool = True, **batching: object
) -> DrivenBatcher:
    spec = BatchingSpec(**{"max_batch_size": 8, "max_wait_ms": 0.0, **batching})  # type: ignore[arg-type]
    return DrivenBatcher(
        "m",
        spec,
        recorder,
        clock,
        queue=FairQueue(),
        max_concurrent_batches=2,
        step_past=step_past,
    )


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def fill_slots(clock: FakeClock, batcher: DrivenBatcher, tenant: str) -> list[QueuedRequest]:
    """Two batches of ``tenant`` holding both slots, and one more of it queued."""
    held = []
    for i in range(3):
        request = make_request(clock, [f"{tenant}{i}"], tenant=tenant)
        batcher.submit(request)
        held.append(request)
        await settle()
    return held


async def test_a_tenant_with_nothing_running_starts_a_batch_beyond_busy_slots() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_past_batcher(clock, recorder)
    flood = await fill_slots(clock, batcher, "flood")
    assert [r[0].tenant for r in recorder.batches] == ["flood", "flood"]  # the third waits
    quiet = make_request(clock, ["q"], tenant="quiet")
    batcher.submit(quiet)
    await settle()
    # The quiet tenant's batch started while both slots still ran the flood's,
    # of its own requests only; the flood's third request still waits.
    assert [[r.tenant for r in b] for b in recorder.batches] == [["flood"], ["flood"], ["quiet"]]
    assert batcher.num_stepped_past == 1
    assert batcher.depth == 1
    recorder.gate.set()
    await asyncio.gather(*(r.future for r in [*flood, quiet]))
    await batcher.stop()


async def test_a_tenant_already_running_waits_for_a_slot() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_past_batcher(clock, recorder)
    flood = await fill_slots(clock, batcher, "flood")
    more = make_request(clock, ["f9"], tenant="flood")
    batcher.submit(more)
    await settle()
    assert len(recorder.batches) == 2
    assert batcher.num_stepped_past == 0
    recorder.gate.set()
    await asyncio.gather(*(r.future for r in [*flood, more]))
    await batcher.stop()


async def test_at_most_num_slots_batches_run_beyond() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_past_batcher(clock, recorder)
    flood = await fill_slots(clock, batcher, "flood")
    others = [make_request(clock, [t], tenant=t) for t in ("a", "b", "c")]
    for request in others:
        batcher.submit(request)
        await settle()
    assert batcher.num_stepped_past == 2  # a and b beyond the two slots; c waits
    assert batcher.depth == 2  # the flood's third and c
    recorder.gate.set()
    await asyncio.gather(*(r.future for r in [*flood, *others]))
    await batcher.stop()


async def test_no_batch_beyond_while_step_past_is_off() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_past_batcher(clock, recorder, step_past=False)
    flood = await fill_slots(clock, batcher, "flood")
    quiet = make_request(clock, ["q"], tenant="quiet")
    batcher.submit(quiet)
    await settle()
    assert len(recorder.batches) == 2
    assert batcher.num_stepped_past == 0
    recorder.gate.set()
    await asyncio.gather(*(r.future for r in [*flood, quiet]))
    await batcher.stop()


async def test_queues_pop_only_tenants_not_skipped_in_their_order() -> None:
    clock = FakeClock()
    for queue in (FairQueue(), FifoQueue()):
        requests = [
            make_request(clock, [f"{t}{i}"], tenant=t) for i in range(2) for t in ("a", "b", "c")
        ]
        for request in requests:
            queue.push(request)
        assert queue.has_other_than(frozenset({"a", "b"}))
        assert not queue.has_other_than(frozenset({"a", "b", "c"}))
        batch = queue.pop_batch(8, 100.0, clock.now(), skip=frozenset({"a"}))
        assert {r.tenant for r in batch} == {"b", "c"}
        assert len(batch) == 4
        assert len(queue) == 2
        assert [r.tenant for r in queue.pop_batch(8, 100.0, clock.now())] == ["a", "a"]
        assert queue.pop_batch(8, 100.0, clock.now(), skip=frozenset({"a"})) == []


class HeldByTenant:
    """An execute function that holds each batch until its first tenant's gate opens."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gates: dict[str, asyncio.Event] = {}

    def open(self, tenant: str) -> None:
        self.gates.setdefault(tenant, asyncio.Event()).set()

    async def __call__(self, batch: Batch) -> None:
        self.batches.append([r.tenant for r in batch.requests])
        await self.gates.setdefault(batch.requests[0].tenant, asyncio.Event()).wait()
        for request in batch.requests:
            request.future.set_result(RequestResult(request.items, 0.0, 0.0, batch.num_items))


def one_slot_batcher(held: HeldByTenant, **kw: Any) -> DrivenBatcher:
    spec = BatchingSpec(max_batch_size=8, max_wait_ms=0.0)
    return DrivenBatcher("m", spec, held, FakeClock(), queue=FairQueue(), **kw)


async def test_a_batcher_steps_past_its_slots_only_when_asked() -> None:
    held = HeldByTenant()
    batcher = one_slot_batcher(held)
    flood = make_request(FakeClock(), ["f"], tenant="flood")
    batcher.submit(flood)
    await settle()
    quiet = make_request(FakeClock(), ["q"], tenant="quiet")
    batcher.submit(quiet)
    await settle()
    assert held.batches == [["flood"]]
    held.open("quiet")
    held.open("flood")
    await asyncio.gather(flood.future, quiet.future)
    assert held.batches == [["flood"], ["quiet"]]
    assert batcher.num_stepped_past == 0
    await batcher.stop()


async def test_a_batch_beyond_the_slots_that_ends_makes_room_for_one_more_beyond() -> None:
    clock, held = FakeClock(), HeldByTenant()
    batcher = one_slot_batcher(held, step_past=True)
    flood = [make_request(clock, [f"f{i}"], tenant="flood") for i in range(2)]
    for request in flood:  # the first holds the slot, the second waits for it
        batcher.submit(request)
        await settle()
    first = make_request(clock, ["a"], tenant="a")
    batcher.submit(first)
    await settle()
    held.open("a")  # it ends; the flood's batch still holds the slot
    await first.future
    others = [make_request(clock, [t], tenant=t) for t in ("b", "c")]
    for request in others:
        batcher.submit(request)
        await settle()
    # One batch beyond the one slot again: b's; c and the flood's second wait.
    assert held.batches == [["flood"], ["a"], ["b"]]
    assert batcher.num_stepped_past == 2
    assert batcher.depth == 2
    for tenant in ("flood", "b", "c"):
        held.open(tenant)
    await asyncio.gather(*(r.future for r in [*flood, *others]))
    await batcher.stop()


async def test_a_batch_beyond_the_slots_keeps_the_batch_limits() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_past_batcher(clock, recorder, max_batch_size=2)
    flood = await fill_slots(clock, batcher, "flood")
    quiet = [make_request(clock, [f"q{i}"], tenant="quiet") for i in range(3)]
    for request in quiet:
        batcher.submit(request)
    await settle()
    # Two of its items; its third waits (quiet now runs).
    assert [[r.items[0] for r in b] for b in recorder.batches[2:]] == [["q0", "q1"]]
    assert batcher.num_stepped_past == 1
    recorder.gate.set()
    await asyncio.gather(*(r.future for r in [*flood, *quiet]))
    await batcher.stop()


async def test_a_latency_tier_request_steps_past_busy_slots() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_past_batcher(clock, recorder)
    flood = await fill_slots(clock, batcher, "flood")
    vip = make_request(clock, ["v"], tenant="vip", latency_target_s=0.5)
    batcher.submit(vip)
    await settle()
    assert [[r.tenant for r in b] for b in recorder.batches] == [["flood"], ["flood"], ["vip"]]
    recorder.gate.set()
    await asyncio.gather(*(r.future for r in [*flood, vip]))
    await batcher.stop()


async def test_a_request_whose_caller_has_gone_does_not_step_past() -> None:
    clock, recorder = FakeClock(), Recorder()
    recorder.gate = asyncio.Event()
    batcher = make_past_batcher(clock, recorder)
    flood = await fill_slots(clock, batcher, "flood")
    gone = make_request(clock, ["g"], tenant="quiet")
    batcher.submit(gone)
    gone.future.cancel()
    await settle()
    assert len(recorder.batches) == 2
    assert batcher.num_stepped_past == 0
    assert batcher.num_dropped == 1
    recorder.gate.set()
    await asyncio.gather(*(r.future for r in flood))
    await batcher.stop()
