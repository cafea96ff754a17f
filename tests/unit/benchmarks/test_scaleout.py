"""The scale-out simulator at a size that runs in a second, on fake time."""

from __future__ import annotations

import asyncio
import itertools

from harness.scaleout import (
    MB,
    CountLruCache,
    SimConfig,
    dedicated_devices,
    make_arrivals,
    make_models,
    simulate,
)
from tessera.clock import FakeClock
from tessera.cluster import RoutingConfig

SMALL = SimConfig(
    num_models=20,
    rate=100.0,
    duration_s=20.0,
    warmup_s=5.0,
    burst_every_s=4.0,
    burst_rate=400.0,
    burst_s=8.0,
    device_budget_bytes=2000 * MB,
    max_model_bytes=200 * MB,
)
ROUTING = RoutingConfig(target_p99_s=0.25, scale_up_after_s=0.5)


def test_arrivals_are_seeded_and_bursty() -> None:
    arrivals = make_arrivals(SMALL)
    assert arrivals == make_arrivals(SMALL)
    assert all(a.at <= b.at for a, b in itertools.pairwise(arrivals))
    base = SMALL.rate * SMALL.duration_s
    assert len(arrivals) > 1.5 * base  # the bursts add to the Zipf arrivals


def test_tessera_fleet_keeps_models_where_they_are_and_replicates_bursts() -> None:
    result = simulate("tessera", SMALL, 4, ROUTING)
    assert result.num_failed == 0
    assert result.affinity >= 0.95
    assert result.replicas_added >= 1
    # every model's bytes fit the fleet together: each is loaded about once,
    # plus the replicas
    assert result.loads <= SMALL.num_models + 2 * result.replicas_added


def test_more_devices_do_not_raise_p99() -> None:
    few = simulate("tessera", SMALL, 2, ROUTING)
    many = simulate("tessera", SMALL, 6, ROUTING)
    assert many.p99_s <= few.p99_s


def test_count_based_cache_holds_at_most_its_count_whatever_the_bytes() -> None:
    clock = FakeClock()
    cache = CountLruCache(2, clock)
    models = make_models(SMALL)

    async def use(indexes: list[int]) -> None:
        for i in indexes:
            await cache.ensure(models[i])

    asyncio.run(use([0, 1, 0, 2]))
    assert sorted(name for name, _, _ in cache.states()) == ["m0000", "m0002"]
    assert cache.loads == 3


def test_one_model_per_device_gives_each_model_a_device_and_the_hot_more() -> None:
    models = make_models(SMALL)
    counts = dedicated_devices(SMALL, models, 0.6)
    assert len(counts) == SMALL.num_models
    assert min(counts) == 1
    assert max(counts) > 1
    result = simulate("dedicated", SMALL, 0, ROUTING)
    assert result.num_devices == sum(counts)
    assert result.loads == 0
