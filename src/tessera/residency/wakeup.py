"""Wake-ups: callers waiting for room sleep here until a change may help them.

Invariants:

- Every sleeper has a bound: a timer on the injected clock wakes it at the
  latest then (a fake clock can jump it). Reason: nothing waits unbounded,
  and tests need no real time.
- A sleeper on no place wakes at every ``wake_all`` (the bytes changed); a
  sleeper on a place wakes only when ``wake`` names that place (it became
  the line's head). Reason: only becoming the head lets a load behind
  others on, so waking every one at each change would cost O(waiters).
- A place's set of sleepers exists only while it has some.
"""

from __future__ import annotations

import asyncio

from tessera.clock import Clock


def _wake(sleepers: set[asyncio.Future[None]]) -> None:
    for woken in sleepers:
        if not woken.done():
            woken.set_result(None)


class Wakeups:
    """Sleepers for any change, and sleepers for a place in line."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._any: set[asyncio.Future[None]] = set()
        self._by_place: dict[object, set[asyncio.Future[None]]] = {}

    def has_sleepers(self) -> bool:
        """Whether a caller sleeps until any change."""
        return bool(self._any)

    def num_places(self) -> int:
        """Places in line with a sleeper."""
        return len(self._by_place)

    def wake_all(self) -> None:
        """Wake every sleeper waiting for any change."""
        woken, self._any = self._any, set()
        _wake(woken)

    def wake(self, place: object) -> None:
        """Wake the sleepers on ``place``."""
        _wake(self._by_place.pop(place, set()))

    async def sleep(self, bound_s: float, place: object = None) -> None:
        """Sleep until woken (on ``place``, where given) or ``bound_s`` pass."""
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        sleepers = self._any if place is None else self._by_place.setdefault(place, set())
        sleepers.add(woken)
        timer = self._clock.call_later(bound_s, lambda: _wake({woken}))
        try:
            await woken
        finally:
            timer.cancel()
            sleepers.discard(woken)
            if not sleepers and self._by_place.get(place) is sleepers:
                del self._by_place[place]
