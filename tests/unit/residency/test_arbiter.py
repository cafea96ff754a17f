"""The room arbiter (``arbiter.py``): bounded waits, the head woken when the
line moves, what only evictions free, room for the loads next in line, and
when a batch's room is kept; over a real table, on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from builders import make_spec
from harness.fake_host import FakeModelHost
from tessera.clock import FakeClock
from tessera.errors import OverloadedError
from tessera.footprint import Footprint
from tessera.repository import ModelSpec
from tessera.residency import make_eviction_policy
from tessera.residency.arbiter import EVICT_AHEAD, RoomArbiter
from tessera.residency.catalogue import Catalogue
from tessera.residency.fresh import FRESH_PROTECTION_S, FreshModels
from tessera.residency.line import LoadPlace
from tessera.residency.patience import Patience
from tessera.residency.table import ModelEntry, ResidencyTable
from tessera.residency.tier import HostTier
from tessera.residency.transfer import TierTransfers


class Setup:
    def __init__(self, budget: int = 1000, *specs: ModelSpec, max_loads: int = 0) -> None:
        self.clock = FakeClock(autojump=False)
        self.table = ResidencyTable(budget)
        self.catalogue = Catalogue(FakeModelHost().estimate)
        for spec in specs:
            self.catalogue.register(spec)
        self.fresh = FreshModels(self.clock)
        self.transfers = TierTransfers(None, FakeModelHost(), max_loads, lambda: None)
        self.arbiter = RoomArbiter(
            self.table, self.catalogue, self.fresh, self.transfers, self.clock
        )

    def ready(self, name: str, num_bytes: int) -> None:
        assert self.table.begin_load(name, Footprint(num_bytes))
        self.table.mark_ready(name, self.clock.now())


async def test_a_wait_past_its_deadline_is_overloaded() -> None:
    setup = Setup()
    with pytest.raises(OverloadedError, match="no room in the memory budget for model 'm'"):
        await setup.arbiter.wait_for_change(setup.clock.now(), "m")


async def test_a_wait_ends_at_a_change_or_at_its_deadline() -> None:
    setup = Setup()
    waiter = asyncio.ensure_future(setup.arbiter.wait_for_change(5.0, "m"))
    await asyncio.sleep(0)
    setup.ready("x", 100)
    setup.arbiter.notify()
    await waiter
    assert setup.arbiter.peak_used_bytes == 100
    waiter = asyncio.ensure_future(setup.arbiter.wait_for_change(5.0, "m"))
    await asyncio.sleep(0)
    setup.clock.advance(5.0)
    await waiter
    assert not setup.arbiter.wakeups.has_sleepers()


async def test_a_wait_ends_when_a_fresh_models_protection_or_the_patience_ends() -> None:
    setup = Setup()
    setup.fresh.add("f")
    waiter = asyncio.ensure_future(setup.arbiter.wait_for_change(60.0, "m"))
    await asyncio.sleep(0)
    assert setup.clock.jump_to_next()
    await waiter
    assert setup.clock.now() == pytest.approx(FRESH_PROTECTION_S)
    waiter = asyncio.ensure_future(
        setup.arbiter.wait_for_change(60.0, "m", until=setup.clock.now() + 1.0)
    )
    await asyncio.sleep(0)
    assert setup.clock.jump_to_next()
    await waiter
    assert setup.clock.now() == pytest.approx(FRESH_PROTECTION_S + 1.0)


async def test_leaving_the_line_wakes_only_its_new_head() -> None:
    setup = Setup()
    arbiter = setup.arbiter
    first, second, third = LoadPlace("a"), LoadPlace("b"), LoadPlace("c")
    for place in (first, second, third):
        arbiter.line.join(place, 100)
    on_second = asyncio.ensure_future(arbiter.wait_for_change(60.0, "b", place=second))
    on_third = asyncio.ensure_future(arbiter.wait_for_change(60.0, "c", place=third))
    await asyncio.sleep(0)
    arbiter.notify()  # a change of bytes wakes neither
    await asyncio.sleep(0)
    assert not on_second.done()
    assert arbiter.leave_line(first) == 0
    await on_second
    assert not on_third.done()
    on_third.cancel()
    with pytest.raises(asyncio.CancelledError):
        await on_third


def test_a_fresh_model_is_in_turn_behind_others() -> None:
    setup = Setup()
    older, mine = object(), object()
    setup.arbiter.line.join(older, 10)
    setup.arbiter.line.join(mine, 10)
    assert not setup.arbiter.in_turn(mine, "m")
    setup.fresh.add("m")
    assert setup.arbiter.in_turn(mine, "m")
    assert setup.arbiter.in_turn(older, "x")


def test_while_every_model_fits_running_batches_bytes_are_not_evicted_for() -> None:
    a, b = make_spec("a", 300), make_spec("b", 300)
    setup = Setup(1000, a, b)
    setup.ready("a", 300)
    setup.ready("b", 300)
    assert setup.table.reserve("a", 300, 0.0) is not None  # 100 free
    assert setup.arbiter.every_model_fits()
    assert setup.arbiter.bytes_only_evictions_free(350) == -50
    assert setup.arbiter.bytes_only_evictions_free(450) == 50
    setup.catalogue.register(make_spec("c", 500))  # now they do not all fit
    assert setup.arbiter.bytes_only_evictions_free(350) == 250


def test_room_for_the_loads_next_in_line_only_under_pressure() -> None:
    setup = Setup(1000, make_spec("big", 2000))
    line = setup.arbiter.line
    head = object()
    line.join(head, 10)
    for i in range(EVICT_AHEAD + 1):
        line.join(LoadPlace(f"l{i}"), 100 * (i + 1))
    assert setup.arbiter.bytes_for_loads_next(head) == 100 + 200 + 300
    fits = Setup(1000, make_spec("small", 100))
    fits.arbiter.line.join(head, 10)
    fits.arbiter.line.join(LoadPlace("l"), 100)
    assert fits.arbiter.bytes_for_loads_next(head) == 0


def test_a_batchs_room_is_kept_only_while_someone_waits_and_every_patience_outlasts_it() -> None:
    setup = Setup()
    setup.ready("m", 100)
    arbiter = setup.arbiter
    reservation = setup.table.reserve("m", 50, 0.0)
    assert reservation is not None
    assert not arbiter.keep_for_next_batch(reservation, 1.0, 0.01)  # no one waits
    waiter = object()
    arbiter.line.join(waiter, 10, Patience(0.5))
    assert not arbiter.keep_for_next_batch(reservation, 1.0, 0.01)  # its patience ends first
    assert arbiter.keep_for_next_batch(reservation, 0.5, 0.01)
    assert arbiter.give_back_held("m")
    assert not arbiter.give_back_held("m")
    assert setup.table.activation_bytes_held() == 0


def test_a_kept_room_is_given_back_when_its_time_is_up() -> None:
    setup = Setup()
    setup.ready("m", 100)
    arbiter = setup.arbiter
    arbiter.line.join(object(), 10)
    reservation = setup.table.reserve("m", 50, 0.0)
    assert reservation is not None
    arbiter.batch_ends.start("m", 0.2)
    assert arbiter.keep_for_next_batch(reservation, 0.2, 0.01)
    assert setup.table.activation_bytes_held() == 50
    setup.clock.advance(1.0)
    assert setup.table.activation_bytes_held() == 0
    assert "m" not in arbiter.batch_ends  # no batch of it runs any more


def test_a_models_batch_end_stays_while_another_of_its_batches_runs() -> None:
    setup = Setup()
    setup.ready("m", 100)
    arbiter = setup.arbiter
    first = setup.table.reserve("m", 10, 0.0)
    second = setup.table.reserve("m", 10, 0.0)
    assert first is not None
    assert second is not None
    arbiter.batch_ends.start("m", 1.0)
    arbiter.release(first)
    assert "m" in arbiter.batch_ends
    arbiter.release(second)
    assert "m" not in arbiter.batch_ends


def test_a_batch_passes_older_places_only_where_the_pool_beside_the_weights_holds_their_needs() -> (
    None
):
    setup = Setup()
    setup.ready("m", 600)  # a pool of 400 beside the weights
    arbiter = setup.arbiter
    batch = object()
    arbiter.line.join(batch, 300)
    assert arbiter.may_pass(batch, 300)  # no one older: its own need is no obstacle
    older = object()
    arbiter.line.join(older, 150)  # behind the batch: still no one older
    assert arbiter.may_pass(batch, 300)
    late = object()
    arbiter.line.join(late, 100)
    assert arbiter.may_pass(late, 100)  # 400 - 100 leaves the 300 and the 150
    assert not arbiter.may_pass(late, 101)


def tiered_setup(max_loads: int, *in_tier: str) -> Setup:
    """Under pressure, with ``in_tier`` models waiting in a host tier."""
    setup = Setup(1000, make_spec("big", 2000), max_loads=max_loads)
    tier = HostTier(10_000, make_eviction_policy("lru"), setup.clock)
    setup.transfers.tier = tier
    for name in in_tier:
        assert tier.begin_admit(name, Footprint(100))
        assert tier.settle(name, Footprint(100), ModelEntry(name))
    return setup


def test_loads_next_from_the_host_tier_count_only_as_far_as_they_could_begin() -> None:
    setup = tiered_setup(2, "h0", "h1", "h2")
    line = setup.arbiter.line
    for place, need in ((LoadPlace("h0"), 50), (LoadPlace("h1"), 100), (LoadPlace("f"), 200)):
        line.join(place, need)
    line.join(LoadPlace("h2"), 300)
    # h0 (at the head) takes one of two restores; h1 the other; f loads from its
    # files; h2 would have to wait for a restore to end.
    assert setup.arbiter.bytes_for_loads_next(LoadPlace("h0")) == 300
    # A head that loads from its files (or a batch) takes no restore: both
    # tiered loads behind it count.
    files_first = tiered_setup(2, "h1", "h2")
    for place, need in ((LoadPlace("f"), 50), (LoadPlace("h1"), 100), (LoadPlace("h2"), 300)):
        files_first.arbiter.line.join(place, need)
    assert files_first.arbiter.bytes_for_loads_next(LoadPlace("f")) == 400


def test_with_a_restore_in_flight_fewer_loads_next_count() -> None:
    setup = tiered_setup(2, "h1", "h2")
    setup.transfers.num_loads = 1
    line = setup.arbiter.line
    head = object()
    line.join(head, 10)
    for place, need in ((LoadPlace("h1"), 100), (LoadPlace("f"), 200), (LoadPlace("h2"), 300)):
        line.join(place, need)
    assert setup.arbiter.bytes_for_loads_next(head) == 300
    setup.transfers.num_loads = 0
    assert setup.arbiter.bytes_for_loads_next(head) == 600


def test_a_tiered_head_takes_one_restore_of_the_bound() -> None:
    setup = tiered_setup(3, "h0", "h1", "h2", "h3")
    line = setup.arbiter.line
    for i, need in enumerate((10, 100, 200, 300)):
        line.join(LoadPlace(f"h{i}"), need)
    assert setup.arbiter.bytes_for_loads_next(LoadPlace("h0")) == 300  # h1 and h2, not h3
