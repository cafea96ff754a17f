"""Filling an idle budget at start (``ResidencyManager.fill``), with fake models
and a fake clock: what fits loads, nothing is evicted, demand orders it."""

from __future__ import annotations

from builders import make_spec
from harness.fake_host import FakeModelHost
from tessera.clock import FakeClock
from tessera.repository.spec import ModelSpec
from tessera.residency import ModelState, ResidencyManager, make_eviction_policy
from tessera.residency.manager import FILL_SHARE


def make_manager(budget: int, specs: list[ModelSpec]) -> tuple[ResidencyManager, FakeModelHost]:
    host = FakeModelHost()
    manager = ResidencyManager(budget, host, make_eviction_policy("cost"), FakeClock())
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
    manager, host = make_manager(1000, specs)
    assert await manager.fill(specs, {}) == ["y", "x"]
    await manager.ensure_loaded(specs[0])
    assert manager.state("w") is ModelState.READY
    assert host.evicted
