"""The residency table, eviction policies and activation statistics, figure by
figure: plain synchronous calls, no manager, no host."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.clock import FakeClock
from tessera.footprint import Footprint
from tessera.residency import (
    ActivationStats,
    ModelEntry,
    ModelState,
    ResidencyTable,
    make_eviction_policy,
)
from tessera.residency.activation import SETTLING_READINGS, ActivationBook
from tessera.residency.policy import take
from tessera.residency.table import USE_HALF_LIFE_S


def loaded(
    table: ResidencyTable, name: str, own: int, shared: dict[str, int] | None = None
) -> None:
    assert table.begin_load(name, Footprint(own, shared or {}))
    table.mark_ready(name, now=0.0)


# -- accounting ------------------------------------------------------------------


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"^budget_bytes must be positive$"):
        ResidencyTable(0)
    assert ResidencyTable(1).free_bytes() == 1


def test_every_holding_state_counts_and_no_other_does() -> None:
    table = ResidencyTable(1000)
    loaded(table, "a", 100, {"enc": 50})
    assert table.used_bytes() == 150
    table.begin_unload("a", eviction=False)
    assert table.entries["a"].state is ModelState.UNLOADING
    assert table.used_bytes() == 150  # an unloading model still holds its bytes
    assert table.free_bytes() == 850
    assert table.begin_load("b", Footprint(851)) is False  # so they are not free
    table.finish_unload("a")
    assert table.used_bytes() == 0
    assert table.entries["a"].footprint.total_bytes == 0
    assert table.begin_load("b", Footprint(1000))  # exactly the budget fits
    assert table.entries["b"].state is ModelState.LOADING
    assert table.used_bytes() == 1000
    table.fail("b", "boom")
    assert table.used_bytes() == 0
    assert table.entries["b"].error == "boom"


def test_shared_component_counts_once_and_is_free_to_a_second_user() -> None:
    table = ResidencyTable(1000)
    loaded(table, "a", 100, {"enc": 400})
    assert table.extra_bytes("b", Footprint(50, {"enc": 400})) == 50
    assert table.extra_bytes("b", Footprint(50, {"enc": 400, "head": 30})) == 80
    loaded(table, "b", 50, {"enc": 400})
    assert table.used_bytes() == 550
    # Unloading one user frees its own bytes only; the last frees the component.
    assert table.freed_by(["a"]) == 100
    assert table.freed_by(["b"]) == 50
    assert table.freed_by(["a", "b"]) == 550
    assert table.freed_by([]) == 0


def test_extra_bytes_of_a_holding_model_is_the_difference() -> None:
    table = ResidencyTable(1000)
    assert table.begin_load("a", Footprint(100, {"enc": 200}))
    assert table.extra_bytes("a", Footprint(150, {"enc": 200})) == 50
    assert table.extra_bytes("a", Footprint(80, {})) == -220
    assert table.settle_load("a", Footprint(150, {"enc": 200}))
    assert table.used_bytes() == 350
    assert table.settle_load("a", Footprint(1001)) is False
    assert table.entries["a"].footprint == Footprint(150, {"enc": 200})
    assert table.settle_load("a", Footprint(1000))  # exactly the budget
    assert table.used_bytes() == 1000


def test_a_holding_model_cannot_begin_loading_again() -> None:
    table = ResidencyTable(1000)
    assert table.begin_load("a", Footprint(100))
    with pytest.raises(ValueError, match="a is already loading"):
        table.begin_load("a", Footprint(100))


def test_load_that_does_not_fit_changes_nothing() -> None:
    table = ResidencyTable(1000)
    loaded(table, "a", 600)
    assert table.begin_load("b", Footprint(401)) is False
    assert table.entries["b"].state is ModelState.UNLOADED
    assert table.used_bytes() == 600
    assert table.begin_load("b", Footprint(400))


def test_a_load_is_from_files_unless_said_to_be_from_the_host_tier() -> None:
    table = ResidencyTable(1000)
    assert table.begin_load("a", Footprint(100))
    table.mark_ready("a", 0.0, 2.0)
    entry = table.entries["a"]
    assert (entry.load_s, entry.files_load_s, entry.host_load_s, entry.host_loads) == (
        2.0,
        2.0,
        None,
        0,
    )
    table.begin_unload("a", eviction=True)
    table.finish_unload("a")
    assert table.begin_load("a", Footprint(100))
    table.mark_ready("a", 1.0, 0.1, from_host=True)
    assert (entry.load_s, entry.files_load_s, entry.host_load_s, entry.host_loads) == (
        0.1,
        2.0,
        0.1,
        1,
    )
    table.begin_unload("a", eviction=True)
    table.finish_unload("a")
    assert table.begin_load("a", Footprint(100))
    table.mark_ready("a", 2.0, 0.2, from_host=True)
    assert (entry.host_load_s, entry.host_loads, entry.loads) == (0.2, 2, 3)


def test_failed_load_error_is_cleared_by_the_next_load() -> None:
    table = ResidencyTable(1000)
    assert table.begin_load("a", Footprint(100))
    table.fail("a", "boom")
    assert table.begin_load("a", Footprint(100))
    assert table.entries["a"].error is None


def test_a_failed_load_leaves_the_rooms_of_other_models_batches_held() -> None:
    table = ResidencyTable(1000)
    loaded(table, "a", 300)
    assert table.reserve("a", 150, 0.0) is not None
    assert table.begin_load("b", Footprint(200))
    table.fail("b", "boom")
    assert table.activation_bytes_held() == 150
    assert (table.used_bytes(), table.weight_bytes()) == (450, 300)


# -- reservations ----------------------------------------------------------------


def test_reserve_pins_and_holds_activation_bytes_until_released() -> None:
    table = ResidencyTable(1000)
    loaded(table, "a", 600)
    first = table.reserve("a", 300, now=5.0)
    assert first is not None
    assert first.name == "a"
    assert first.num_bytes == 300
    assert table.reserve("a", 101, now=5.0) is None  # one byte short
    second = table.reserve("a", 100, now=6.0)  # exactly what is left
    assert second is not None
    entry = table.entries["a"]
    assert (entry.pins, entry.activation_bytes) == (2, 400)
    assert table.used_bytes() == 1000
    assert table.activation_bytes_held() == 400
    assert table.evictable() == []
    with pytest.raises(ValueError, match="a cannot unload"):
        table.begin_unload("a", eviction=True)
    table.release(first, now=7.0)
    assert (entry.pins, entry.activation_bytes) == (1, 100)
    assert entry.last_used == 7.0
    table.release(second, now=8.0)
    assert (entry.pins, entry.activation_bytes) == (0, 0)
    assert table.used_bytes() == 600
    assert [e.name for e in table.evictable()] == ["a"]
    assert table.evictable(protect=["a"]) == []


def test_only_a_ready_model_can_be_reserved_or_unloaded() -> None:
    table = ResidencyTable(1000)
    assert table.begin_load("a", Footprint(100))
    with pytest.raises(ValueError, match="a is not ready: loading"):
        table.reserve("a", 0, now=0.0)
    with pytest.raises(ValueError, match="a cannot unload: loading, 0 pins"):
        table.begin_unload("a", eviction=False)
    assert table.evictable() == []  # loading: not a candidate


def test_evictions_are_counted_and_plain_unloads_are_not() -> None:
    table = ResidencyTable(1000)
    loaded(table, "a", 100)
    table.begin_unload("a", eviction=True)
    table.finish_unload("a")
    loaded(table, "a", 100)
    table.begin_unload("a", eviction=False)
    table.finish_unload("a")
    loaded(table, "a", 100)
    table.begin_unload("a", eviction=True)
    entry = table.entries["a"]
    assert (entry.evictions, entry.loads) == (2, 3)


def test_uses_decay_by_half_each_half_life() -> None:
    table = ResidencyTable(1000)
    loaded(table, "a", 100)
    entry = table.entries["a"]
    assert entry.uses_at(0.0) == 0.0  # ready is not a use
    reservation = table.reserve("a", 0, now=10.0)
    assert reservation is not None
    assert entry.uses_at(10.0) == 1.0
    assert entry.uses_at(10.0 + USE_HALF_LIFE_S) == pytest.approx(0.5)
    assert entry.uses_at(5.0) == 1.0  # never more than when last used
    table.release(reservation, now=10.0 + USE_HALF_LIFE_S)  # a release is not a use
    assert entry.uses_at(10.0 + USE_HALF_LIFE_S) == pytest.approx(0.5)


def test_fits_alone() -> None:
    table = ResidencyTable(1000)
    assert table.fits_alone(Footprint(500, {"enc": 300}), 200)
    assert not table.fits_alone(Footprint(500, {"enc": 300}), 201)


def test_entry_is_created_once_with_its_cap() -> None:
    table = ResidencyTable(1000)
    entry = table.entry("a", max_bytes=500)
    assert entry.max_bytes == 500
    assert table.entry("a") is entry
    assert table.entries == {"a": entry}


# -- eviction policies -------------------------------------------------------------


def candidates() -> list[ModelEntry]:
    return [
        ModelEntry("old-small", footprint=Footprint(100), last_used=1.0),
        ModelEntry("new-large", footprint=Footprint(500), last_used=3.0),
        ModelEntry("mid-mid", footprint=Footprint(300), last_used=2.0),
    ]


def freed(entries: list[ModelEntry]) -> Callable[[list[str]], int]:
    sizes = {e.name: e.weights_bytes for e in entries}
    return lambda names: sum(sizes[n] for n in names)


def test_lru_evicts_the_least_recently_used_until_enough_is_freed() -> None:
    policy = make_eviction_policy("lru")
    entries = candidates()
    assert policy.choose(entries, 100, freed(entries)) == ["old-small"]
    assert policy.choose(entries, 101, freed(entries)) == ["old-small", "mid-mid"]
    assert policy.choose(entries, 900, freed(entries)) == ["old-small", "mid-mid", "new-large"]
    assert policy.choose(entries, 901, freed(entries)) is None
    assert policy.choose(entries, 0, freed(entries)) == []


def test_largest_evicts_the_largest_first() -> None:
    policy = make_eviction_policy("largest")
    entries = candidates()
    assert policy.choose(entries, 500, freed(entries)) == ["new-large"]
    assert policy.choose(entries, 501, freed(entries)) == ["new-large", "mid-mid"]


def test_cost_policy_without_a_clock_reads_the_monotonic_one() -> None:
    policy = make_eviction_policy("cost")
    entries = candidates()  # never used: least recently used first
    assert policy.choose(entries, 101, freed(entries)) == ["old-small", "mid-mid"]


def test_none_never_evicts() -> None:
    policy = make_eviction_policy("none")
    entries = candidates()
    assert policy.choose(entries, 1, freed(entries)) is None
    with pytest.raises(ValueError, match="fifo"):
        make_eviction_policy("fifo")


# -- activation statistics -----------------------------------------------------------


def test_activation_reserves_the_worst_per_unit_peak_of_its_window() -> None:
    stats = ActivationStats(window=2)
    assert stats.reserve_bytes(10) == 0  # no measurement: nothing extra
    stats.observe(300, 10)  # 30 a unit
    stats.observe(1000, 10)  # 100 a unit: no lower, so both count from now on
    assert stats.num_samples == 2
    assert stats.reserve_bytes(3) == 300
    assert stats.reserve_bytes(0.01) == 1  # rounded up
    stats.observe(500, 10)
    stats.observe(400, 10)  # the 100-a-unit batch leaves the window
    assert stats.reserve_bytes(10) == 500
    assert stats.num_samples == 4


def test_activation_ignores_impossible_measurements() -> None:
    stats = ActivationStats()
    stats.observe(-1, 10)
    stats.observe(100, 0)
    stats.observe(100, -1)
    assert stats.num_samples == 0
    assert stats.reserve_bytes(10) == 0
    stats.observe(0, 10)  # a batch that needed nothing extra is a measurement
    assert stats.num_samples == 1
    assert stats.reserve_bytes(10) == 0


def test_activation_default_window_is_64() -> None:
    stats = ActivationStats()
    stats.observe(10, 1)
    stats.observe(10_000, 1)
    for _ in range(63):
        stats.observe(10, 1)
    assert stats.reserve_bytes(1) == 10_000
    stats.observe(10, 1)
    assert stats.reserve_bytes(1) == 10


def test_the_book_keeps_a_window_of_64_readings_per_model_by_default() -> None:
    book = ActivationBook()
    book.observe("m", 10, 1)
    book.observe("m", 10_000, 1)
    for _ in range(63):
        book.observe("m", 10, 1)
    assert book.of("m").reserve_bytes(1) == 10_000
    book.observe("m", 10, 1)
    assert book.of("m").reserve_bytes(1) == 10


def test_the_first_falling_readings_settle_before_they_count() -> None:
    # PP-OCRv6 on CPU, MiB a page-unit: the warm-up, then real pages.
    stats = ActivationStats()
    stats.observe(1480, 10, provisional=True)
    assert stats.reserve_bytes(1) == 148
    for reading in (1030, 830, 703):
        stats.observe(reading, 10)
        assert stats.reserve_bytes(10) == reading  # each lower one replaces the last
    stats.observe(706, 10)  # no lower: settled, and the window begins
    stats.observe(2000, 10, provisional=True)  # a reload's warm-up adds nothing now
    assert stats.reserve_bytes(10) == 706
    stats.observe(650, 10)  # lower readings no longer replace the worst
    assert (stats.num_samples, stats.reserve_bytes(10)) == (7, 706)


def test_readings_that_keep_falling_settle_after_a_few() -> None:
    stats = ActivationStats()
    for reading in range(1000, 1000 - SETTLING_READINGS, -1):
        stats.observe(reading, 1)
    settled = 1000 - SETTLING_READINGS + 1
    assert stats.reserve_bytes(1) == settled
    stats.observe(1, 1)  # counted in the window now, beside the settled reading
    assert stats.reserve_bytes(1) == settled


def test_a_warm_up_after_readings_that_kept_falling_does_not_settle_in_their_place() -> None:
    # The last of the settling readings is a reload's warm-up, higher than the
    # real ones: the lowest real reading settles, the warm-up adds nothing.
    stats = ActivationStats()
    for reading in range(1000, 1000 - SETTLING_READINGS + 1, -1):
        stats.observe(reading, 1)
    lowest = 1000 - SETTLING_READINGS + 2
    stats.observe(5000, 1, provisional=True)
    assert stats.num_samples == SETTLING_READINGS
    assert stats.reserve_bytes(1) == lowest
    stats.observe(1, 1)  # the window has begun: a lower reading counts beside it
    assert stats.reserve_bytes(1) == lowest


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 1000), st.integers(0, 50), st.integers(0, 5), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 5000),
    st.sampled_from(["cost", "lru", "largest", "none"]),
)
def test_a_choice_among_some_candidates_is_the_order_of_all_less_the_others(
    rows: list[tuple[int, int, int, bool]], need: int, name: str
) -> None:
    """What patience relies on (``VictimChooser.for_caller``): the policy's
    choice among the idle models is its order of idle and busy ones, less the
    busy ones, taken until enough is freed."""
    clock = FakeClock(100.0)
    policy = make_eviction_policy(name, clock)
    entries = [
        ModelEntry(f"m{i}", footprint=Footprint(size), last_used=float(used), use_weight=uses)
        for i, (size, used, uses, _) in enumerate(rows)
    ]
    idle = {f"m{i}" for i, row in enumerate(rows) if row[3]}
    some = [e for e in entries if e.name in idle]
    ordered = [e for e in policy.order(entries) if e.name in idle]
    assert take(ordered, need, freed(entries)) == policy.choose(some, need, freed(entries))


def test_a_reservation_scales_the_readings_near_its_size_not_the_smallest() -> None:
    # all-minilm-l6-v2-int8 on CPU, about: two-token batches peak at their fixed
    # part (30 MB), a 55-token one at 60 MB.
    stats = ActivationStats()
    for peak, units in ((30_000_000, 2), (30_000_000, 2), (60_000_000, 55)):
        stats.observe(peak, units)
    # 160 tokens: scaled from the 55-token reading, not 15 MB a token from the two-token ones.
    assert stats.reserve_bytes(160) == pytest.approx(60_000_000 * 160 / 55, abs=1)
    assert stats.reserve_bytes(2) == 30_000_000  # its own size's readings
    assert stats.reserve_bytes(40) == 30_000_000 * 20  # nothing nearer than 2 at or below 40
    # Readings at least half the nearest one's units count too (noise at about one size).
    stats.observe(40_000_000, 30)
    assert stats.reserve_bytes(60) == math.ceil(max(40_000_000 / 30, 60_000_000 / 55) * 60)
    assert stats.reserve_bytes(31) == math.ceil(max(40_000_000 / 30, 60_000_000 / 55) * 31)


def test_only_two_real_readings_prove_what_a_size_needs() -> None:
    stats = ActivationStats()
    stats.observe(5_000, 10, provisional=True)  # a warm-up's, with one-off costs
    stats.observe(6_000, 10)  # a first run's: no lower, the window begins
    assert stats.proven_bytes(10) == 0  # the warm-up's and one real reading prove nothing
    stats.observe(900, 10)
    assert stats.proven_bytes(10) == 900  # the lower of the two highest real ones
    assert stats.proven_bytes(9) == 0  # nothing of 9 units or fewer was measured
    stats.observe(1_000, 5)
    assert stats.proven_bytes(100) == 1_000
