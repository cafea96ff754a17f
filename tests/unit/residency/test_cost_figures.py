"""Two figures read outside the residency table and the policy: the bytes the
models themselves hold (``weight_bytes``: what a rollout reports it freed or
used) and what evicting a model is expected to cost (``expected_cost``: what a
caller short of room weighs busy models against idle ones by)."""

from __future__ import annotations

import pytest

from tessera.footprint import Footprint
from tessera.residency import ResidencyTable
from tessera.residency.policy import DEFAULT_LOAD_S, eviction_score, expected_cost
from tessera.residency.table import ModelEntry


def test_weight_bytes_are_the_used_bytes_less_the_batches_rooms() -> None:
    table = ResidencyTable(1000)
    assert table.begin_load("a", Footprint(300, {"enc": 100}))
    table.mark_ready("a", 0.0)
    assert table.begin_load("b", Footprint(200, {"enc": 100}))
    table.mark_ready("b", 0.0)
    first = table.reserve("a", 150, 1.0)
    second = table.reserve("b", 50, 1.0)
    assert first is not None
    assert second is not None
    assert (table.used_bytes(), table.weight_bytes()) == (800, 600)
    table.release(first, 2.0)
    assert (table.used_bytes(), table.weight_bytes()) == (650, 600)


def test_the_expected_cost_is_uses_times_miss_seconds_over_the_target() -> None:
    entry = ModelEntry(
        "m",
        target_s=2.0,
        footprint=Footprint(400),
        use_weight=3.0,
        last_used=5.0,
        miss_s=0.5,
    )
    assert expected_cost(entry, 5.0) == pytest.approx(3.0 * 0.5 / 2.0)
    assert expected_cost(entry, 5.0) == pytest.approx(eviction_score(entry, 5.0) * 400)


def test_a_model_of_no_bytes_costs_its_uses_and_misses_still() -> None:
    entry = ModelEntry("empty", use_weight=2.0, last_used=0.0)  # no target: 1 s
    assert expected_cost(entry, 0.0) == pytest.approx(2.0 * DEFAULT_LOAD_S / 1.0)


def test_before_any_miss_a_model_costs_its_load_seconds_and_after_one_its_miss() -> None:
    entry = ModelEntry("m", footprint=Footprint(100), use_weight=1.0, load_s=4.0)
    assert expected_cost(entry, 0.0) == pytest.approx(4.0)
    entry.miss_s = 0.5
    assert expected_cost(entry, 0.0) == pytest.approx(0.5)
