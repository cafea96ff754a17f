"""Compute slots (``scheduling/slot.py``): short batches first, long work in steps.

Plain calls with the time passed in: no threads, no clock. ``check`` asserts
the invariants of the module notes after every call.
"""

from __future__ import annotations

import random

import pytest

from tessera.scheduling.slot import ComputeSlots, SlotClaim

LONG_S = 0.5  # long work: predicted at 0.5 s or more
SHORT = 0.01
LONG = 3.0


def check(slots: ComputeSlots, claims: list[SlotClaim], now: float) -> None:
    """The invariants that hold between calls."""
    holding = [c for c in claims if c.holding]
    assert slots.num_holding == len(holding) <= slots.num_slots
    if slots.num_short_waiting:  # a short batch waits only while every slot is held
        assert slots.num_holding == slots.num_slots
    free = slots.num_holding < slots.num_slots
    long_waiting = slots.num_waiting - slots.num_short_waiting
    if free and long_waiting:  # a long one waits beside a free slot only beyond its share
        assert slots.num_long_holding >= slots.long_share(now)


def test_a_short_batch_takes_the_only_slot_at_the_long_ones_next_boundary() -> None:
    slots = ComputeSlots(1, LONG_S)
    long = slots.claim(LONG, now=0.0)
    assert long.holding
    assert not slots.boundary(long, now=0.1)  # nobody waits: it keeps computing
    short = slots.claim(SHORT, now=0.2)
    assert not short.holding
    check(slots, [long, short], 0.2)
    assert slots.boundary(long, now=0.3)  # the next boundary: it gives the slot up
    assert short.holding
    assert not long.holding
    check(slots, [long, short], 0.3)
    slots.release(short, now=0.31)
    assert long.holding  # and gets it back once the short batch has run
    assert slots.num_yields == 1


def test_short_batches_are_granted_before_long_ones_in_arrival_order() -> None:
    slots = ComputeSlots(1, LONG_S)
    first = slots.claim(SHORT, now=0.0)
    long = slots.claim(LONG, now=0.0)
    second, third = slots.claim(SHORT, now=0.1), slots.claim(None, now=0.2)  # unpredicted: short
    granted = []
    for now, claim in ((1.0, first), (1.1, second), (1.2, third)):
        slots.release(claim, now)
        check(slots, [first, long, second, third], now)
        granted.append(next(c for c in (second, third, long) if c.holding))
    assert granted == [second, third, long]


def test_while_short_work_is_active_long_batches_leave_it_a_worker() -> None:
    slots = ComputeSlots(2, LONG_S, active_s=2.0)
    short = slots.claim(SHORT, now=0.0)
    slots.release(short, now=0.1)
    first, second = slots.claim(LONG, now=0.2), slots.claim(LONG, now=0.2)
    assert first.holding
    assert not second.holding
    check(slots, [first, second], 0.2)
    later = slots.claim(SHORT, now=0.5)
    assert later.holding  # at once: no step boundary to wait for
    slots.release(later, now=0.6)
    assert not second.holding
    # Short work idle for active_s: the kept worker goes to long work.
    assert slots.wake_in(now=1.0) == pytest.approx(1.6)
    assert not slots.regrant(now=2.5)
    assert slots.regrant(now=2.6)
    assert second.holding
    assert slots.wake_in(now=2.6) is None


def test_a_long_batch_over_its_share_gives_its_slot_up_when_short_work_returns() -> None:
    slots = ComputeSlots(2, LONG_S, active_s=2.0)
    first, second = slots.claim(LONG, now=0.0), slots.claim(LONG, now=0.0)
    assert first.holding
    assert second.holding
    short = slots.claim(SHORT, now=1.0)
    assert not short.holding
    assert slots.boundary(first, now=1.1)  # a short batch waits
    assert short.holding
    slots.release(short, now=1.2)
    assert not first.holding  # short work is active: long work keeps to one slot
    assert slots.boundary(second, now=1.3)  # held since 0.0: the waiting one's turn
    assert first.holding
    assert not second.holding
    assert not slots.boundary(first, now=1.4)  # its turn has just begun
    assert slots.boundary(first, now=1.3 + LONG_S)
    assert second.holding
    check(slots, [first, second, short], 1.3 + LONG_S)


