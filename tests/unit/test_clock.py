"""The fake clock: sleeps and bounded waits complete on fake time, which jumps
when every task is blocked on it; the real clock bounds waits the same way."""

from __future__ import annotations

import asyncio

import pytest

from tessera.clock import Clock, FakeClock, MonotonicClock


async def test_sleepers_wake_in_deadline_order_at_their_deadlines() -> None:
    clock = FakeClock(100.0)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.now()))

    await asyncio.gather(sleeper("late", 30.0), sleeper("early", 5.0), sleeper("mid", 10.0))
    assert woke == [("early", 105.0), ("mid", 110.0), ("late", 130.0)]
    assert clock.num_pending == 0


async def test_autojump_waits_while_any_task_can_run() -> None:
    # Time jumps only when every task is blocked: a task that keeps running
    # (here for a hundred turns of the loop) sees fake time stand still.
    clock = FakeClock()
    seen: list[float] = []

    async def busy() -> None:
        for _ in range(100):
            seen.append(clock.now())
            await asyncio.sleep(0)

    await asyncio.gather(clock.sleep(1.0), busy())
    assert set(seen) == {0.0}
    assert clock.now() == 1.0


async def test_manual_clock_moves_only_when_advanced() -> None:
    clock = FakeClock(autojump=False)
    sleeper = asyncio.ensure_future(clock.sleep(10.0))
    for _ in range(10):
        await asyncio.sleep(0)
    assert not sleeper.done()
    clock.advance(9.0)
    await asyncio.sleep(0)
    assert not sleeper.done()
    clock.advance(1.0)  # exactly at the deadline
    await sleeper
    assert clock.now() == 10.0


async def test_jump_to_next_moves_to_the_earliest_deadline() -> None:
    clock = FakeClock(autojump=False)
    first = asyncio.ensure_future(clock.sleep(3.0))
    second = asyncio.ensure_future(clock.sleep(7.0))
    await asyncio.sleep(0)
    assert clock.jump_to_next()
    await first
    assert clock.now() == 3.0
    assert not second.done()
    assert clock.jump_to_next()
    await second
    assert not clock.jump_to_next()
    assert clock.now() == 7.0


async def test_wait_for_times_out_on_fake_time_and_cancels_the_wait() -> None:
    clock = FakeClock()
    never: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await clock.wait_for(never, 30.0)
    assert clock.now() == 30.0
    assert never.cancelled()
    assert clock.num_pending == 0


async def test_wait_for_returns_what_finishes_before_the_deadline() -> None:
    clock = FakeClock()

    async def answer() -> str:
        await clock.sleep(2.0)
        return "done"

    assert await clock.wait_for(answer(), 5.0) == "done"
    assert clock.now() == 2.0
    # The deadline left behind is dropped: nothing jumps time to it.
    await clock.sleep(0)
    assert clock.num_pending == 0
    assert clock.now() == 2.0


async def test_a_timer_fires_at_its_deadline_unless_cancelled() -> None:
    clock = FakeClock()
    fired: list[float] = []
    clock.call_later(3.0, lambda: fired.append(clock.now()))
    cancelled = clock.call_later(1.0, lambda: fired.append(-1.0))
    cancelled.cancel()
    await clock.sleep(5.0)
    assert fired == [3.0]
    assert clock.num_pending == 0


async def test_the_real_clocks_timer_fires_on_the_loop() -> None:
    clock: Clock = MonotonicClock()
    fired = asyncio.Event()
    clock.call_later(0.0, fired.set)
    clock.call_later(0.0, lambda: None).cancel()
    await clock.wait_for(fired.wait(), 10.0)


async def test_wait_for_without_a_bound_waits_for_the_answer() -> None:
    clock = FakeClock()
    event = asyncio.Event()
    waiter = asyncio.ensure_future(clock.wait_for(event.wait(), None))
    await asyncio.sleep(0)
    assert clock.num_pending == 0
    event.set()
    assert await waiter is True


async def test_timeout_bounds_a_block_on_fake_time() -> None:
    clock = FakeClock(autojump=False)
    event = asyncio.Event()

    async def bounded() -> None:
        async with clock.timeout(1.5):
            await event.wait()

    task = asyncio.ensure_future(bounded())
    await asyncio.sleep(0)
    clock.advance(1.0)
    await asyncio.sleep(0)
    assert not task.done()
    clock.advance(0.5)
    with pytest.raises(TimeoutError):
        await task


async def test_a_cancelled_sleeper_leaves_no_deadline_behind() -> None:
    clock = FakeClock()
    sleeper = asyncio.ensure_future(clock.sleep(60.0))
    await asyncio.sleep(0)
    sleeper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeper
    assert clock.num_pending == 0
    assert clock.now() == 0.0


async def test_sleep_of_zero_only_yields() -> None:
    clock = FakeClock(5.0)
    await clock.sleep(0)
    await clock.sleep(-1.0)
    assert clock.now() == 5.0


def test_a_clock_does_not_go_back() -> None:
    with pytest.raises(ValueError, match="back"):
        FakeClock().advance(-1.0)


async def test_real_clock_bounds_waits_too() -> None:
    clock: Clock = MonotonicClock()
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await clock.wait_for(never, 0.0)
    assert never.cancelled()
    assert await clock.wait_for(asyncio.sleep(0, "ok"), 10.0) == "ok"
    with pytest.raises(TimeoutError):
        async with clock.timeout(0.0):
            await asyncio.Event().wait()


def test_both_clocks_implement_the_protocol() -> None:
    clocks: list[Clock] = [MonotonicClock(), FakeClock()]
    assert all(callable(c.wait_for) and callable(c.timeout) for c in clocks)
