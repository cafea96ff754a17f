"""Wake-ups (``wakeup.py``): every sleep bounded on the clock, sleepers woken
all together or by place; on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from tessera.clock import FakeClock
from tessera.residency.wakeup import Wakeups


async def test_a_sleeper_wakes_at_any_change_before_its_bound() -> None:
    clock = FakeClock(autojump=False)
    wakeups = Wakeups(clock)
    sleeper = asyncio.ensure_future(wakeups.sleep(10.0))
    await asyncio.sleep(0)
    assert wakeups.has_sleepers()
    wakeups.wake_all()
    await sleeper
    assert clock.now() == 0.0
    assert not wakeups.has_sleepers()
    assert clock.num_pending == 0  # its timer is cancelled


async def test_a_sleeper_wakes_at_its_bound_on_the_clock() -> None:
    clock = FakeClock()
    wakeups = Wakeups(clock)
    await wakeups.sleep(2.5)
    assert clock.now() == pytest.approx(2.5)
    assert not wakeups.has_sleepers()


async def test_a_sleeper_on_a_place_wakes_only_when_its_place_is_named() -> None:
    clock = FakeClock(autojump=False)
    wakeups = Wakeups(clock)
    place, other = object(), object()
    on_place = asyncio.ensure_future(wakeups.sleep(10.0, place))
    on_other = asyncio.ensure_future(wakeups.sleep(10.0, other))
    await asyncio.sleep(0)
    assert wakeups.num_places() == 2
    wakeups.wake_all()
    await asyncio.sleep(0)
    assert not on_place.done()
    wakeups.wake(place)
    await on_place
    assert wakeups.num_places() == 1  # a place's set goes with its last sleeper
    assert not on_other.done()
    on_other.cancel()
    with pytest.raises(asyncio.CancelledError):
        await on_other
    assert wakeups.num_places() == 0


async def test_waking_a_place_with_no_sleeper_does_nothing() -> None:
    wakeups = Wakeups(FakeClock())
    wakeups.wake(object())
    wakeups.wake_all()
    assert wakeups.num_places() == 0
