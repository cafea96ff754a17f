"""Weighted fair queueing across tenants, with a fake clock and no sleeping."""

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


def served_units(batches: list[list[QueuedRequest]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for batch in batches:
        for r in batch:
            totals[r.tenant] = totals.get(r.tenant, 0.0) + r.units
    return totals


def test_backlogged_tenants_share_by_weight(loop: asyncio.AbstractEventLoop) -> None:
    queue = FairQueue()
    for i in range(300):
        queue.push(make_queued(loop, "heavy", weight=2.0, units=10 + i % 7, arrival=i))
        queue.push(make_queued(loop, "light", weight=1.0, units=10 + i % 5, arrival=i))
    batches = [queue.pop_batch(8, 10_000, now=0.0) for _ in range(40)]
    totals = served_units(batches)
    assert totals["heavy"] / totals["light"] == pytest.approx(2.0, rel=0.10)


def test_returning_tenant_banks_no_credit_and_does_not_starve_others(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue = FairQueue()
    for i in range(100):
        queue.push(make_queued(loop, "a", arrival=i))
    for _ in range(5):  # "a" alone is served for a while; "b" is idle
        queue.pop_batch(4, 10_000, now=0.0)
    for i in range(100):
        queue.push(make_queued(loop, "b", arrival=100 + i))
    batches = [queue.pop_batch(4, 10_000, now=0.0) for _ in range(10)]
    totals = served_units(batches)
    # Equal weights: after b returns they split service evenly, b not served first for long.
    assert totals["a"] == pytest.approx(totals["b"], rel=0.15)
    assert any(r.tenant == "a" for r in batches[1])


def test_flooder_cannot_push_light_tenant_past_one_batch(loop: asyncio.AbstractEventLoop) -> None:
    queue = FairQueue()
    for i in range(16):
        queue.push(make_queued(loop, "flood", items=8, units=80, arrival=i))
    queue.pop_batch(32, 10_000, now=0.0)  # a batch of the flooder runs
    quiet = make_queued(loop, "quiet", units=10, arrival=20)
    queue.push(quiet)
    next_batch = queue.pop_batch(32, 10_000, now=20.0)
    assert quiet in next_batch


def test_latency_tier_batch_fits_remaining_budget(loop: asyncio.AbstractEventLoop) -> None:
    predictor = BatchTimePredictor()
    for units in (10, 40, 80, 160, 320):
        predictor.observe(units, 0.005 + units * 0.001)  # 5 ms + 1 ms per unit
    queue = FairQueue(predictor)
    for i in range(32):
        queue.push(make_queued(loop, "flood", units=20, arrival=i * 0.001))
    vip = make_queued(loop, "vip", units=10, arrival=0.030, latency_target_s=0.100, weight=4.0)
    queue.push(vip)
    now = 0.040  # vip has 90 ms of its 100 ms left
    batch = queue.pop_batch(64, 10_000, now=now)
    assert batch[0] is vip
    predicted = predictor.predict(sum(r.units for r in batch))
    assert predicted is not None
    assert predicted <= vip.arrival + 0.100 - now
    assert len(batch) < 33  # capped below what the size limits allow
    # While the tier is active, later batches stay within a quarter of its target...
    capped = queue.pop_batch(64, 10_000, now=now)
    capped_time = predictor.predict(sum(r.units for r in capped))
    assert capped_time is not None
    assert capped_time <= 0.100 / 4 + 1e-9
    # ...and once it has been quiet for the horizon, batches grow back to full size.
    waiting = len(queue)
    assert waiting > len(capped)
    assert len(queue.pop_batch(64, 10_000, now=now + 2.5)) == waiting


def test_predictor_fits_fixed_and_per_unit_cost() -> None:
    predictor = BatchTimePredictor()
    assert predictor.predict(10) is None
    for units in (10, 20, 30):
        predictor.observe(units, 0.01 + units * 0.002)
    assert predictor.predict(50) == pytest.approx(0.11)


def test_quantum_caps_batches_only_while_tenants_share_the_model(
    loop: asyncio.AbstractEventLoop,
) -> None:
    predictor = BatchTimePredictor()
    for units in (10, 80, 320):
        predictor.observe(units, units * 0.001)  # 1 ms per unit
    queue = FairQueue(predictor, quantum_s=0.025)
    for i in range(20):
        queue.push(make_queued(loop, "flood", units=10, arrival=0.0 + i * 1e-4))
    # One tenant alone: full batches.
    assert len(queue.pop_batch(8, 10_000, now=0.01)) == 8
    queue.push(make_queued(loop, "quiet", units=5, arrival=0.02))
    shared = queue.pop_batch(8, 10_000, now=0.02)
    assert shared[0].tenant == "quiet"
    time_s = predictor.predict(sum(r.units for r in shared))
    assert time_s is not None
    assert time_s <= 0.025 + 1e-9
    assert len(shared) < 8
    # Once the quiet tenant has been away for the horizon, batches grow again.
    waiting = len(queue)
    assert waiting > 8
    assert len(queue.pop_batch(8, 10_000, now=5.0)) == 8
