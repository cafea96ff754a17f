"""The residency manager's read side (stats, errors, room) and the batch plan,
with fake models, a fake clock and no waiting (``wait_s=0``)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
from tessera.footprint import Footprint
from tessera.repository import ModelSpec
from tessera.request import QueuedRequest, RequestResult
from tessera.residency import ModelState, ResidencyManager, make_eviction_policy
from tessera.residency.activation import ActivationBook
from tessera.residency.manager import LOAD_FAILED
from tessera.residency.plan import items_peak_units, peak_units, split_to_fit
from tessera.runtimes.base import LoadedModel
from tessera.tasks.types import Task


def make_manager(budget: int = 1000) -> tuple[ResidencyManager, FakeModelHost, FakeClock]:
    host, clock = FakeModelHost(), FakeClock()
    manager = ResidencyManager(budget, host, make_eviction_policy("lru"), clock, wait_s=0.0)
    return manager, host, clock


async def test_stats_report_every_models_figures() -> None:
    manager, _host, clock = make_manager(1000)
    enc = {"enc": 301}
    clock.advance(2.0)
    await manager.ensure_loaded(make_spec("a", 100, shared=enc))
    clock.advance(1.0)
    lease = await manager.acquire(make_spec("b", 200, shared=enc), 50)
    with pytest.raises(ModelUnavailableError):
        await manager.acquire(make_spec("bad", 10, fail_load=True), 0)
    stats = manager.stats()
    assert (stats.budget_bytes, stats.used_bytes) == (1000, 651)
    assert stats.peak_used_bytes == 661  # with the 10 bytes the failed load held
    assert (stats.loads_total, stats.evictions_total) == (2, 0)
    assert (stats.host_budget_bytes, stats.host_used_bytes) == (0, 0)  # no host tier
    assert (stats.host_loads_total, stats.host_drops_total) == (0, 0)
    by_name = {m.name: m for m in stats.models}
    a, b, bad = by_name["a"], by_name["b"], by_name["bad"]
    assert (a.state, a.bytes, a.weights_bytes) == ("ready", 100 + 150, 401)
    assert (b.state, b.bytes, b.weights_bytes) == ("ready", 200 + 50 + 150, 501)
    assert (a.last_used, b.last_used) == (2.0, 3.0)
    assert (a.loads, a.evictions, a.pins, b.pins) == (1, 0, 0, 1)
    assert (a.error, a.measured_by) == (None, "fake")
    assert (bad.state, bad.bytes, bad.weights_bytes, bad.loads) == ("failed", 0, 0, 0)
    assert bad.error is not None
    assert "fake load failure" in bad.error
    assert bad.measured_by is None
    manager.release(lease)
    await manager.unload("a")
    stats = manager.stats()
    assert stats.used_bytes == 501
    assert stats.peak_used_bytes == 661  # the peak stays
    by_name = {m.name: m for m in stats.models}
    assert (by_name["a"].state, by_name["a"].bytes) == ("unloaded", 0)
    assert by_name["b"].bytes == 501  # the component is all b's now


async def test_stats_count_evictions() -> None:
    manager, _host, clock = make_manager(1000)
    await manager.ensure_loaded(make_spec("a", 600))
    clock.advance(1.0)
    await manager.ensure_loaded(make_spec("b", 600))
    stats = manager.stats()
    assert (stats.loads_total, stats.evictions_total) == (2, 1)
    assert {m.name: m.evictions for m in stats.models} == {"a": 1, "b": 0}


async def test_error_and_retry_window_of_a_failed_load() -> None:
    manager, host, clock = make_manager(1000)
    spec = make_spec("bad", 100, fail_load=True)
    assert manager.error("bad") is None
    assert manager.state("bad") is ModelState.UNLOADED
    with pytest.raises(ModelUnavailableError) as failed:
        await manager.acquire(spec, 0)
    assert failed.value.retry_after_s == 2.0
    assert "fake load failure" not in str(failed.value)  # the cause is the log's
    error = manager.error("bad")
    assert error is not None
    assert error.startswith("load failed: RuntimeError: fake load failure")
    clock.advance(1.9)
    with pytest.raises(ModelUnavailableError, match="load failed") as refused:
        await manager.acquire(spec, 0)  # within 2 s: refused without a try
    assert refused.value.retry_after_s == pytest.approx(0.1)
    assert host.loads["bad"] == 1
    clock.advance(0.1)
    with pytest.raises(ModelUnavailableError):
        await manager.acquire(spec, 0)  # the window passed: tried again
    assert host.loads["bad"] == 2
    assert manager.table.activation_bytes_held() == 0
    manager.raise_if_failed("never-seen")  # no entry: nothing to say


async def test_failed_loads_back_off_exponentially_within_a_cap_and_reset_on_success() -> None:
    host, clock = FakeModelHost(), FakeClock()
    manager = ResidencyManager(
        1000,
        host,
        make_eviction_policy("lru"),
        clock,
        wait_s=0.0,
        failed_retry_s=1.0,
        failed_retry_max_s=5.0,
    )
    bad = make_spec("m", 100, fail_load=True)
    windows = []
    for _ in range(5):
        with pytest.raises(ModelUnavailableError) as failed:
            await manager.acquire(bad, 0)
        assert failed.value.retry_after_s is not None
        windows.append(failed.value.retry_after_s)
        clock.advance(failed.value.retry_after_s)
    assert windows == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert host.loads["m"] == 5
    await manager.ensure_loaded(make_spec("m", 100))  # the weights are fixed: it loads
    assert manager.state("m") is ModelState.READY
    await manager.unload("m")
    with pytest.raises(ModelUnavailableError) as failed:
        await manager.acquire(bad, 0)
    assert failed.value.retry_after_s == 1.0  # the backoff starts again


async def test_measured_footprint_is_kept_and_reused_for_reloads() -> None:
    manager, _host, _clock = make_manager(1000)
    spec = make_spec("a", 300, estimate_bytes=100, shared={"enc": 50})
    assert manager.measured("a") is None
    assert manager.activation_room(spec) == 1000 - 150  # the estimate, before a load
    await manager.ensure_loaded(spec)
    measured = manager.measured("a")
    assert measured is not None
    assert (measured.own_bytes, dict(measured.shared_bytes)) == (300, {"enc": 50})
    assert manager.activation_room(spec) == 1000 - 350
    capped = make_spec("c", 300, max_bytes=400)
    assert manager.activation_room(capped) == 100  # within its cap
    loose = make_spec("d", 300, max_bytes=1200)
    assert manager.activation_room(loose) == 700  # within the budget


async def test_close_unloads_everything() -> None:
    manager, host, _clock = make_manager(1000)
    for name in ("a", "b"):
        await manager.ensure_loaded(make_spec(name, 100))
    await manager.close()
    assert sorted(host.on_unload) == ["a", "b"]
    assert manager.table.used_bytes() == 0
    assert {manager.state(n) for n in ("a", "b")} == {ModelState.UNLOADED}
    assert await manager.unload("a") is False  # already unloaded
    assert await manager.unload("never-seen") is False


def test_fake_host_estimates_nothing_for_a_spec_without_figures() -> None:
    spec = ModelSpec(
        name="bare", task=Task.EMBEDDING, runtime="torch", adapter="fake", folder=Path("/x")
    )
    assert FakeModelHost().estimate(spec) == Footprint(0, {})


# -- ActivationBook -------------------------------------------------------------


def test_activation_book_keeps_one_window_per_model() -> None:
    book = ActivationBook(window=1)
    assert book.of("a").reserve_bytes(10) == 0
    book.observe("a", 500, 10)
    book.observe("b", 10, 10)
    assert book.of("a").reserve_bytes(2) == 100
    assert book.of("b").reserve_bytes(2) == 2
    book.observe("a", 10, 10)  # a window of one: the last batch alone
    assert book.of("a").reserve_bytes(2) == 2
    assert book.of("a") is book.of("a")
    assert book.of("a").num_samples == 2
    default = ActivationBook()
    default.observe("a", 10_000, 1)
    for _ in range(64):
        default.observe("a", 1, 1)
    assert default.of("a").reserve_bytes(1) == 1


# -- split_to_fit ---------------------------------------------------------------


@pytest.fixture
def loop() -> object:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def requests(loop: asyncio.AbstractEventLoop, units: list[float]) -> list[QueuedRequest]:
    made = []
    for i, u in enumerate(units):
        future: asyncio.Future[RequestResult] = loop.create_future()
        made.append(QueuedRequest(items=[i], units=u, arrival=0.0, future=future))
    return made


def test_batch_that_fits_runs_whole(loop: asyncio.AbstractEventLoop) -> None:
    batch = requests(loop, [1, 2, 3])
    parts = split_to_fit(batch, lambda units: int(units * 10), room_bytes=60)
    assert len(parts) == 1
    assert parts[0].requests == tuple(batch)
    assert (parts[0].units, parts[0].activation_bytes) == (6, 60)


def test_batch_is_halved_until_each_part_fits_in_order(loop: asyncio.AbstractEventLoop) -> None:
    batch = requests(loop, [1, 1, 1, 1, 1])
    parts = split_to_fit(batch, lambda units: int(units * 10), room_bytes=20)
    assert [len(p.requests) for p in parts] == [2, 1, 2]
    assert [r for p in parts for r in p.requests] == batch
    assert [p.activation_bytes for p in parts] == [20, 10, 20]
    assert all(p.activation_bytes <= 20 for p in parts)


def test_items_run_alone_count_the_largest_of_them_not_their_sum(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # Three pages (run one after another: 2, 5 and 3 units) and a request of 4
    # units run together: the batch holds 5 units' activations at its peak
    # (the largest page), and 4 + 1 once the 5-unit page is left out.
    pages = []
    for units in (2.0, 5.0, 3.0):
        future: asyncio.Future[RequestResult] = loop.create_future()
        page = QueuedRequest([0], units, 0.0, future, apart_units=units, alone_units=(units,))
        pages.append(page)
    (together,) = requests(loop, [4])
    mixed = QueuedRequest(
        [0, 1], 3.0, 0.0, loop.create_future(), apart_units=1.0, alone_units=(1.0,)
    )
    assert peak_units([*pages, together]) == 5
    assert peak_units([pages[0], together, mixed]) == 6  # 4 and mixed's 2 together
    assert items_peak_units(3.0, (), 0.0) == 3
    # A text of 300 characters spoken a sentence at a time, its longest of 40:
    # it holds 40 units' activations at its peak, beside 4 run together.
    speech = QueuedRequest(
        [0], 300.0, 0.0, loop.create_future(), apart_units=300.0, alone_units=(40.0,)
    )
    assert peak_units([speech, together]) == 40
    parts = split_to_fit([*pages, together], lambda units: int(units * 10), room_bytes=50)
    assert len(parts) == 1
    assert (parts[0].units, parts[0].peak_units, parts[0].activation_bytes) == (14, 5, 50)


def test_a_single_request_is_never_split_and_reserves_at_most_the_most_room(
    loop: asyncio.AbstractEventLoop,
) -> None:
    (only,) = requests(loop, [50])
    parts = split_to_fit([only], lambda units: int(units * 10), room_bytes=20)
    assert len(parts) == 1
    assert parts[0].requests == (only,)
    assert parts[0].activation_bytes == 500  # over the pool: it evicts for its estimate
    (part,) = split_to_fit([only], lambda units: int(units * 10), room_bytes=20, most_bytes=100)
    assert part.activation_bytes == 100  # estimated 500: it runs in the most there is, measured


def test_footprint_is_a_read_only_copy() -> None:
    shared = {"enc": 5}
    footprint = Footprint(1, shared)
    shared["enc"] = 99
    assert footprint.total_bytes == 6


# -- defaults, refusals and their messages ----------------------------------------


async def test_defaults_wait_30_s_reserve_nothing_and_start_with_no_peak() -> None:
    clock, book = FakeClock(), ActivationBook()
    manager = ResidencyManager(
        1000, FakeModelHost(), make_eviction_policy("lru"), clock, activations=book
    )
    assert manager.activations is book
    assert manager.stats().peak_used_bytes == 0
    lease = await manager.acquire(make_spec("a", 600))
    assert lease.reservation.num_bytes == 0
    assert manager.table.activation_bytes_held() == 0
    with pytest.raises(OverloadedError) as info:
        await manager.acquire(make_spec("b", 600))  # a is pinned: b waits, then gives up
    assert clock.now() == 30.0
    assert info.value.retry_after_s == 1.0
    assert "for model 'b'" in str(info.value)
    manager.release(lease)


async def test_by_default_failed_loads_back_off_from_2_s_to_at_most_5_minutes() -> None:
    clock = FakeClock()
    manager = ResidencyManager(1000, FakeModelHost(), make_eviction_policy("lru"), clock)
    bad = make_spec("m", 100, fail_load=True)
    windows = []
    for _ in range(10):
        with pytest.raises(ModelUnavailableError) as failed:
            await manager.acquire(bad, 0)
        assert failed.value.retry_after_s is not None
        windows.append(failed.value.retry_after_s)
        clock.advance(failed.value.retry_after_s)
    assert windows == [2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 300.0, 300.0]


async def test_unload_waits_for_the_batch_running_on_the_model() -> None:
    clock = FakeClock()
    manager = ResidencyManager(
        1000, FakeModelHost(), make_eviction_policy("lru"), clock, wait_s=0.5
    )
    spec = make_spec("a", 100)
    lease = await manager.acquire(spec, 0)
    unloading = asyncio.ensure_future(manager.unload("a"))
    await clock.sleep(0.2)
    assert not unloading.done()
    manager.release(lease)
    assert await unloading is True
    assert clock.now() == 0.2  # woken by the release
    assert manager.state("a") is ModelState.UNLOADED
    assert manager.stats().evictions_total == 0  # asked for, not an eviction
    lease = await manager.acquire(spec, 0)
    with pytest.raises(OverloadedError, match="for model 'a'"):
        await manager.unload("a")
    assert clock.now() == 0.7  # it waited wait_s for the batch
    manager.release(lease)


async def test_fit_counts_activations_and_allows_exactly_the_cap_or_the_budget() -> None:
    manager, _host, _clock = make_manager(1000)
    capped = make_spec("c", 300, max_bytes=500)
    manager.release(await manager.acquire(capped, 200))  # 500: exactly its cap
    with pytest.raises(RequestTooLargeError) as info:  # the request's fault: 413
        await manager.acquire(capped, 201)
    assert (info.value.name, info.value.activation_bytes, info.value.limit_bytes) == ("c", 201, 500)
    assert "201 bytes of activations beside 300 bytes of weights, over its cap of 500" in str(
        info.value
    )
    whole = make_spec("w", 1000)
    await manager.ensure_loaded(whole)  # exactly the budget
    with pytest.raises(RequestTooLargeError, match="over the whole budget of 1,000 bytes"):
        await manager.acquire(whole, 1)
    with pytest.raises(ModelTooLargeError) as too_large:  # the weights alone: the server's, 503
        await manager.acquire(make_spec("x", 1001), 0)
    assert (too_large.value.name, too_large.value.reason) == (
        "x",
        "needs 1001 bytes, over the whole budget of 1000 bytes",
    )


async def test_retry_window_runs_from_the_failure_and_errors_name_the_model() -> None:
    clock, host = FakeClock(start=100.0), FakeModelHost()
    manager = ResidencyManager(1000, host, make_eviction_policy("lru"), clock, wait_s=0.0)
    spec = make_spec("bad", 100, fail_load=True)
    with pytest.raises(ModelUnavailableError) as info:
        await manager.acquire(spec, 0)
    assert (info.value.name, info.value.reason) == ("bad", LOAD_FAILED)
    assert manager.error("bad") == "load failed: RuntimeError: fake load failure"
    clock.advance(1.5)
    with pytest.raises(ModelUnavailableError) as info:
        await manager.acquire(spec, 0)  # within 2 s of the failure: refused
    assert (info.value.name, info.value.reason) == ("bad", f"{LOAD_FAILED}; retried in 0.5s")
    assert info.value.retry_after_s == 0.5
    assert host.loads["bad"] == 1


async def test_a_load_measured_over_its_cap_fails_with_that_reason() -> None:
    manager, host, _clock = make_manager(1000)
    with pytest.raises(ModelTooLargeError):
        await manager.acquire(make_spec("big", 600, estimate_bytes=100, max_bytes=500), 0)
    assert manager.error("big") == "needs 600 bytes, over its cap of 500 bytes"
    assert host.unloads["big"] == 1
    assert manager.table.used_bytes() == 0


# -- room ---------------------------------------------------------------------------


async def test_a_load_one_byte_short_evicts() -> None:
    manager, host, _clock = make_manager(1000)
    await manager.ensure_loaded(make_spec("a", 500))
    await manager.ensure_loaded(make_spec("b", 501))
    assert host.on_unload == ["a"]


async def test_a_batch_evicts_another_idle_model_never_its_own() -> None:
    manager, host, clock = make_manager(1000)
    a = make_spec("a", 400)
    await manager.ensure_loaded(a)  # the least recently used
    clock.advance(1.0)
    await manager.ensure_loaded(make_spec("b", 400))
    lease = await manager.acquire(a, 300)  # 200 free: short of 100
    assert host.on_unload == ["b"]
    assert host.loads["a"] == 1
    manager.release(lease)


async def test_a_batch_that_gets_no_room_is_refused_by_its_models_name() -> None:
    manager, _host, _clock = make_manager(1000)
    running = await manager.acquire(make_spec("b", 400), 0)
    with pytest.raises(OverloadedError, match="for model 'a'"):
        await manager.acquire(make_spec("a", 400), 300)  # b is pinned, a is its own
    manager.release(running)


async def test_a_load_measured_over_its_estimate_evicts_only_the_difference() -> None:
    manager, host, clock = make_manager(1000)
    await manager.ensure_loaded(make_spec("c", 200))  # the least recently used
    clock.advance(1.0)
    await manager.ensure_loaded(make_spec("b", 400))
    # Expected 300 fit the 400 free; the measured 450 are 150 more, 50 beyond the
    # 100 then free: c alone frees them.
    await manager.ensure_loaded(make_spec("a", 450, estimate_bytes=300))
    assert host.on_unload == ["c"]
    assert manager.table.used_bytes() == 850


async def test_a_load_measured_over_its_estimate_with_no_room_gives_the_bytes_back() -> None:
    manager, host, _clock = make_manager(1000)
    running = await manager.acquire(make_spec("b", 600), 0)
    spec = make_spec("a", 450, estimate_bytes=300)
    message = "model 'a' measured 450 bytes, more than expected, and there is no room now"
    with pytest.raises(OverloadedError) as info:
        await manager.acquire(spec, 0)
    assert str(info.value) == message
    assert info.value.retry_after_s == 1.0
    assert (host.loads["a"], host.unloads["a"]) == (1, 1)
    assert manager.state("a") is ModelState.UNLOADED
    assert manager.table.used_bytes() == 600
    manager.release(running)
    lease = await manager.acquire(spec, 0)  # now with the measured 450 up front
    assert manager.table.used_bytes() == 450
    manager.release(lease)


async def test_a_reload_keeps_the_first_measurement() -> None:
    manager, _host, _clock = make_manager(1000)
    await manager.ensure_loaded(make_spec("a", 300))
    await manager.unload("a")
    await manager.ensure_loaded(make_spec("a", 500))  # the runtime would report more now
    measured = manager.measured("a")
    assert measured is not None
    assert measured.own_bytes == 300
    assert manager.table.used_bytes() == 300


class Measured:
    """A loaded model that counts how often it is measured (``memory``)."""

    def __init__(self, model: LoadedModel, counts: Counter[str], name: str) -> None:
        self._model, self._counts, self._name = model, counts, name

    def run(self, items: Sequence[Any]) -> list[Any]:
        return self._model.run(items)

    def memory(self) -> Footprint:
        self._counts[self._name] += 1
        return self._model.memory()

    def unload(self) -> None:
        self._model.unload()


class MeasuringHost(FakeModelHost):
    """A fake host whose models count their measurements."""

    def __init__(self) -> None:
        super().__init__()
        self.measures: Counter[str] = Counter()

    async def load(self, spec: ModelSpec) -> LoadedModel:
        return Measured(await super().load(spec), self.measures, spec.key)


async def test_a_reload_is_not_measured_again() -> None:
    # Measuring holds running batches back; the first measurement is kept.
    host = MeasuringHost()
    manager = ResidencyManager(1000, host, make_eviction_policy("lru"), FakeClock())
    for _ in range(3):
        await manager.ensure_loaded(make_spec("a", 300))
        await manager.unload("a")
    assert host.loads["a"] == 3
    assert host.measures["a"] == 1


def test_activation_bytes_per_unit_is_none_until_a_batch_was_measured() -> None:
    manager, _host, _clock = make_manager(1000)
    assert manager.activation_bytes_per_unit("a") is None
    manager.observe_batch("a", 500, 10)
    assert manager.activation_bytes_per_unit("a") == 50
    assert manager.activation_bytes_per_unit("b") is None


# -- a fresh model's protection ends after FRESH_PROTECTION_S ------------------------


async def test_a_model_loaded_for_a_batch_runs_it_before_older_waiters() -> None:
    """x is loaded (with room for its batch) while a batch of b waits for room:
    x's batch goes first, and x is not evicted to make b's room before it ran."""
    clock = FakeClock(start=100.0)
    host = FakeModelHost(clock)
    manager = ResidencyManager(1000, host, make_eviction_policy("lru", clock), clock, wait_s=60.0)
    b, x = make_spec("b", 300), make_spec("x", 300, load_s=1.0)
    manager.register([b, x])  # they fit: batches wait in line, and x's is behind b's
    running = await manager.acquire(b, 300)  # 600 held
    want_x = asyncio.ensure_future(manager.acquire(x, 100))  # loads x: 300 + 100 fit
    await clock.sleep(0.5)
    # b's batch waits for room, first in line; x's could not pass it (the 400
    # beside the weights, less its 100, do not hold b's 350): it goes first as fresh.
    want_b = asyncio.ensure_future(manager.acquire(b, 350))
    lease_x = await want_x
    assert clock.now() == 101.0  # as soon as x was ready
    assert not want_b.done()
    manager.release(lease_x)
    manager.release(running)
    manager.release(await want_b)
    assert host.loads["x"] == 1
    assert host.on_unload == []


async def test_a_waiting_batch_whose_model_was_evicted_reloads_it() -> None:
    """A batch of x waits in line behind a batch of c that then evicts x (its
    need is more than the pool): x's batch hands its place to the reload of x,
    instead of waiting behind itself until wait_s."""
    clock = FakeClock(start=100.0)
    host = FakeModelHost(clock)
    manager = ResidencyManager(1000, host, make_eviction_policy("lru", clock), clock, wait_s=60.0)
    x, c = make_spec("x", 300, load_s=1.0), make_spec("c", 500)
    manager.register([x, c])  # they fit together: batches wait in line
    running = await manager.acquire(x, 150)  # loaded by 101
    await manager.ensure_loaded(c)
    want_c = asyncio.ensure_future(manager.acquire(c, 450))  # first in line
    await clock.sleep(0.1)
    want_x = asyncio.ensure_future(manager.acquire(x, 100))  # second in line
    await clock.sleep(0.1)
    manager.release(running)  # c's batch evicts the idle x
    manager.release(await want_c)
    lease = await want_x  # x's batch loads x again, from its place in line
    assert clock.now() == pytest.approx(102.2)  # released at 101.2, + x's 1 s load
    assert host.loads["x"] == 2
    manager.release(lease)


class LoadOrder(FakeModelHost):
    """A fake host that records the order in which loads begin."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.begun: list[str] = []

    async def load(self, spec: ModelSpec) -> LoadedModel:
        self.begun.append(spec.key)
        return await super().load(spec)


