"""The fair queue at its edges: virtual-time credit, earliest deadline first, the
batch limits and caps. No clock at all: the queue takes ``now`` as an argument."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from builders import make_queued
from tessera.request import QueuedRequest
from tessera.scheduling import BatchTimePredictor, FairQueue


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """Futures need a loop; the queue itself never awaits."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def tenants_of(batch: list[QueuedRequest]) -> list[str]:
    return [r.tenant for r in batch]


def linear_predictor(per_unit_s: float, fixed_s: float = 0.0) -> BatchTimePredictor:
    predictor = BatchTimePredictor()
    for units in (10, 20, 40):
        predictor.observe(units, fixed_s + units * per_unit_s)
    return predictor


def push_two_tenants(queue: FairQueue, loop: asyncio.AbstractEventLoop, count: int) -> None:
    """``count`` requests of 10 units, tenants a and b in turn, a microsecond apart."""
    for i in range(count):
        queue.push(make_queued(loop, "a" if i % 2 else "b", units=10, arrival=i * 1e-6))


# -- virtual time ---------------------------------------------------------------


def test_counter_is_units_over_weight(loop: asyncio.AbstractEventLoop) -> None:
    queue = FairQueue()
    queue.push(make_queued(loop, "a", units=10, weight=4.0))
    queue.push(make_queued(loop, "b", units=10, weight=0.0))  # a zero weight does not divide by 0
    assert queue.counters == {"a": 0.0, "b": 0.0}
    queue.pop_batch(1, 1e9, now=0.0)
    assert queue.counters["a"] == pytest.approx(2.5)
    queue.pop_batch(1, 1e9, now=0.0)
    assert queue.counters["b"] == pytest.approx(10 / 1e-9)


