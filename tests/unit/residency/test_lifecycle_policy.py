"""Residency's part in the model lifecycle, with fake models and a fake clock:
a kept version is never evicted for its successor, a retired model leaves the
budget, the catalogue and its measurements, and a request whose own batch
could never fit is refused (413) before it queues, once the model is measured."""

from __future__ import annotations

import pytest

from builders import make_spec
from harness.fake_host import FakeModelHost
from tessera.clock import FakeClock
from tessera.errors import (
    ModelTooLargeError,
    ModelUnavailableError,
    OverloadedError,
    RequestTooLargeError,
)
from tessera.residency import ModelState, ResidencyManager, make_eviction_policy
from tessera.residency.activation import ActivationBook


def make_manager(budget: int = 1000) -> tuple[ResidencyManager, FakeModelHost, FakeClock]:
    host, clock = FakeModelHost(), FakeClock()
    manager = ResidencyManager(budget, host, make_eviction_policy("lru"), clock, wait_s=0.0)
    return manager, host, clock


def state(manager: ResidencyManager, name: str) -> str | None:
    return {m.name: m.state for m in manager.stats().models}.get(name)


async def test_a_kept_model_is_not_evicted_for_another_and_is_once_released() -> None:
    manager, _host, clock = make_manager(1000)
    await manager.ensure_loaded(make_spec("old", 600))
    manager.keep("old")
    clock.advance(1.0)
    with pytest.raises(OverloadedError):  # the only victim is kept: no room, no wait
        await manager.ensure_loaded(make_spec("new", 600))
    assert state(manager, "old") == "ready"
    manager.keep("old", kept=False)
    clock.advance(1.0)
    await manager.ensure_loaded(make_spec("new", 600))
    assert (state(manager, "old"), state(manager, "new")) == ("unloaded", "ready")


async def test_keeping_one_model_leaves_the_others_evictable() -> None:
    manager, _host, clock = make_manager(1000)
    await manager.ensure_loaded(make_spec("kept", 400))
    clock.advance(1.0)
    await manager.ensure_loaded(make_spec("idle", 400))
    manager.keep("kept")
    clock.advance(1.0)
    await manager.ensure_loaded(make_spec("new", 400))
    assert {m.name: m.state for m in manager.stats().models} == {
        "kept": "ready",
        "idle": "unloaded",  # evicted although used more recently than the kept one
        "new": "ready",
    }


async def test_a_retired_model_leaves_the_budget_the_catalogue_and_its_measurements() -> None:
    manager, host, _clock = make_manager(1000)
    spec = make_spec("gone", 300)
    manager.register([spec, make_spec("stays", 200)])
    await manager.ensure_loaded(spec)
    manager.observe_batch("gone", 100, 10)
    manager.keep("gone")
    assert manager.activation_bytes_per_unit("gone") == 10
    assert manager.catalogue_bytes() == 500
    await manager.retire("gone")
    assert manager.stats().used_bytes == 0
    assert [m.name for m in manager.stats().models] == ["stays"]
    assert manager.catalogue_bytes() == 200
    assert manager.activation_bytes_per_unit("gone") is None
    assert manager.measured("gone") is None
    assert host.unloads["gone"] == 1
    # Registered again, it starts afresh: not kept, nothing known of it.
    manager.register([spec])
    await manager.ensure_loaded(spec)
    assert state(manager, "gone") == ModelState.READY.value


def test_the_activation_book_forgets_a_model() -> None:
    book = ActivationBook()
    book.observe("a", 100, 10)
    book.observe("b", 50, 10)
    book.forget("a")
    book.forget("never-seen")
    assert book.of("a").num_samples == 0
    assert book.of("a").reserve_bytes(10) == 0
    assert book.of("b").reserve_bytes(10) == 50


async def test_a_batch_is_refused_for_good_once_two_of_no_more_units_needed_more() -> None:
    manager, _host, _clock = make_manager(1000)
    spec = make_spec("m", 600)
    manager.raise_if_never_fits(spec, 1_000_000)  # nothing known yet: nothing refused
    await manager.ensure_loaded(spec)
    manager.raise_if_never_fits(spec, 1_000_000)  # weights known, no batch measured yet
    manager.observe_batch("m", 100, 10)  # 10 bytes a unit
    # An estimate (10,000,000 bytes) refuses nothing: the batch runs in the room there is.
    manager.raise_if_never_fits(spec, 1_000_000)
    manager.observe_batch("m", 500, 40)  # one batch of 40 units over the room of 400 ...
    manager.raise_if_never_fits(spec, 40)  # ... may have been its first run's one-off cost
    manager.observe_batch("m", 450, 40)  # a second one: 40 units need 450 at least
    with pytest.raises(RequestTooLargeError) as refused:
        manager.raise_if_never_fits(spec, 40)  # 600 + 450 > 1000
    assert refused.value.activation_bytes == 450
    with pytest.raises(RequestTooLargeError):
        manager.raise_if_never_fits(spec, 1_000)  # more units need no less
    manager.raise_if_never_fits(spec, 39)  # of 39 units, one batch of 10 is all that is known


async def test_a_models_own_cap_refuses_the_batch_before_the_budget_does() -> None:
    manager, _host, _clock = make_manager(10_000)
    spec = make_spec("capped", 600, max_bytes=700)
    await manager.ensure_loaded(spec)
    for peak in (100, 100, 120):
        manager.observe_batch("capped", peak, 10)
    manager.raise_if_never_fits(spec, 10)  # 600 + 100: exactly its cap
    manager.observe_batch("capped", 101, 10)
    with pytest.raises(RequestTooLargeError, match="its cap"):
        manager.raise_if_never_fits(spec, 10)


async def test_weights_over_the_cap_are_too_large_not_a_request_too_large() -> None:
    manager, _host, _clock = make_manager(10_000)
    with pytest.raises(ModelTooLargeError, match="over its cap of 500 bytes"):
        await manager.ensure_loaded(make_spec("big", 600, max_bytes=500))


async def test_a_retired_model_is_forgotten_by_every_part() -> None:
    host, clock = FakeModelHost(), FakeClock()
    manager = ResidencyManager(1000, host, make_eviction_policy("lru"), clock, wait_s=0.0)
    spec, bad = make_spec("gone", 600), make_spec("bad", 100, fail_load=True)
    manager.register([spec, bad])
    await manager.ensure_loaded(spec)  # fresh: loaded for a caller, no batch yet
    manager.keep("gone")
    with pytest.raises(ModelUnavailableError):
        await manager.ensure_loaded(bad)
    await manager.retire("gone")
    await manager.retire("bad")
    await manager.retire("never-registered")  # nothing to forget
    assert manager._loads.spec("gone") is None
    assert "gone" not in manager._fresh.names()
    # Registered again, each starts afresh: the failed one is not backed off,
    # the kept one is evicted for another like any idle model.
    good_again = make_spec("bad", 100)
    manager.register([spec, good_again])
    await manager.ensure_loaded(good_again)
    await manager.fill([spec], {})  # loaded, not fresh (no caller waited)
    clock.advance(1.0)
    await manager.ensure_loaded(make_spec("new", 600))
    assert state(manager, "gone") == "unloaded"