async def test_the_reload_for_a_waiting_batch_goes_before_a_load_that_joined_after_it() -> None:
    """As above, with a load of y joining the line after x's batch: x's reload
    takes the batch's place, so it begins before y's load."""
    clock = FakeClock(start=100.0)
    host = LoadOrder(clock)
    manager = ResidencyManager(1000, host, make_eviction_policy("lru", clock), clock, wait_s=60.0)
    x, c, y = make_spec("x", 300, load_s=1.0), make_spec("c", 500), make_spec("y", 200)
    manager.register([x, c, y])  # 1000 bytes: they fit together
    running = await manager.acquire(x, 150)
    await manager.ensure_loaded(c)
    want_c = asyncio.ensure_future(manager.acquire(c, 450))  # first in line
    await clock.sleep(0.1)
    want_x = asyncio.ensure_future(manager.acquire(x, 100))  # second in line
    await clock.sleep(0.1)
    want_y = asyncio.ensure_future(manager.acquire(y, 0))  # third in line
    await clock.sleep(0.1)
    manager.release(running)  # c's batch evicts the idle x
    manager.release(await want_c)
    lease = await want_x
    assert clock.now() == pytest.approx(102.3)  # released at 101.3, + x's 1 s load
    assert host.begun == ["x", "c", "x", "y"]
    manager.release(lease)
    manager.release(await want_y)