def test_returning_tenant_keeps_no_credit_from_before_its_idle_time(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # "b" is served beside "a", goes idle while "a" is served alone, then comes
    # back. Its old counter is far below "a"'s; kept, it would be served alone
    # until it caught up (credit banked while idle).
    queue = FairQueue()
    for i in range(4):
        queue.push(make_queued(loop, "a", arrival=i))
        queue.push(make_queued(loop, "b", arrival=i))
    assert sorted(tenants_of(queue.pop_batch(8, 1e9, now=0.0))) == ["a"] * 4 + ["b"] * 4
    assert queue.counters == {"a": 40.0, "b": 40.0}
    for i in range(40):  # b is idle; a is served alone: 400 more units
        queue.push(make_queued(loop, "a", arrival=10 + i))
    for _ in range(10):
        assert tenants_of(queue.pop_batch(4, 1e9, now=0.0)) == ["a"] * 4
    assert queue.counters["a"] == 440.0
    for i in range(20):  # both come back with a backlog
        queue.push(make_queued(loop, "b", arrival=100 + i))
        queue.push(make_queued(loop, "a", arrival=100 + i))
    assert queue.counters["b"] == 440.0  # lifted to a's counter
    served = [t for _ in range(4) for t in tenants_of(queue.pop_batch(4, 1e9, now=0.0))]
    assert served.count("a") == served.count("b") == 8


def test_returning_tenant_with_a_higher_counter_is_not_lowered(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue()
    queue.push(make_queued(loop, "c", units=100, arrival=0.0))
    for i in range(10):
        queue.push(make_queued(loop, "a", arrival=i))
    assert tenants_of(queue.pop_batch(1, 1e9, now=0.0)) == ["c"]  # the lighter backlog
    assert tenants_of(queue.pop_batch(2, 1e9, now=0.0)) == ["a", "a"]
    for i in range(8):
        queue.push(make_queued(loop, "c", arrival=20 + i))
    assert queue.counters == {"a": 20.0, "c": 100.0}  # c is not lowered to a's 20
    assert tenants_of(queue.pop_batch(6, 1e9, now=0.0)) == ["a"] * 6


def test_tenant_alone_after_idle_keeps_its_own_counter(loop: asyncio.AbstractEventLoop) -> None:
    queue = FairQueue()
    queue.push(make_queued(loop, "a", units=30))
    assert queue.counters == {"a": 0.0}
    queue.pop_batch(1, 1e9, now=0.0)
    queue.push(make_queued(loop, "a", units=30))
    assert queue.counters["a"] == 30.0


def test_tenant_arriving_at_an_empty_queue_starts_from_the_last_served(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # After most batches the queue is empty: a newcomer then starts from the
    # counter of the last tenant served out, not from zero, or it would be
    # served alone until it caught up with a tenant that comes back.
    queue = FairQueue()
    for i in range(5):
        queue.push(make_queued(loop, "a", arrival=i))
    queue.pop_batch(5, 1e9, now=0.0)
    queue.push(make_queued(loop, "b", arrival=10.0))
    assert queue.counters["b"] == 50.0
    queue.pop_batch(1, 1e9, now=10.0)
    for i in range(4):
        queue.push(make_queued(loop, "b", arrival=20 + i))
        queue.push(make_queued(loop, "a", arrival=20 + i))
    assert sorted(tenants_of(queue.pop_batch(4, 1e9, now=20.0))) == ["a", "a", "b", "b"]


def test_a_backlogged_tenant_keeps_its_counter_when_it_queues_more(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue()
    for tenant, units in (("a", 10), ("a", 10), ("b", 30), ("b", 30)):
        queue.push(make_queued(loop, tenant, units=units))
    assert tenants_of(queue.pop_batch(1, 1e9, now=0.0)) == ["a"]
    assert tenants_of(queue.pop_batch(1, 1e9, now=0.0)) == ["b"]
    queue.push(make_queued(loop, "a", units=10))  # a is still backlogged: no lift
    assert queue.counters == {"a": 10.0, "b": 30.0}
    assert tenants_of(queue.pop_batch(1, 1e9, now=0.0)) == ["a"]


def test_ties_go_to_the_lighter_backlog_then_the_older_head(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue()
    for i in range(3):
        queue.push(make_queued(loop, "heavy", arrival=i))
    queue.push(make_queued(loop, "light", arrival=5))
    assert tenants_of(queue.pop_batch(1, 1e9, now=0.0)) == ["light"]

    queue = FairQueue()
    queue.push(make_queued(loop, "late", arrival=2.0))
    queue.push(make_queued(loop, "early", arrival=1.0))
    assert tenants_of(queue.pop_batch(1, 1e9, now=0.0)) == ["early"]


# -- latency tiers: earliest deadline first ---------------------------------------


def test_vip_requests_are_served_earliest_deadline_first(loop: asyncio.AbstractEventLoop) -> None:
    queue = FairQueue()
    queue.push(make_queued(loop, "bulk", arrival=0.0))
    relaxed = make_queued(loop, "v1", arrival=0.0, latency_target_s=0.5)  # due at 0.5
    urgent = make_queued(loop, "v2", arrival=0.1, latency_target_s=0.2)  # due at 0.3
    middle = make_queued(loop, "v3", arrival=0.3, latency_target_s=0.1)  # due at 0.4
    for request in (relaxed, urgent, middle):
        queue.push(request)
    batch = queue.pop_batch(1, 1e9, now=0.2)
    assert batch == [urgent]
    assert queue.pop_batch(1, 1e9, now=0.2) == [middle]
    assert queue.pop_batch(1, 1e9, now=0.2) == [relaxed]
    assert tenants_of(queue.pop_batch(1, 1e9, now=0.2)) == ["bulk"]


def test_vip_goes_first_even_with_the_higher_counter(loop: asyncio.AbstractEventLoop) -> None:
    queue = FairQueue()
    queue.push(make_queued(loop, "bulk", units=1))
    queue.push(make_queued(loop, "vip", units=500, latency_target_s=1.0))
    assert tenants_of(queue.pop_batch(1, 1e9, now=0.0)) == ["vip"]
    vip = make_queued(loop, "vip", arrival=1.0, latency_target_s=1.0)
    queue.push(vip)
    assert queue.counters == {"bulk": 0.0, "vip": 500.0}
    assert queue.pop_batch(1, 1e9, now=1.0) == [vip]


def test_batch_with_a_vip_stops_at_half_its_remaining_budget(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # 1 ms a unit; the tier's arrivals are past the horizon, so only the batch's own cap acts.
    queue = FairQueue(linear_predictor(0.001), latency_horizon_s=0.001)
    vip = make_queued(loop, "vip", units=10, arrival=0.0, latency_target_s=0.105)
    queue.push(vip)
    for i in range(20):
        queue.push(make_queued(loop, "bulk", units=10, arrival=0.0 + i * 1e-6))
    # 103 ms left: half is 51.5 ms, so 50 units: the vip and four more.
    batch = queue.pop_batch(100, 1e9, now=0.002)
    assert batch[0] is vip
    assert sum(r.units for r in batch) == 50


def test_latency_budget_uses_the_remaining_time_not_the_target(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue(linear_predictor(0.001), latency_horizon_s=0.001)
    vip = make_queued(loop, "vip", units=10, arrival=0.0, latency_target_s=0.105)
    queue.push(vip)
    for i in range(20):
        queue.push(make_queued(loop, "bulk", units=10, arrival=0.0 + i * 1e-6))
    # At 42 ms, 63 ms remain: half is 31.5 ms, so 30 units.
    batch = queue.pop_batch(100, 1e9, now=0.042)
    assert sum(r.units for r in batch) == 30


def test_active_latency_tier_caps_batches_at_a_quarter_of_its_target(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue(linear_predictor(0.001), latency_horizon_s=2.0)
    queue.push(make_queued(loop, "vip", units=1, arrival=0.0, latency_target_s=0.22))
    queue.push(make_queued(loop, "vip2", units=1, arrival=0.0, latency_target_s=0.42))
    queue.pop_batch(1, 1e9, now=0.0)
    queue.pop_batch(1, 1e9, now=0.0)
    for i in range(30):
        queue.push(make_queued(loop, "bulk", units=10, arrival=0.1 + i * 1e-6))
    # The tightest active target is 220 ms: batches of 55 ms, 50 units.
    assert sum(r.units for r in queue.pop_batch(100, 1e9, now=2.0)) == 50  # horizon included
    assert sum(r.units for r in queue.pop_batch(100, 1e9, now=2.01)) == 250  # quiet: full


def test_latency_tier_is_active_for_the_horizon_after_its_last_arrival(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue(linear_predictor(0.001), latency_horizon_s=2.0)
    queue.push(make_queued(loop, "vip", units=1, arrival=100.0, latency_target_s=0.22))
    queue.pop_batch(1, 1e9, now=100.0)
    for i in range(30):
        queue.push(make_queued(loop, "bulk", units=10, arrival=100.1 + i * 1e-6))
    assert sum(r.units for r in queue.pop_batch(100, 1e9, now=101.0)) == 50


def test_a_batch_may_be_predicted_to_take_exactly_its_budget(
    loop: asyncio.AbstractEventLoop,
) -> None:
    predictor = BatchTimePredictor()
    predictor.observe(1, 0.25)
    predictor.observe(3, 0.75)  # exactly 0.25 s per unit, in binary too
    queue = FairQueue(predictor, latency_horizon_s=2.0)
    queue.push(make_queued(loop, "vip", units=1, latency_target_s=8.0))
    queue.pop_batch(1, 1e9, now=0.0)  # the tier is active: a 2 s cap
    for _ in range(3):
        queue.push(make_queued(loop, "bulk", units=4))
    assert sum(r.units for r in queue.pop_batch(100, 1e9, now=0.0)) == 8  # 2.0 s: fits


def test_a_single_request_is_taken_whole_whatever_the_caps(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue(linear_predictor(0.001))
    queue.push(make_queued(loop, "vip", units=1000, items=50, latency_target_s=0.01))
    queue.push(make_queued(loop, "bulk", units=1))
    batch = queue.pop_batch(10, 100, now=0.0)
    assert tenants_of(batch) == ["vip"]


def test_without_a_measurement_latency_does_not_cap(loop: asyncio.AbstractEventLoop) -> None:
    for queue in (FairQueue(), FairQueue(BatchTimePredictor())):
        queue.push(make_queued(loop, "vip", units=10, latency_target_s=0.001))
        for _ in range(9):
            queue.push(make_queued(loop, "bulk", units=10))
        assert len(queue.pop_batch(100, 1e9, now=0.0)) == 10


def test_quantum_counts_tenants_active_within_the_horizon(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue(linear_predictor(0.001), latency_horizon_s=1.0, quantum_s=0.025)
    queue.push(make_queued(loop, "other", units=1, arrival=0.0))
    queue.pop_batch(1, 1e9, now=0.0)
    for i in range(10):
        queue.push(make_queued(loop, "flood", units=10, arrival=1.0 + i * 1e-6))
    # "other" arrived exactly one horizon ago: two tenants, a 25 ms quantum.
    assert sum(r.units for r in queue.pop_batch(100, 1e9, now=1.0)) == 20
    # Past the horizon: one tenant alone, full batches.
    assert sum(r.units for r in queue.pop_batch(100, 1e9, now=1.0 + 1e-3)) == 80


def test_quantum_counts_tenants_backlogged_now_whenever_they_arrived(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Pages of OCR every few seconds: both tenants' arrivals may be past the
    horizon while both wait; they share the model all the same."""
    queue = FairQueue(linear_predictor(0.001), latency_horizon_s=1.0, quantum_s=0.025)
    queue.push(make_queued(loop, "quiet", units=30, arrival=0.0))
    for _ in range(10):
        queue.push(make_queued(loop, "flood", units=30, arrival=0.0))
    # Five horizons later, both still backlogged: the quiet request runs alone.
    assert tenants_of(queue.pop_batch(100, 1e9, now=5.0)) == ["quiet"]
    # Then the flood alone: full batches.
    assert sum(r.units for r in queue.pop_batch(100, 1e9, now=5.0)) == 300


def test_quantum_counts_a_tenant_seen_within_the_run_of_an_uncapped_batch(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """An OCR page every three seconds beside requests of eight 1 s pages: past
    the 1 s horizon, but a batch of the eight would run 8 s, within which the
    sparse tenant is likely back."""
    queue = FairQueue(linear_predictor(1.0), latency_horizon_s=1.0, quantum_s=0.025)
    queue.push(make_queued(loop, "quiet", units=1, arrival=0.0))
    queue.pop_batch(8, 1e9, now=0.0)
    for _ in range(8):
        queue.push(make_queued(loop, "flood", units=1, arrival=3.0))
    assert len(queue.pop_batch(8, 1e9, now=3.0)) == 1
    # Ten seconds on, longer than the run of what is left: full batches again.
    assert len(queue.pop_batch(8, 1e9, now=13.0)) == 7


def test_quantum_counts_a_paced_tenant_active_for_several_of_its_gaps(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """An OCR page every 2 s (Poisson: a third of its gaps are over 2 s): past
    the horizon and the run of a full batch, a tenant with a pace is active for
    a few of its gaps, so it comes back to a part running, not eight pages."""
    queue = FairQueue(linear_predictor(0.25), latency_horizon_s=1.0, quantum_s=0.025)
    for i in range(5):
        queue.push(make_queued(loop, "quiet", units=1, arrival=2.0 * i))
        queue.pop_batch(8, 1e9, now=2.0 * i)
    for _ in range(8):  # 4 s after the quiet tenant's last arrival (at 8 s)
        queue.push(make_queued(loop, "flood", units=1, arrival=12.0))
    assert len(queue.pop_batch(8, 1e9, now=12.0)) == 1
    assert len(queue.pop_batch(8, 1e9, now=17.9)) == 1  # within five 2 s gaps
    assert len(queue.pop_batch(8, 1e9, now=18.1)) == 6  # then one tenant alone


def test_quantum_is_the_smaller_of_it_and_the_latency_cap(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue(linear_predictor(0.001), latency_horizon_s=1.0, quantum_s=0.025)
    queue.push(make_queued(loop, "vip", units=1, arrival=0.0, latency_target_s=0.4))
    queue.pop_batch(1, 1e9, now=0.0)  # latency cap: 100 ms
    for i in range(20):
        queue.push(make_queued(loop, "flood", units=10, arrival=0.5 + i * 1e-6))
    assert sum(r.units for r in queue.pop_batch(100, 1e9, now=0.5)) == 20

    queue = FairQueue(linear_predictor(0.001), latency_horizon_s=1.0, quantum_s=0.2)
    queue.push(make_queued(loop, "vip", units=1, arrival=0.0, latency_target_s=0.14))
    queue.pop_batch(1, 1e9, now=0.0)  # latency cap: 35 ms, below the 200 ms quantum
    for i in range(20):
        queue.push(make_queued(loop, "flood", units=10, arrival=0.5 + i * 1e-6))
    assert sum(r.units for r in queue.pop_batch(100, 1e9, now=0.5)) == 30


def test_quantum_is_of_work_beyond_a_batchs_fixed_cost(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """A CPU encoder: 20 ms a batch whatever its size, 1 ms a unit. A 25 ms
    cap would run one 10-unit request a batch, each paying the 20 ms; the
    cap is 25 ms of work beyond them: 20 units (two requests; a third would
    be 30 ms of work)."""
    queue = FairQueue(linear_predictor(0.001, 0.02), latency_horizon_s=1.0, quantum_s=0.025)
    push_two_tenants(queue, loop, 20)
    assert sum(r.units for r in queue.pop_batch(100, 1e9, now=0.0)) == 20
    # A part of another tenant's, 40 units of work, does not join a sentence's batch.
    queue = FairQueue(linear_predictor(0.001, 0.02), latency_horizon_s=1.0, quantum_s=0.025)
    queue.push(make_queued(loop, "quiet", units=10, arrival=0.0))
    queue.push(make_queued(loop, "flood", units=40, arrival=0.0))
    assert tenants_of(queue.pop_batch(100, 1e9, now=0.0)) == ["quiet"]


def test_batches_all_of_one_size_explore_a_size_three_times_the_smallest(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Every measured batch held one 10-unit request (30 ms, more than the
    quantum): no line tells the batch's fixed cost from its work, and a
    25 ms cap would keep it so. One batch of up to three times the smallest
    measured runs; with its measurement the line decides."""
    predictor = BatchTimePredictor()
    for _ in range(5):
        predictor.observe(10, 0.03)
    queue = FairQueue(predictor, latency_horizon_s=1.0, quantum_s=0.025)
    push_two_tenants(queue, loop, 40)
    assert len(queue.pop_batch(100, 1e9, now=0.0)) == 3
    predictor.observe(30, 0.04)  # 25 ms fixed, 0.5 ms a unit: 25 ms of work is 50 units
    assert predictor.line() is not None
    assert sum(r.units for r in queue.pop_batch(100, 1e9, now=0.0)) == 50


def test_a_model_not_yet_measured_has_its_batches_uncapped_while_tenants_share_it(
    loop: asyncio.AbstractEventLoop,
) -> None:
    predictor = BatchTimePredictor()
    assert predictor.smallest_units() is None
    queue = FairQueue(predictor, latency_horizon_s=1.0, quantum_s=0.025)
    push_two_tenants(queue, loop, 6)
    assert len(queue.pop_batch(100, 1e9, now=0.0)) == 6


# -- batch limits --------------------------------------------------------------


def test_batch_fills_items_and_units_exactly_to_their_limits(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue()
    for _ in range(5):
        queue.push(make_queued(loop, "a", items=2, units=3))
    assert len(queue.pop_batch(4, 1e9, now=0.0)) == 2  # 4 items exactly
    assert len(queue.pop_batch(100, 3, now=0.0)) == 1  # 3 units exactly
    assert len(queue.pop_batch(100, 5.9, now=0.0)) == 1
    assert len(queue) == 1
    assert len(queue.pop_batch(1, 1, now=0.0)) == 1  # over both limits alone: taken whole
    assert len(queue) == 0
    for _ in range(3):
        queue.push(make_queued(loop, "a", units=3))
    assert len(queue.pop_batch(100, 6, now=0.0)) == 2  # two requests, 6 units exactly


def test_remove_if_returns_the_removed_and_keeps_the_rest_in_order(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue()
    requests = [make_queued(loop, t, units=u, arrival=u) for t in "ab" for u in (1, 2, 3)]
    for request in requests:
        queue.push(request)
    assert queue.remove_if(lambda r: False) == []
    assert len(queue) == 6
    removed = queue.remove_if(lambda r: r.units == 2)
    assert sorted(tenants_of(removed)) == ["a", "b"]
    assert all(r.units == 2 for r in removed)
    assert len(queue) == 4
    assert [(r.tenant, r.units) for r in queue] == [("a", 1), ("a", 3), ("b", 1), ("b", 3)]
    assert len(queue.pop_batch(100, 1e9, now=0.0)) == 4
    assert len(queue) == 0
    assert queue.pop_batch(100, 1e9, now=0.0) == []


def test_oldest_arrival_is_the_oldest_head(loop: asyncio.AbstractEventLoop) -> None:
    queue = FairQueue()
    assert queue.oldest_arrival() is None
    queue.push(make_queued(loop, "a", arrival=5.0))
    queue.push(make_queued(loop, "b", arrival=3.0))
    queue.push(make_queued(loop, "b", arrival=4.0))
    assert queue.oldest_arrival() == 3.0
    queue.remove_if(lambda r: r.tenant == "b")
    assert queue.oldest_arrival() == 5.0
    queue.pop_batch(1, 1e9, now=0.0)
    assert queue.oldest_arrival() is None


def test_tenants_tied_on_everything_are_served_in_the_order_they_queued(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue()
    queue.push(make_queued(loop, "b", arrival=1.0))
    queue.push(make_queued(loop, "a", arrival=1.0))
    assert tenants_of(queue.pop_batch(1, 1e9, now=1.0)) == ["b"]

    queue = FairQueue()  # the same deadline
    queue.push(make_queued(loop, "b", arrival=1.0, latency_target_s=0.5))
    queue.push(make_queued(loop, "a", arrival=1.0, latency_target_s=0.5))
    assert tenants_of(queue.pop_batch(1, 1e9, now=1.0)) == ["b"]


def test_of_heads_due_at_once_the_one_at_the_head_longer_goes_first(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue()
    queue.push(make_queued(loop, "a", arrival=0.0, latency_target_s=0.5))
    queue.push(make_queued(loop, "a", arrival=0.5, latency_target_s=0.5))  # due at 1.0
    queue.push(make_queued(loop, "b", arrival=0.25, latency_target_s=0.75))  # due at 1.0
    assert tenants_of(queue.pop_batch(1, 1e9, now=0.5)) == ["a"]
    # a's second is a head from now on, b's has been one since it arrived.
    assert tenants_of(queue.pop_batch(2, 1e9, now=0.5)) == ["b", "a"]


# -- a batch beside running tenants (``skip``) ------------------------------------


def test_a_batch_beside_running_tenants_takes_the_earliest_deadline_of_the_others(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue()
    queue.push(make_queued(loop, "bulk", arrival=0.0))
    queue.push(make_queued(loop, "running", arrival=0.0, latency_target_s=0.1))
    queue.push(make_queued(loop, "late", arrival=0.0, latency_target_s=5.0))
    soon = make_queued(loop, "soon", arrival=0.0, latency_target_s=1.0)
    queue.push(soon)
    queue.push(make_queued(loop, "soon", arrival=0.0, latency_target_s=9.0))
    assert queue.pop_batch(1, 1e9, now=0.0, skip=frozenset({"running"})) == [soon]


def test_a_batch_beside_running_tenants_takes_the_lowest_counter_of_the_others(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue()
    for _ in range(2):
        queue.push(make_queued(loop, "a", units=10))
        queue.push(make_queued(loop, "z", units=10, weight=2.0))
    assert tenants_of(queue.pop_batch(2, 1e9, now=0.0)) == ["a", "z"]
    assert queue.counters == {"a": 10.0, "z": 5.0}
    queue.push(make_queued(loop, "running"))
    assert tenants_of(queue.pop_batch(1, 1e9, now=0.0, skip=frozenset({"running"}))) == ["z"]


# -- the work ahead of a request ----------------------------------------------------


def test_units_ahead_foresees_the_order_the_queue_serves(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue()
    queue.push(make_queued(loop, "c", units=1.1, arrival=0.0))
    for i in range(10):
        queue.push(make_queued(loop, "a", units=0.1, arrival=1.0 + i))
    assert tenants_of(queue.pop_batch(1, 1e9, now=0.0)) == ["c"]  # the lighter backlog
    assert tenants_of(queue.pop_batch(2, 1e9, now=0.0)) == ["a", "a"]
    # "c" comes back above the floor: "a" is served up to c's counter first,
    # its whole backlog of 0.8 units (its counter reaches 1.0 of c's 1.1).
    back = make_queued(loop, "c", units=0.1, arrival=20.0)
    assert queue.units_ahead(back) == pytest.approx(0.8)
    queue.push(back)
    # A request of "a" now: its own backlog, and none of c's, which is above
    # the counter "a" reaches (the queue's 0.9 units are more than that).
    later = make_queued(loop, "a", units=0.1, arrival=21.0)
    assert queue.units_ahead(later) == pytest.approx(0.8)
    queue.push(later)
    assert tenants_of(queue.pop_batch(100, 1e9, now=21.0)) == ["a"] * 9 + ["c"]


def test_the_queue_counts_its_work_exactly_as_requests_come_and_go(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # The whole work queued is what ``units_ahead`` gives where it is under ``enough``.
    queue = FairQueue()
    probe = make_queued(loop, "other")
    assert queue.units_ahead(probe, enough=1e9) == 0.0
    for units in (0.1, 0.2, 0.4):
        queue.push(make_queued(loop, "a", units=units))
    assert queue.units_ahead(probe, enough=1e9) == pytest.approx(0.7)
    queue.pop_batch(1, 1e9, now=0.0)
    assert queue.units_ahead(probe, enough=1e9) == pytest.approx(0.6)
    queue.pop_batch(2, 1e9, now=0.0)
    assert queue.units_ahead(probe, enough=1e9) == 0.0  # no rounding left behind
    for units in (0.1, 0.2):
        queue.push(make_queued(loop, "a", units=units))
    queue.remove_if(lambda r: True)
    assert queue.units_ahead(probe, enough=1e9) == 0.0


@pytest.mark.parametrize(("requests", "units", "per_unit_s"), [(8, 1.0, 0.5), (4, 0.125, 8.0)])
def test_quantum_counts_a_tenant_seen_exactly_one_uncapped_run_ago(
    loop: asyncio.AbstractEventLoop, requests: int, units: float, per_unit_s: float
) -> None:
    predictor = BatchTimePredictor()
    predictor.observe(1, per_unit_s)
    predictor.observe(4, 4 * per_unit_s)  # exactly per_unit_s a unit, in binary too
    queue = FairQueue(predictor, latency_horizon_s=1.0, quantum_s=0.025)
    queue.push(make_queued(loop, "quiet", units=units, arrival=0.0))
    queue.pop_batch(8, 1e9, now=0.0)
    for _ in range(requests):
        queue.push(make_queued(loop, "flood", units=units, arrival=3.0))
    # The whole backlog would run 4 s: "quiet", seen 4 s ago, is active to its end.
    assert len(queue.pop_batch(8, 1e9, now=4.0)) == 1
    # Later than the run of what is left: one tenant alone, a full batch.
    assert len(queue.pop_batch(8, 1e9, now=4.001)) == requests - 1


def test_without_a_predictor_the_quantum_caps_nothing(loop: asyncio.AbstractEventLoop) -> None:
    queue = FairQueue(latency_horizon_s=1.0, quantum_s=0.025)
    queue.push(make_queued(loop, "quiet", arrival=0.0))
    queue.pop_batch(8, 1e9, now=0.0)
    for _ in range(8):
        queue.push(make_queued(loop, "flood", arrival=3.0))
    assert len(queue.pop_batch(4, 1e9, now=3.5)) == 4
    queue.push(make_queued(loop, "quiet", arrival=3.5))  # active beside: no time to cap by
    assert len(queue.pop_batch(8, 1e9, now=3.5)) == 5
