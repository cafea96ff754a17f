"""The residency manager's read side (stats, errors, room) and the batch plan,
with fake models, a fake clock and no waiting (``wait_s=0``)."""

from __future__ import annotations

import asyncio

import pytest

from builders import make_spec
from tessera.clock import FakeClock
from tessera.errors import ModelUnavailableError
from tessera.footprint import Footprint
from tessera.request import QueuedRequest, RequestResult
from tessera.residency import ModelState, ResidencyManager, make_eviction_policy
from tessera.residency.activation import ActivationBook
from tessera.residency.fake import FakeModelHost
from tessera.residency.plan import split_to_fit


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
    with pytest.raises(ModelUnavailableError):
        await manager.acquire(spec, 0)
    error = manager.error("bad")
    assert error is not None
    assert error.startswith("load failed: RuntimeError")
    clock.advance(29.9)
    with pytest.raises(ModelUnavailableError, match="load failed"):
        await manager.acquire(spec, 0)  # within 30 s: refused without a try
    assert host.loads["bad"] == 1
    clock.advance(0.1)
    with pytest.raises(ModelUnavailableError):
        await manager.acquire(spec, 0)  # the window passed: tried again
    assert host.loads["bad"] == 2
    assert manager.table.activation_bytes_held() == 0
    manager.raise_if_failed("never-seen")  # no entry: nothing to say


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


# -- ActivationBook -------------------------------------------------------------


def test_activation_book_keeps_one_window_per_model() -> None:
    book = ActivationBook(window=1)
    assert book.reserve_bytes("a", 10) == 0
    book.observe("a", 500, 10)
    book.observe("b", 10, 10)
    assert book.reserve_bytes("a", 2) == 100
    assert book.reserve_bytes("b", 2) == 2
    book.observe("a", 10, 10)  # a window of one: the last batch alone
    assert book.reserve_bytes("a", 2) == 2
    assert book.of("a") is book.of("a")
    assert book.of("a").num_samples == 2
    default = ActivationBook()
    default.observe("a", 10_000, 1)
    for _ in range(64):
        default.observe("a", 1, 1)
    assert default.reserve_bytes("a", 1) == 1


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


def test_a_single_request_is_never_split(loop: asyncio.AbstractEventLoop) -> None:
    (only,) = requests(loop, [50])
    parts = split_to_fit([only], lambda units: int(units * 10), room_bytes=20)
    assert len(parts) == 1
    assert parts[0].requests == (only,)
    assert parts[0].activation_bytes == 500


def test_footprint_is_a_read_only_copy() -> None:
    shared = {"enc": 5}
    footprint = Footprint(1, shared)
    shared["enc"] = 99
    assert footprint.total_bytes == 6
