"""Filling an idle budget at start (``ResidencyManager.fill``), with fake models
and a fake clock: what fits loads, nothing is evicted, demand orders it."""

from __future__ import annotations

import asyncio

from builders import make_spec
from harness.fake_host import FakeModelHost
from tessera.clock import FakeClock
from tessera.repository.spec import ModelSpec
from tessera.residency import ModelState, ResidencyManager, make_eviction_policy
from tessera.residency.manager import FILL_SHARE


def make_manager(
    budget: int, specs: list[ModelSpec], wait_s: float = 30.0
) -> tuple[ResidencyManager, FakeModelHost]:
    host = FakeModelHost()
    policy = make_eviction_policy("cost")
    manager = ResidencyManager(budget, host, policy, FakeClock(), wait_s=wait_s)
    manager.register(specs)
    return manager, host


async def test_a_budget_that_holds_every_model_loads_them_all_smallest_first() -> None:
    specs = [make_spec("a", 300), make_spec("b", 200), make_spec("c", 100)]
    manager, host = make_manager(1000, specs)
    assert await manager.fill(specs, {}) == ["c", "b", "a"]
    assert all(manager.state(s.key) is ModelState.READY for s in specs)
    assert manager.table.used_bytes() == 600
    assert host.evicted == []


async def test_under_pressure_it_leaves_room_for_batches_and_evicts_nothing() -> None:
    specs = [make_spec(n, b) for n, b in (("w", 400), ("x", 300), ("y", 250), ("z", 200))]
    manager, host = make_manager(1000, specs)  # 1,150 bytes of weights
    await manager.ensure_loaded(specs[1])  # x: a preloaded model stays
    loaded = await manager.fill(specs, {})
    assert loaded == ["z", "y"]  # 300 + 200 + 250 = 750; w (400) would pass 900
    assert manager.table.used_bytes() <= 1000 * FILL_SHARE
    assert manager.state("w") is ModelState.UNLOADED
    assert host.evicted == []


async def test_remembered_demand_comes_before_size() -> None:
    specs = [make_spec(n, b) for n, b in (("w", 400), ("x", 300), ("y", 250), ("z", 200))]
    manager, _ = make_manager(1000, specs)
    assert await manager.fill(specs, {"w": 40, "y": 3}) == ["w", "y", "z"]  # 850; x passes 900


async def test_a_model_that_fails_to_load_is_its_state_and_the_fill_goes_on() -> None:
    specs = [make_spec("bad", 100, fail_load=True), make_spec("good", 200)]
    manager, _ = make_manager(1000, specs)
    assert await manager.fill(specs, {}) == ["good"]
    assert manager.state("bad") is ModelState.FAILED


async def test_a_model_filled_in_is_not_protected_from_the_first_caller() -> None:
    """A speculative load is evicted at once for a model asked for, not kept
    fresh for seconds while the caller waits (wait_s 0: it would fail)."""
    specs = [make_spec(n, b) for n, b in (("w", 600), ("x", 300), ("y", 250))]
    manager, host = make_manager(1000, specs, wait_s=0.0)
    assert await manager.fill(specs, {}) == ["y", "x"]
    await manager.ensure_loaded(specs[0])
    assert manager.state("w") is ModelState.READY
    assert host.evicted


async def test_a_budget_that_every_model_fills_exactly_is_filled_whole() -> None:
    specs = [make_spec("a", 300), make_spec("b", 300), make_spec("c", 400)]
    manager, _ = make_manager(1000, specs)  # every model fits: no share is left free
    assert await manager.fill(specs, {}) == ["a", "b", "c"]
    assert manager.table.used_bytes() == 1000


async def test_under_pressure_a_model_that_fits_the_budget_but_not_the_share_waits() -> None:
    specs = [make_spec(n, b) for n, b in (("a", 300), ("b", 300), ("c", 350), ("d", 500))]
    manager, host = make_manager(1000, specs)
    assert await manager.fill(specs, {}) == ["a", "b"]  # c: 950 fits 1000, not 900
    assert manager.table.used_bytes() == 600
    assert host.loads["c"] == 0


async def test_only_remembered_demand_goes_before_size() -> None:
    specs = [make_spec("small", 100), make_spec("asked", 200), make_spec("big", 300)]
    manager, _ = make_manager(1000, specs)
    assert await manager.fill(specs, {"asked": 1}) == ["asked", "small", "big"]


async def test_a_model_that_does_not_fit_is_passed_over_for_the_next() -> None:
    specs = [make_spec("big", 800), make_spec("loaded", 300), make_spec("small", 100)]
    manager, _ = make_manager(1000, specs)
    await manager.ensure_loaded(specs[1])
    assert await manager.fill(specs, {"big": 9, "loaded": 5}) == ["small"]


async def test_it_loads_nothing_while_a_caller_waits_for_room() -> None:
    clock = FakeClock()
    host = FakeModelHost(clock)
    manager = ResidencyManager(1000, host, make_eviction_policy("cost"), clock, wait_s=60)
    big, other, small = make_spec("big", 600), make_spec("other", 600), make_spec("small", 100)
    manager.register([big, other, small])
    lease = await manager.acquire(big, 0)  # pinned: the other waits for room
    waiting = asyncio.ensure_future(manager.ensure_loaded(other))
    await asyncio.sleep(0)
    assert await manager.fill([small], {}) == []
    assert manager.state("small") is ModelState.UNLOADED
    manager.release(lease)
    await waiting
