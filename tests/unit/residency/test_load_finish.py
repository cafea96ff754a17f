"""The end of a load (``ModelLoads.finish``): from the host tier where the
evicted model waits there (a runtime that sleeps and wakes its engine, as
vLLM's sleep mode), else from its files; measured at its first load and
settled into the budget, evicting idle models where the measurement is above
the estimate, or giving the bytes back; a failure is the model's state and a
cancelled load leaves it unloaded. Exact figures, fake models and host, a fake
clock that autojumps."""

from __future__ import annotations

import asyncio
import logging

import pytest

from builders import make_lru_manager, make_spec, residency_of
from tessera.errors import ModelTooLargeError, ModelUnavailableError, OverloadedError
from tessera.repository import ModelSpec
from tessera.residency import ModelState, ResidencyManager
from tessera.residency.manager import LOAD_FAILED


async def use(manager: ResidencyManager, spec: ModelSpec) -> None:
    manager.release(await manager.acquire(spec, 0))


# -- from the files, from the host tier ----------------------------------------


async def test_a_load_from_files_records_its_seconds_and_how_long_its_caller_waited() -> None:
    manager, host, clock = make_lru_manager()
    clock.advance(2.0)
    await use(manager, make_spec("a", 600, load_s=1.0))
    a = residency_of(manager, "a")
    assert (a.state, a.loads, a.host_loads, a.measured_by) == ("ready", 1, 0, "fake")
    assert (a.load_s, a.files_load_s, a.host_load_s) == (1.0, 1.0, None)
    assert a.miss_s == 1.0  # asked at 2 s, ready at 3 s
    assert a.last_used == 3.0
    assert (manager.stats().loads_total, manager.stats().host_loads_total) == (1, 0)
    assert host.loads["a"] == 1


async def test_an_evicted_model_comes_back_from_the_host_tier_not_its_files() -> None:
    manager, host, clock = make_lru_manager(1000, host_budget=1000)
    a = make_spec("a", 600, host_tier=True, load_s=1.0)
    await use(manager, a)  # from its files: 1 s
    await use(manager, make_spec("b", 600, load_s=1.0))  # a goes to the host tier
    assert (host.offloads["a"], host.unloads["a"]) == (1, 0)
    clock.advance(3.0)
    await use(manager, a)  # woken: no time on this clock
    assert (host.loads["a"], host.restores["a"]) == (1, 1)
    back = residency_of(manager, "a")
    assert (back.state, back.loads, back.host_loads) == ("ready", 2, 1)
    assert (back.load_s, back.files_load_s, back.host_load_s) == (0.0, 1.0, 0.0)
    assert back.miss_s == 0.5  # the mean of 1 s (from files) and 0 s (from the tier)
    assert back.last_used == 5.0
    assert back.host_tier is False
    stats = manager.stats()
    assert (stats.loads_total, stats.host_loads_total, stats.host_used_bytes) == (3, 1, 0)


async def test_a_model_that_does_not_come_back_from_the_host_tier_loads_from_its_files() -> None:
    manager, host, _ = make_lru_manager(1000, host_budget=1000)
    a = make_spec("a", 600, host_tier=True, fail_restore=True, load_s=1.0)
    await use(manager, a)
    await use(manager, make_spec("b", 600))
    assert host.offloads["a"] == 1
    await use(manager, a)
    assert (host.loads["a"], host.restores["a"]) == (2, 0)
    back = residency_of(manager, "a")
    assert (back.state, back.host_loads, back.load_s, back.host_load_s) == ("ready", 0, 1.0, None)
    assert manager.stats().host_used_bytes == 0


# -- failures -----------------------------------------------------------------


async def test_a_failed_load_is_the_models_state_with_its_cause_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, host, _ = make_lru_manager()
    with (
        caplog.at_level(logging.ERROR, logger="tessera.residency.load"),
        pytest.raises(ModelUnavailableError) as failed,
    ):
        await manager.ensure_loaded(make_spec("bad", 300, fail_load=True))
    assert (failed.value.name, failed.value.reason) == ("bad", LOAD_FAILED)
    assert failed.value.retry_after_s == 2.0
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert manager.state("bad") is ModelState.FAILED
    assert manager.error("bad") == "load failed: RuntimeError: fake load failure"
    assert [r.getMessage() for r in caplog.records] == [
        "model bad failed to load, retried in 2 s: RuntimeError: fake load failure"
    ]
    assert manager.stats().used_bytes == 0
    assert host.unloads == {}
    with pytest.raises(ModelUnavailableError) as waiting:
        await manager.ensure_loaded(make_spec("bad", 300, fail_load=True))
    assert waiting.value.reason == f"{LOAD_FAILED}; retried in 2s"
    assert waiting.value.retry_after_s == 2.0
    assert host.loads["bad"] == 1  # refused within its backoff, not tried


async def test_a_success_after_failures_starts_the_backoff_again() -> None:
    manager, _, clock = make_lru_manager()
    for window in (2.0, 4.0):
        with pytest.raises(ModelUnavailableError) as failed:
            await manager.ensure_loaded(make_spec("m", 100, fail_load=True))
        assert failed.value.retry_after_s == window
        clock.advance(window)
    await manager.ensure_loaded(make_spec("m", 100))
    assert manager.error("m") is None
    await manager.unload("m")
    with pytest.raises(ModelUnavailableError) as failed:
        await manager.ensure_loaded(make_spec("m", 100, fail_load=True))
    assert failed.value.retry_after_s == 2.0


