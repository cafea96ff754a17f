"""Held rooms (``hold.py``): one per model, given back once, by the next batch
or by the timer; on a fake clock."""

from __future__ import annotations

import pytest

from tessera.clock import FakeClock
from tessera.residency.hold import HOLD_SLACK_S, HeldRooms
from tessera.residency.table import Reservation


def test_a_room_is_kept_until_its_timer_ends_then_given_back_once() -> None:
    clock = FakeClock(autojump=False)
    held = HeldRooms(clock)
    expired: list[str] = []
    assert held.keep(Reservation("m", 100), 0.01, expired.append)
    assert "m" in held
    clock.advance(0.01 + HOLD_SLACK_S - 0.001)
    assert expired == []
    clock.advance(0.001)
    assert expired == ["m"]


def test_the_next_batch_takes_the_room_and_the_timer_is_cancelled() -> None:
    clock = FakeClock(autojump=False)
    held = HeldRooms(clock)
    expired: list[str] = []
    room = Reservation("m", 100)
    held.keep(room, 0.01, expired.append)
    assert held.take("m") is room
    assert "m" not in held
    assert held.take("m") is None
    clock.advance(1.0)
    assert expired == []
    assert clock.num_pending == 0


def test_a_model_keeps_one_room_and_only_one_of_some_bytes() -> None:
    held = HeldRooms(FakeClock(autojump=False))
    assert not held.keep(Reservation("empty", 0), 1.0, lambda _: None)
    assert "empty" not in held
    assert held.keep(Reservation("m", 10), 1.0, lambda _: None)
    assert not held.keep(Reservation("m", 20), 1.0, lambda _: None)
    taken = held.take("m")
    assert taken is not None
    assert taken.num_bytes == 10


@pytest.mark.parametrize("wait_s", [0.0, 0.2])
def test_the_room_is_kept_for_the_gathering_wait_and_the_slack(wait_s: float) -> None:
    clock = FakeClock(autojump=False)
    held = HeldRooms(clock)
    expired: list[str] = []
    held.keep(Reservation("m", 1), wait_s, expired.append)
    clock.jump_to_next()
    assert expired == ["m"]
    assert clock.now() == pytest.approx(wait_s + HOLD_SLACK_S)