async def test_a_zero_byte_acquire_of_a_ready_model_skips_the_line() -> None:
    """Pinning a ready model for no activation bytes (ensure_loaded, the admin's
    load) takes nothing from anyone: it does not wait behind a batch in line."""
    clock = FakeClock()
    manager = ResidencyManager(1000, FakeModelHost(clock), make_eviction_policy("lru"), clock)
    a, b = make_spec("a", 300), make_spec("b", 300)
    manager.register([a, b])
    running = await manager.acquire(a, 300)  # free: 400
    waiting = asyncio.ensure_future(manager.acquire(a, 500))  # in line for a's bytes
    await clock.sleep(0.01)
    await manager.ensure_loaded(a)  # at once, though a batch waits in line
    assert clock.now() == pytest.approx(0.01)
    assert not waiting.done()
    manager.release(running)
    manager.release(await waiting)


async def test_a_zero_byte_acquire_skips_even_a_load_that_no_batch_may_pass() -> None:
    # b's load waits for 300 bytes and 500 for its first batch: more than the
    # 700 beside a's weights, so no batch that takes bytes may pass it.
    clock = FakeClock()
    manager = ResidencyManager(1000, FakeModelHost(clock), make_eviction_policy("lru"), clock)
    a, b = make_spec("a", 300), make_spec("b", 300)
    manager.register([a, b])
    running = await manager.acquire(a, 300)  # free: 400
    waiting = asyncio.ensure_future(manager.acquire(b, 500))
    await clock.sleep(0.01)
    manager.release(await manager.acquire(a, 0))  # at once
    assert clock.now() == pytest.approx(0.01)
    assert not waiting.done()
    manager.release(running)
    manager.release(await waiting)


