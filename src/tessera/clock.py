"""Time as a dependency: policy code takes a ``Clock`` so tests can fake it.

Every wait that is bounded by time goes through the clock: ``sleep`` to wait
for time itself, ``timeout`` (or ``wait_for``) to bound a wait on something
else. Code that calls ``asyncio.sleep`` or ``asyncio.wait_for`` on real
seconds cannot be tested without waiting in real time.

Design notes on ``FakeClock`` (after trio's ``MockClock``):

- Fake time moves only forward, and only when told to (``advance``) or, with
  ``autojump`` on, when every task on the loop is blocked: the clock then jumps
  to the earliest pending deadline, as trio's ``autojump_threshold=0`` does.
  A test never sleeps in real time, and the order of wake-ups is the order of
  the deadlines, whatever the real machine's speed.
- "Every task is blocked" is read from the event loop's ready queue: nothing
  left to run in this turn but autojump checks. A task that waits on a thread
  or on real I/O counts as blocked, so fake time may jump while it waits (trio
  does the same); tests that wait on threads bound those waits by events.
- A deadline fires when fake time reaches it (``now() >= deadline``); a sleep
  of zero or less only yields to the loop, as ``asyncio.sleep(0)`` does.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

T = TypeVar("T")


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic seconds, and ways to wait on them."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    def call_later(self, seconds: float, fn: Callable[[], object]) -> Cancellable:
        """Call ``fn`` on the event loop once ``seconds`` of this clock have
        passed, unless cancelled first (a timer, with no task or future of its own)."""
        ...

    def timeout(self, seconds: float | None) -> AbstractAsyncContextManager[None]:
        """Bound the enclosed block by ``seconds`` on this clock (``None``:
        unbounded); ``TimeoutError`` when they pass first."""
        ...

    async def wait_for(self, aw: Awaitable[T], timeout_s: float | None) -> T:
        """Await ``aw`` for at most ``timeout_s`` seconds of this clock (``None``:
        no bound); on timeout ``aw`` is cancelled and ``TimeoutError`` raised."""
        ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` and asyncio's own timers."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    def call_later(self, seconds: float, fn: Callable[[], object]) -> Cancellable:
        return asyncio.get_running_loop().call_later(max(0.0, seconds), fn)

    @asynccontextmanager
    async def timeout(self, seconds: float | None) -> AsyncIterator[None]:
        async with asyncio.timeout(seconds):
            yield

    async def wait_for(self, aw: Awaitable[T], timeout_s: float | None) -> T:
        return await asyncio.wait_for(aw, timeout_s)


@dataclass(order=True, slots=True)
class _Timer:
    deadline: float
    seq: int
    fire: Callable[[], object] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A clock that moves when told to (``advance``) or, with ``autojump`` (the
    default), when every task is blocked on it; see the module notes."""

    def __init__(self, start: float = 0.0, *, autojump: bool = True) -> None:
        self._now = start
        self.autojump = autojump
        self._timers: list[_Timer] = []
        self._seq = itertools.count()
        self._armed: asyncio.AbstractEventLoop | None = None

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` and fire the deadlines now passed."""
        if seconds < 0:
            raise ValueError("a clock does not go back")
        self._now += seconds
        self._fire_due()

    def jump_to_next(self) -> bool:
        """Move time to the earliest pending deadline and fire it; False if none."""
        self._drop_cancelled()
        if not self._timers:
            return False
        self._now = max(self._now, self._timers[0].deadline)
        self._fire_due()
        return True

    @property
    def num_pending(self) -> int:
        """Sleepers and bounded waits not yet at their deadline."""
        return sum(not t.cancelled for t in self._timers)

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        timer = self._add(seconds, wake)
        try:
            await woken
        finally:
            timer.cancelled = True

    @asynccontextmanager
    async def timeout(self, seconds: float | None) -> AsyncIterator[None]:
        # asyncio's own Timeout does the cancelling and the TimeoutError (with
        # the corner cases of cancellation it handles); fake time only says when.
        async with asyncio.timeout(None) as scope:
            if seconds is None:
                yield
                return
            loop = asyncio.get_running_loop()
            timer = self._add(seconds, lambda: scope.reschedule(loop.time()))
            try:
                yield
            finally:
                timer.cancelled = True

    async def wait_for(self, aw: Awaitable[T], timeout_s: float | None) -> T:
        async with self.timeout(timeout_s):
            return await aw

    def call_later(self, seconds: float, fn: Callable[[], object]) -> Cancellable:
        return self._add(seconds, fn)

    # -- internals ----------------------------------------------------------

    def _add(self, seconds: float, fire: Callable[[], object]) -> _Timer:
        timer = _Timer(self._now + max(0.0, seconds), next(self._seq), fire)
        heapq.heappush(self._timers, timer)
        if timer.deadline <= self._now:
            self._fire_due()
        self._arm()
        return timer

    def _drop_cancelled(self) -> None:
        while self._timers and self._timers[0].cancelled:
            heapq.heappop(self._timers)

    def _fire_due(self) -> None:
        self._drop_cancelled()
        while self._timers and self._timers[0].deadline <= self._now:
            timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                timer.cancelled = True
                timer.fire()
            self._drop_cancelled()

    def _arm(self) -> None:
        if not self.autojump or self._armed is not None or not self._timers:
            return
        loop = asyncio.get_running_loop()
        self._armed = loop
        loop.call_soon(self._autojump_check)

    def _autojump_check(self) -> None:
        loop, self._armed = self._armed, None
        self._drop_cancelled()
        if loop is None or not self._timers:
            return
        if not _loop_idle(loop):
            self._armed = loop
            loop.call_soon(self._autojump_check)
            return
        self.jump_to_next()
        self._arm()


def _loop_idle(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether nothing but autojump checks is ready to run on ``loop`` this turn.

    Reads asyncio's ready queue (``BaseEventLoop._ready``); a loop without one
    counts as idle, so the clock jumps after one turn of it.
    """
    ready = getattr(loop, "_ready", ())
    for handle in ready:
        callback = getattr(handle, "_callback", None)
        if getattr(callback, "__func__", None) is not FakeClock._autojump_check:
            return False
    return True