async def test_a_cancelled_load_leaves_the_model_unloaded_not_failed() -> None:
    manager, host, _ = make_lru_manager(wait_s=30.0)
    spec = make_spec("a", 600)
    host.gates["a"] = asyncio.Event()
    loading = asyncio.ensure_future(manager.ensure_loaded(spec))
    await asyncio.sleep(0)
    assert (manager.state("a"), manager.stats().used_bytes) == (ModelState.LOADING, 600)
    loading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loading
    assert (manager.state("a"), manager.error("a")) == (ModelState.UNLOADED, None)
    assert manager.stats().used_bytes == 0
    host.gates["a"].set()
    await manager.ensure_loaded(spec)  # no backoff: loaded again at once
    assert (host.loads["a"], manager.state("a")) == (2, ModelState.READY)


async def test_a_model_measured_over_its_cap_fails_for_good_and_is_not_loaded_again() -> None:
    manager, host, clock = make_lru_manager(10_000)
    spec = make_spec("big", 600, estimate_bytes=400, max_bytes=500)
    with pytest.raises(ModelTooLargeError) as refused:
        await manager.ensure_loaded(spec)  # the estimate fitted the cap
    assert (refused.value.name, refused.value.reason) == (
        "big",
        "needs 600 bytes, over its cap of 500 bytes",
    )
    assert (host.loads["big"], host.unloads["big"]) == (1, 1)
    assert manager.state("big") is ModelState.FAILED
    assert manager.error("big") == "needs 600 bytes, over its cap of 500 bytes"
    assert manager.stats().used_bytes == 0
    with pytest.raises(ModelUnavailableError, match="over its cap of 500 bytes") as waiting:
        await manager.ensure_loaded(spec)
    assert waiting.value.retry_after_s == 2.0
    clock.advance(2.0)
    with pytest.raises(ModelTooLargeError):
        await manager.ensure_loaded(spec)  # its measurement refuses it before a load
    assert host.loads["big"] == 1


async def test_a_model_measured_over_the_budget_fails_for_good() -> None:
    manager, host, _ = make_lru_manager(1000)
    with pytest.raises(ModelTooLargeError) as refused:
        await manager.ensure_loaded(make_spec("big", 1200, estimate_bytes=400))
    assert refused.value.reason == "needs 1200 bytes, over the whole budget of 1000 bytes"
    assert host.unloads["big"] == 1


async def test_a_model_measured_at_exactly_the_budget_loads() -> None:
    manager, _, _ = make_lru_manager(1000)
    await manager.ensure_loaded(make_spec("whole", 1000, estimate_bytes=900))
    assert (manager.state("whole"), manager.stats().used_bytes) == (ModelState.READY, 1000)


# -- measured above the estimate ----------------------------------------------


async def test_a_load_measured_above_its_estimate_evicts_just_what_it_lacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, host, clock = make_lru_manager(1000)
    await use(manager, make_spec("b", 200))
    clock.advance(1.0)
    await use(manager, make_spec("c", 300))
    clock.advance(1.0)
    with caplog.at_level(logging.INFO, logger="tessera.residency.load"):
        await use(manager, make_spec("a", 600, estimate_bytes=300))  # 300 more than held
    assert host.evicted == ["b"]  # 100 short: the oldest idle model is enough
    assert [r.getMessage() for r in caplog.records] == [
        "evicting b to free 100 bytes for a, measured above its estimate; 200 free"
    ]
    assert (manager.state("a"), manager.state("c")) == (ModelState.READY, ModelState.READY)
    assert manager.stats().used_bytes == 900


async def test_a_load_measured_above_its_estimate_with_no_room_gives_its_bytes_back() -> None:
    manager, host, _ = make_lru_manager(1000)
    busy = await manager.acquire(make_spec("b", 300), 0)
    with pytest.raises(OverloadedError) as refused:
        await manager.ensure_loaded(make_spec("a", 800, estimate_bytes=500))
    assert str(refused.value) == (
        "model 'a' measured 800 bytes, more than expected, and there is no room now"
    )
    assert refused.value.retry_after_s == 1.0
    assert (host.loads["a"], host.unloads["a"], host.evicted) == (1, 1, [])
    assert (manager.state("a"), manager.error("a")) == (ModelState.UNLOADED, None)
    assert manager.stats().used_bytes == 300
    manager.release(busy)
    await manager.ensure_loaded(make_spec("a", 800, estimate_bytes=500))
    assert host.evicted == ["b"]  # the measured figure reserved up front
    assert (host.loads["a"], manager.stats().used_bytes) == (2, 800)


async def test_a_speculative_load_measured_above_its_estimate_evicts_nothing() -> None:
    manager, host, _ = make_lru_manager(1000)
    await use(manager, make_spec("b", 200))
    assert await manager.fill([make_spec("a", 900, estimate_bytes=300)], {}) == []
    assert (host.evicted, host.unloads["a"]) == ([], 1)
    assert (manager.state("a"), manager.state("b")) == (ModelState.UNLOADED, ModelState.READY)
    assert manager.stats().used_bytes == 200


async def test_a_reload_keeps_the_first_measurement() -> None:
    manager, _, _ = make_lru_manager(1000)
    await manager.ensure_loaded(make_spec("a", 300))
    await manager.unload("a")
    await manager.ensure_loaded(make_spec("a", 500))  # reports more now: not measured again
    measured = manager.measured("a")
    assert measured is not None
    assert measured.total_bytes == 300
    assert manager.stats().used_bytes == 300


# -- fresh or speculative -----------------------------------------------------


async def test_a_load_for_a_caller_is_fresh_and_a_fill_is_not() -> None:
    manager, _, _ = make_lru_manager(1000)
    loaded, filled = make_spec("loaded", 300), make_spec("filled", 300)
    manager.table.begin_load("loaded", manager._catalogue.expected(loaded))
    await manager._loads.track(loaded, manager._loads.finish(loaded, 0.0))
    assert await manager.fill([filled], {}) == ["filled"]
    assert manager._fresh.names() == {"loaded"}