async def test_close_logs_a_model_it_cannot_unload_and_unloads_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host, clock = FakeModelHost(), FakeClock()
    manager = ResidencyManager(1000, host, make_eviction_policy("lru"), clock, wait_s=1.0)
    busy, idle = make_spec("busy", 100), make_spec("idle", 100)
    lease = await manager.acquire(busy, 0)  # pinned through close
    await manager.ensure_loaded(idle)
    with caplog.at_level("WARNING", logger="tessera.residency"):
        await manager.close()
    assert host.on_unload == ["idle"]
    (record,) = caplog.records
    assert record.getMessage().startswith("could not unload busy at close: ")
    assert "no room in the memory budget for model 'busy'" in record.getMessage()
    manager.release(lease)


def test_every_part_of_a_split_batch_keeps_the_single_requests_cut(
    loop: asyncio.AbstractEventLoop,
) -> None:
    batch = requests(loop, [50, 1, 50])
    parts = split_to_fit(batch, lambda units: int(units * 10), room_bytes=20, most_bytes=100)
    assert [p.activation_bytes for p in parts] == [100, 10, 100]


def test_two_requests_that_do_not_fit_together_run_apart(loop: asyncio.AbstractEventLoop) -> None:
    parts = split_to_fit(requests(loop, [1, 1]), lambda units: int(units * 10), room_bytes=10)
    assert [p.activation_bytes for p in parts] == [10, 10]