def test_long_batches_take_turns_of_a_quantum_in_arrival_order() -> None:
    slots = ComputeSlots(1, LONG_S, quantum_s=1.0)
    a, b, c = (slots.claim(LONG, now=0.0) for _ in range(3))
    assert not slots.boundary(a, now=0.5)  # within its quantum
    assert slots.boundary(a, now=1.0)
    assert b.holding
    assert slots.boundary(b, now=2.0)
    assert c.holding  # b waits behind a, who waited first
    assert slots.boundary(c, now=3.0)
    assert a.holding
    check(slots, [a, b, c], 3.0)


def test_a_short_batch_that_runs_as_long_as_long_work_takes_turns_from_then() -> None:
    slots = ComputeSlots(1, LONG_S)
    misjudged = slots.claim(SHORT, now=0.0)
    waiting = slots.claim(SHORT, now=0.1)
    assert not slots.boundary(misjudged, now=0.4)  # still short: it runs whole
    assert slots.boundary(misjudged, now=0.5)  # as long as long work: it yields
    assert misjudged.long
    assert waiting.holding


def test_a_batch_that_waits_for_a_lock_gives_its_slot_up() -> None:
    slots = ComputeSlots(1, LONG_S)
    paused, blocked = slots.claim(LONG, now=0.0), slots.claim(LONG, now=0.0)
    short = slots.claim(SHORT, now=0.1)
    assert slots.boundary(paused, now=0.2)  # to the short batch; then blocked's turn
    slots.release(short, now=0.3)
    assert blocked.holding
    slots.suspend(blocked, now=0.4)  # it waits for a lock the paused batch holds
    assert paused.holding
    slots.resume(blocked, now=0.5)
    assert not blocked.holding
    slots.release(paused, now=0.6)
    assert blocked.holding
    check(slots, [paused, blocked, short], 0.6)


def test_a_claim_released_while_it_waits_leaves_the_line() -> None:
    slots = ComputeSlots(1, LONG_S)
    holder, gone = slots.claim(LONG, now=0.0), slots.claim(SHORT, now=0.0)
    assert holder.holding
    assert not gone.holding
    slots.release(gone, now=0.1)
    assert slots.num_waiting == 0
    assert not slots.boundary(holder, now=0.2)  # nobody waits for it any more


def test_slots_are_at_least_one() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        ComputeSlots(0, LONG_S)


@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_random_calls_keep_the_invariants(num_slots: int) -> None:
    rng = random.Random(num_slots)
    slots = ComputeSlots(num_slots, LONG_S, active_s=1.0)
    claims: list[SlotClaim] = []
    suspended: list[SlotClaim] = []
    now = 0.0
    for _ in range(2000):
        now += rng.choice((0.0, 0.01, 0.3, 1.5))
        holding = [c for c in claims if c.holding]
        move = rng.random()
        if move < 0.3 or not claims:
            claims.append(slots.claim(rng.choice((SHORT, LONG, None)), now))
        elif move < 0.55 and holding:
            claim = rng.choice(holding)
            slots.release(claim, now)
            claims.remove(claim)
        elif move < 0.8 and holding:
            slots.boundary(rng.choice(holding), now)
        elif move < 0.9 and holding:
            claim = rng.choice(holding)
            slots.suspend(claim, now)
            suspended.append(claim)
        elif suspended:
            slots.resume(suspended.pop(0), now)
        else:
            slots.regrant(now)
        check(slots, claims, now)
    for claim in list(claims):
        slots.release(claim, now)
    assert slots.num_holding == slots.num_waiting == 0
