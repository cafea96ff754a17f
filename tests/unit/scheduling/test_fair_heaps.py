"""The fair queue's heaps against the order they stand for: a reference that
scans every tenant at each pick (the plain form of the queue), driven by
the same random pushes, batches and removals, serves the same requests in the
same order. Arrivals are distinct, so no two heads tie on the whole key."""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from collections.abc import Iterator
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import make_queued
from tessera.request import QueuedRequest
from tessera.scheduling import FairQueue, fair
from tessera.scheduling.fair import REBUILD_SLACK


class ScanningQueue:
    """VTC with the counter lift and latency heads first, by scans."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[QueuedRequest]] = {}
        self.counters: dict[str, float] = {}
        self.last_left = 0.0

    def push(self, request: QueuedRequest) -> None:
        queue = self.queues.setdefault(request.tenant, deque())
        if not queue:
            others = [self.counters[t] for t, q in self.queues.items() if q]
            floor = min(others, default=self.last_left)
            self.counters[request.tenant] = max(self.counters.get(request.tenant, floor), floor)
        queue.append(request)

    def pop_batch(self, max_items: int) -> list[QueuedRequest]:
        batch: list[QueuedRequest] = []
        while len(batch) < max_items and any(self.queues.values()):
            backlogged = [t for t, q in self.queues.items() if q]
            urgent = [t for t in backlogged if self.queues[t][0].latency_target_s is not None]
            if urgent:
                tenant = min(urgent, key=lambda t: deadline(self.queues[t][0]))
            else:
                queues, counters = self.queues, self.counters
                tenant = min(
                    backlogged, key=lambda t: (counters[t], len(queues[t]), queues[t][0].arrival)
                )
            request = self.queues[tenant].popleft()
            self.counters[tenant] += request.units / request.weight
            if not self.queues[tenant]:
                self.last_left = self.counters[tenant]
            batch.append(request)
        return batch

    def remove_if(self, tenant: str) -> None:
        self.queues[tenant] = deque()


def deadline(request: QueuedRequest) -> float:
    assert request.latency_target_s is not None
    return request.arrival + request.latency_target_s


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


# Few tenants, long runs: returning tenants and ties among them are common.
push = st.tuples(
    st.just("push"),
    st.integers(0, 4),  # tenant
    st.integers(1, 40),  # units
    st.sampled_from([None, None, None, 0.5, 2.0]),  # latency target
)
pop = st.tuples(st.just("pop"), st.integers(1, 8), st.just(0), st.none())
drop = st.tuples(st.just("drop"), st.integers(0, 4), st.just(0), st.none())


@settings(max_examples=300, deadline=None)
@given(
    operations=st.lists(st.one_of(push, push, pop, drop), min_size=10, max_size=150),
    prune_slack=st.sampled_from([0, 3, fair.PRUNE_SLACK]),
)
def test_the_heaps_serve_what_a_scan_of_every_tenant_serves(
    operations: list[tuple[str, int, int, float | None]], prune_slack: int
) -> None:
    # The reference keeps every counter; the queue prunes those at or below
    # the floor (at once with no slack): the same requests in the same order.
    loop = asyncio.new_event_loop()
    try:
        with mock.patch.object(fair, "PRUNE_SLACK", prune_slack):
            run_both(loop, operations)
    finally:
        loop.close()


def run_both(
    loop: asyncio.AbstractEventLoop, operations: list[tuple[str, int, int, float | None]]
) -> None:
    queue, reference = FairQueue(), ScanningQueue()
    for step, (kind, number, units, target) in enumerate(operations):
        tenant = f"t{number}"
        if kind == "push":
            # A tenant's weight is its tier's: the same for all its requests.
            # A pop's number is its batch's items; a drop's, its tenant.
            request = make_queued(
                loop,
                tenant,
                units=units,
                weight=1.0 + number % 3,
                arrival=float(step),
                latency_target_s=target,
            )
            queue.push(request)
            reference.push(request)
        elif kind == "pop":
            got = queue.pop_batch(number, 1e9, now=float(step))
            assert got == reference.pop_batch(number)
        else:
            queue.remove_if(lambda r, t=tenant: r.tenant == t)  # type: ignore[misc]
            reference.remove_if(tenant)
        assert len(queue) == sum(len(q) for q in reference.queues.values())
        # The bound a submit asks for: the exact count, or the total queued
        # where that is under ``enough`` (never under the exact count).
        probe = make_queued(loop, f"t{step % 6}", arrival=float(step))
        exact = queue.units_ahead(probe)
        for enough in (0.0, exact, exact + 1.0, 1e9):
            bounded = queue.units_ahead(probe, enough)
            assert bounded == exact or exact <= bounded < enough
        assert len(queue._order) <= 2 * len(queue._keys) + REBUILD_SLACK + 1
    assert queue.pop_batch(10_000, 1e9, now=1e6) == reference.pop_batch(10_000)


def test_tenants_served_out_leave_nothing_behind(loop: asyncio.AbstractEventLoop) -> None:
    # A thousand tenants one request each: served, nothing is held for them
    # (their counters, at the floor, are pruned past PRUNE_SLACK of them).
    queue = FairQueue()
    prunes, counters = 0, queue.counters
    for i in range(3000):
        queue.push(make_queued(loop, f"t{i}", arrival=float(i), latency_target_s=1.0))
        assert len(queue.pop_batch(1, 1e9, now=float(i))) == 1
        prunes += queue.counters is not counters  # a prune makes a new mapping
        counters = queue.counters
    assert 1 <= prunes <= 3000 // fair.PRUNE_SLACK  # once in a while, not at each batch
    assert len(queue) == 0
    assert queue._keys == {}
    assert queue._queues == {}
    assert len(queue._order) <= REBUILD_SLACK + 1
    assert len(queue._urgent) <= REBUILD_SLACK + 1
    assert len(queue.counters) <= fair.PRUNE_SLACK + 1


def test_a_backlog_files_its_head_by_deadline_once_and_stale_keys_are_let_go(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue()
    with mock.patch.object(heapq, "heapify", wraps=heapq.heapify) as heapify:
        for i in range(300):
            queue.push(make_queued(loop, "vip", arrival=float(i), latency_target_s=1.0))
            assert len(queue._urgent) == 1  # only a new head is filed by deadline
            assert len(queue._order) <= 2 * len(queue._keys) + REBUILD_SLACK
    # Rebuilt once in a while, not at each push (the tenants' activity has a heap too).
    assert heapify.call_count <= 2 * 300 // REBUILD_SLACK


def test_deadlines_of_dropped_requests_are_let_go_and_live_ones_kept(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue()
    queue.push(make_queued(loop, "bulk", arrival=0.0))
    vip = make_queued(loop, "vip", arrival=1.0, latency_target_s=100.0)
    queue.push(vip)
    with mock.patch.object(heapq, "heapify", wraps=heapq.heapify) as heapify:
        for i in range(200):  # requests dropped while queued (given up, past their deadline)
            queue.push(make_queued(loop, f"gone{i}", arrival=2.0 + i, latency_target_s=1.0))
            queue.remove_if(lambda r: r.tenant.startswith("gone"))
            assert len(queue._urgent) <= 2 * 2 + REBUILD_SLACK
    assert heapify.call_count <= 2 * 200 // REBUILD_SLACK  # each heap once in a while
    assert queue.pop_batch(1, 1e9, now=300.0) == [vip]  # still first, by its deadline


def test_tenants_whose_requests_were_dropped_leave_no_counter_behind(
    loop: asyncio.AbstractEventLoop,
) -> None:
    with mock.patch.object(fair, "PRUNE_SLACK", 3):
        queue = FairQueue()
        queue.push(make_queued(loop, "bulk"))
        for i in range(50):
            queue.push(make_queued(loop, f"gone{i}"))  # lifted to the floor, bulk's 0
            queue.remove_if(lambda r: r.tenant != "bulk")
            assert len(queue.counters) <= 2 * 1 + 3
    assert [r.tenant for r in queue] == ["bulk"]
