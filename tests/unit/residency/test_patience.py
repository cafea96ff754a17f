"""Patience bounded by running batches' predicted ends (``patience.py``); on a
fake clock."""

from __future__ import annotations

import pytest

from tessera.clock import FakeClock
from tessera.residency.patience import BatchEnds, Patience


def test_a_model_runs_a_batch_from_start_until_end() -> None:
    ends = BatchEnds(FakeClock())
    ends.start("m", 1.0)
    assert "m" in ends
    ends.end("m")
    assert "m" not in ends
    ends.end("m")  # ending twice is harmless


def test_patience_ends_at_the_latest_batch_end_plus_its_run_again() -> None:
    clock = FakeClock(10.0)
    ends = BatchEnds(clock)
    ends.start("a", 1.0)  # ends at 11, bound 12
    ends.start("b", 2.0)  # ends at 12, bound 14
    patience = Patience(100.0)
    assert ends.bound(patience, ["a", "b"])
    assert patience.until == pytest.approx(14.0)
    clock.advance(4.0)
    assert not ends.bound(patience, ["a", "b"])


def test_a_later_start_moves_the_end_and_an_earlier_one_does_not() -> None:
    clock = FakeClock()
    ends = BatchEnds(clock)
    ends.start("m", 5.0)
    clock.advance(1.0)
    ends.start("m", 1.0)  # ends at 2, before 5: the batch ending at 5 still runs
    patience = Patience(100.0)
    ends.bound(patience, ["m"])
    assert patience.until == pytest.approx(10.0)
    ends.start("m", 5.0)  # ends at 6: the latest now
    patience = Patience(100.0)
    ends.bound(patience, ["m"])
    assert patience.until == pytest.approx(11.0)


def test_patience_only_shrinks() -> None:
    ends = BatchEnds(FakeClock())
    ends.start("m", 10.0)
    patience = Patience(3.0)
    assert ends.bound(patience, ["m"])
    assert patience.until == 3.0


def test_a_busy_model_with_no_predicted_end_leaves_the_patience_as_it_is() -> None:
    clock = FakeClock()
    ends = BatchEnds(clock)
    ends.start("known", 0.5)
    patience = Patience(3.0)
    assert ends.bound(patience, ["known", "loading"])
    assert patience.until == 3.0
    clock.advance(3.0)
    assert not ends.bound(patience, ["loading"])


def test_with_nothing_busy_the_patience_ends_now() -> None:
    ends = BatchEnds(FakeClock())
    patience = Patience(3.0)
    assert not ends.bound(patience, [])


def test_a_batch_ending_before_the_latest_does_not_move_it_whatever_its_run() -> None:
    clock = FakeClock(4.0)
    ends = BatchEnds(clock)
    ends.start("m", 1.0)  # ends at 5
    ends.start("m", 0.5)  # ends at 4.5, before 5: the end stays 5 (and its run 1)
    patience = Patience(100.0)
    ends.bound(patience, ["m"])
    assert patience.until == pytest.approx(6.0)


def test_a_batch_ending_with_the_latest_keeps_the_first_ones_run() -> None:
    clock = FakeClock()
    ends = BatchEnds(clock)
    ends.start("m", 5.0)  # ends at 5, runs 5
    clock.advance(4.0)
    ends.start("m", 1.0)  # ends at 5 too
    patience = Patience(100.0)
    ends.bound(patience, ["m"])
    assert patience.until == pytest.approx(10.0)