def test_no_room_at_all_reserves_nothing_rather_than_less(loop: asyncio.AbstractEventLoop) -> None:
    (part,) = split_to_fit(requests(loop, [5]), lambda units: int(units * 10), 0, most_bytes=-5)
    assert part.activation_bytes == 0


def test_items_of_under_a_unit_peak_at_their_own_units() -> None:
    assert items_peak_units(0.5, (), 0.0) == 0.5


def test_a_reservation_scales_the_readings_near_its_size_the_nearest_included() -> None:
    stats = ActivationBook().of("m")
    stats.observe(120, 4.0)  # 30 a unit
    stats.observe(100, 2.0)  # 50 a unit, at exactly half of 4
    assert stats.reserve_bytes(4.0) == 200
    far = ActivationBook().of("m")
    far.observe(120, 4.0)
    far.observe(100, 1.0)  # a quarter of 4: left out for a batch of 4
    assert far.reserve_bytes(4.0) == 120


def test_readings_all_larger_than_a_batch_all_count() -> None:
    stats = ActivationBook().of("m")
    stats.observe(50, 0.5)
    stats.observe(60, 0.5)
    assert stats.reserve_bytes(0.25) == 30


def test_the_book_passes_warm_ups_on_and_keeps_its_window() -> None:
    book = ActivationBook(window=2)
    book.observe("warm", 100, 1.0, provisional=True)
    book.observe("warm", 200, 1.0, provisional=True)
    assert book.of("warm").proven_bytes(1.0) == 0  # warm-ups prove nothing
    for peak in (100, 200, 50, 60):
        book.observe("m", peak, 1.0)
    assert book.of("m").reserve_bytes(1.0) == 60  # the two latest


async def test_a_failed_load_is_logged_with_its_cause_and_retry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, _host, _clock = make_manager(1000)
    with caplog.at_level("ERROR", logger="tessera.residency"), pytest.raises(ModelUnavailableError):
        await manager.ensure_loaded(make_spec("bad", 10, fail_load=True))
    assert [r.getMessage() for r in caplog.records] == [
        "model bad failed to load, retried in 2 s: RuntimeError: fake load failure"
    ]


async def test_a_retired_model_registered_again_starts_a_new_row_of_failures() -> None:
    manager, _host, _clock = make_manager(1000)
    bad = make_spec("bad", 10, fail_load=True)
    with pytest.raises(ModelUnavailableError):
        await manager.ensure_loaded(bad)
    await manager.retire("bad")
    manager.register([bad])
    with pytest.raises(ModelUnavailableError) as again:
        await manager.ensure_loaded(bad)
    assert again.value.retry_after_s == 2.0  # the first failure of a new row
