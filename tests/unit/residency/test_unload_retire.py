"""Taking a model out: ``unload`` (an operator's, not an eviction), ``retire``
(unload and forget in every part) and ``keep`` (never evicted while kept), to
their exact figures. Fake models and host, a fake clock that autojumps."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from builders import make_lru_manager, make_spec, residency_of
from harness.fake_host import FakeModelHost
from tessera.clock import FakeClock
from tessera.errors import ModelUnavailableError, OverloadedError
from tessera.repository.spec import BatchingSpec
from tessera.residency import ModelState, ResidencyManager, make_eviction_policy
from tessera.residency.activation import ActivationBook
from tessera.residency.manager import HOLD_SLACK_S

# -- unload -------------------------------------------------------------------


async def test_unload_frees_an_idle_model_and_is_no_eviction() -> None:
    manager, host, _ = make_lru_manager()
    await manager.ensure_loaded(make_spec("a", 600))
    assert await manager.unload("a") is True
    assert (host.unloads["a"], host.evicted) == (1, [])
    stats = manager.stats()
    assert (stats.used_bytes, stats.loads_total, stats.evictions_total) == (0, 1, 0)
    assert (residency_of(manager, "a").state, residency_of(manager, "a").evictions) == (
        "unloaded",
        0,
    )


async def test_unload_of_a_model_not_on_the_device_is_false_and_unloads_nothing() -> None:
    manager, host, _ = make_lru_manager()
    await manager.ensure_loaded(make_spec("a", 600))
    await manager.unload("a")
    assert await manager.unload("a") is False  # unloaded already
    assert await manager.unload("never-seen") is False
    with pytest.raises(ModelUnavailableError):
        await manager.ensure_loaded(make_spec("bad", 100, fail_load=True))
    assert await manager.unload("bad") is False
    assert manager.state("bad") is ModelState.FAILED  # still backed off
    assert host.unloads == {"a": 1}


async def test_unload_waits_for_the_running_batch_then_unloads() -> None:
    manager, host, clock = make_lru_manager(wait_s=30.0)
    lease = await manager.acquire(make_spec("a", 600), 100)
    unloading = asyncio.ensure_future(manager.unload("a"))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not unloading.done()
    assert host.unloads["a"] == 0
    manager.release(lease)
    assert await unloading is True
    assert host.unloads["a"] == 1
    assert clock.now() == 0.0  # woken by the release, not by a timeout


async def test_unload_of_a_pinned_model_gives_up_at_its_deadline() -> None:
    manager, host, _ = make_lru_manager(wait_s=0.0)
    lease = await manager.acquire(make_spec("a", 600), 0)
    with pytest.raises(OverloadedError, match="model 'a': other models are busy") as refused:
        await manager.unload("a")
    assert refused.value.retry_after_s == 1.0
    assert (manager.state("a"), host.unloads["a"]) == (ModelState.READY, 0)
    manager.release(lease)


async def test_unload_during_the_models_load_waits_for_it_then_unloads() -> None:
    manager, host, _ = make_lru_manager(wait_s=30.0)
    spec = make_spec("a", 600)
    gate = host.gates["a"] = asyncio.Event()
    loading = asyncio.ensure_future(manager.ensure_loaded(spec))
    await asyncio.sleep(0)
    assert manager.state("a") is ModelState.LOADING
    unloading = asyncio.ensure_future(manager.unload("a"))
    await asyncio.sleep(0)
    assert not unloading.done()
    gate.set()
    await loading
    assert await unloading is True
    assert (host.loads["a"], host.unloads["a"], manager.state("a")) == (
        1,
        1,
        ModelState.UNLOADED,
    )


async def test_two_unloads_of_one_model_unload_it_once() -> None:
    manager, host, _ = make_lru_manager(wait_s=30.0)
    await manager.ensure_loaded(make_spec("a", 600))
    first, second = await asyncio.gather(manager.unload("a"), manager.unload("a"))
    assert (first, second) == (True, False)  # the second waited for the first's unload
    assert host.unloads["a"] == 1


async def test_unload_gives_back_the_room_kept_for_the_next_batch_at_once() -> None:
    clock = FakeClock()
    host = FakeModelHost(clock)
    manager = ResidencyManager(1000, host, make_eviction_policy("cost", clock), clock, wait_s=60)
    ocr = replace(
        make_spec("ocr", 100, batching=BatchingSpec(max_wait_ms=500)), latency_target_ms=3_000
    )
    chat = replace(make_spec("chat", 400, load_s=0.5), latency_target_ms=10_000)
    manager.register([ocr, chat])
    manager.release(await manager.acquire(chat, 0))
    page = await manager.acquire(ocr, 600)  # evicts chat
    waiting = asyncio.ensure_future(manager.ensure_loaded(chat))
    await clock.sleep(0.01)
    now = clock.now()
    manager.release(page, next_batch_s=1.0)  # another page queued: its room is kept
    assert residency_of(manager, "ocr").bytes == 700  # for 0.5 s and HOLD_SLACK_S
    assert HOLD_SLACK_S > 0
    assert await manager.unload("ocr") is True
    assert clock.now() == now  # at once, not when the hold ends
    await waiting
    assert (host.unloads["ocr"], manager.state("chat")) == (1, ModelState.READY)


async def test_unload_takes_a_copy_out_of_the_host_tier_and_never_offloads() -> None:
    manager, host, clock = make_lru_manager(1000, host_budget=1000)
    kept = make_spec("a", 600, host_tier=True)
    await manager.ensure_loaded(kept)
    assert await manager.unload("a") is True  # an operator's unload: freed, not kept
    assert (host.offloads["a"], host.unloads["a"], host.evicted) == (0, 1, [])
    await manager.ensure_loaded(kept)
    clock.advance(1.0)
    await manager.ensure_loaded(make_spec("b", 600))  # evicts a into the host tier
    assert (host.offloads["a"], manager.stats().host_used_bytes) == (1, 600)
    assert await manager.unload("a") is False  # not on the device ...
    assert host.drops["a"] == 1  # ... but its copy is dropped
    assert manager.stats().host_used_bytes == 0


# -- keep ---------------------------------------------------------------------


async def test_keep_protects_by_default_until_released() -> None:
    manager, host, clock = make_lru_manager()
    await manager.ensure_loaded(make_spec("old", 600))
    manager.keep("old")  # kept=True is the default
    clock.advance(1.0)
    with pytest.raises(OverloadedError):
        await manager.ensure_loaded(make_spec("new", 600))
    assert host.evicted == []
    manager.keep("old", False)
    clock.advance(1.0)
    await manager.ensure_loaded(make_spec("new", 600))
    assert host.evicted == ["old"]


async def test_keeping_one_name_protects_no_other() -> None:
    manager, host, clock = make_lru_manager()
    await manager.ensure_loaded(make_spec("a", 400))
    clock.advance(1.0)
    await manager.ensure_loaded(make_spec("b", 400))
    manager.keep("b")
    manager.keep("never-loaded", kept=False)  # releasing a name never kept is nothing
    clock.advance(1.0)
    await manager.ensure_loaded(make_spec("c", 400))
    assert host.evicted == ["a"]
    clock.advance(1.0)
    manager.keep("c")
    with pytest.raises(OverloadedError):  # b and c kept: nothing to evict
        await manager.ensure_loaded(make_spec("d", 400))


# -- retire -------------------------------------------------------------------


async def test_retire_unloads_and_forgets_every_figure_of_the_model() -> None:
    manager, host, _ = make_lru_manager(1000)
    gone, stays = make_spec("gone", 300, shared={"enc": 100}), make_spec("stays", 200)
    manager.register([gone, stays])
    await manager.ensure_loaded(gone)
    manager.observe_batch("gone", 100, 10)
    assert (manager.catalogue_bytes(), manager.measured("gone") is not None) == (600, True)
    await manager.retire("gone")
    assert (host.unloads["gone"], host.evicted) == (1, [])
    stats = manager.stats()
    assert (stats.used_bytes, [m.name for m in stats.models]) == (0, ["stays"])
    assert manager.state("gone") is ModelState.UNLOADED
    assert manager.catalogue_bytes() == 200
    assert manager.measured("gone") is None
    assert manager.activation_bytes_per_unit("gone") is None
    assert manager._loads.spec("gone") is None


async def test_retiring_a_name_never_registered_is_nothing() -> None:
    manager, host, _ = make_lru_manager()
    manager.register([make_spec("a", 100)])
    await manager.retire("never-registered")
    assert [m.name for m in manager.stats().models] == ["a"]
    assert manager.catalogue_bytes() == 100
    assert host.unloads == {}


async def test_a_retired_failed_model_starts_afresh_with_no_failures_counted() -> None:
    manager, host, clock = make_lru_manager()
    for window in (2.0, 4.0):
        with pytest.raises(ModelUnavailableError) as failed:
            await manager.ensure_loaded(make_spec("m", 100, fail_load=True))
        assert failed.value.retry_after_s == window
        clock.advance(window)
    await manager.retire("m")
    assert manager.error("m") is None
    with pytest.raises(ModelUnavailableError) as failed:
        await manager.ensure_loaded(make_spec("m", 100, fail_load=True))  # tried at once
    assert failed.value.retry_after_s == 2.0  # the first failure of a new row, not the third
    await manager.retire("m")
    await manager.ensure_loaded(make_spec("m", 100))
    assert (host.loads["m"], manager.state("m"), clock.now()) == (4, ModelState.READY, 6.0)


async def test_a_retired_kept_model_registered_again_is_evicted_like_any_other() -> None:
    manager, host, clock = make_lru_manager()
    spec = make_spec("v1", 600)
    await manager.ensure_loaded(spec)
    manager.keep("v1")
    await manager.retire("v1")
    await manager.fill([spec], {})  # back, loaded by the fill: neither kept nor fresh
    assert manager.state("v1") is ModelState.READY
    clock.advance(1.0)
    await manager.ensure_loaded(make_spec("v2", 600))
    assert host.evicted == ["v1"]


async def test_a_retired_fresh_model_is_fresh_no_more() -> None:
    manager, _, _ = make_lru_manager()
    spec = make_spec("m", 600)
    manager.table.begin_load("m", manager._catalogue.expected(spec))
    await manager._loads.track(spec, manager._loads.finish(spec, 0.0))
    assert manager._fresh.names() == {"m"}  # loaded for a caller, no batch yet
    await manager.retire("m")
    assert manager._fresh.names() == set()


def test_the_activation_book_forgets_one_model_only() -> None:
    book = ActivationBook()
    book.observe("a", 100, 10)
    book.observe("b", 50, 10)
    book.forget("a")
    book.forget("never-seen")
    assert (book.of("a").num_samples, book.of("a").reserve_bytes(10)) == (0, 0)
    assert (book.of("b").num_samples, book.of("b").reserve_bytes(10)) == (1, 50)


async def test_a_retired_model_registered_again_is_measured_afresh() -> None:
    manager, _, _ = make_lru_manager()
    await manager.ensure_loaded(make_spec("m", 300))
    await manager.retire("m")
    changed = replace(make_spec("m", 400), options={"own_bytes": 400, "shared": {}})
    await manager.ensure_loaded(changed)
    measured = manager.measured("m")
    assert measured is not None
    assert measured.total_bytes == 400
    assert manager.stats().used_bytes == 400
