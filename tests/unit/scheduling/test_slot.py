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


def check(slots: ComputeSlots, claims: list[SlotClaim], now: float = 0.0) -> None:
    """The invariants that hold between calls (``now``: the last call's time)."""
    holding = [c for c in claims if c.holding]
    assert slots.num_holding == len(holding)
    bound = slots.num_slots + slots.overdue_beyond
    assert slots.num_short_holding <= bound
    if slots.num_short_waiting:  # short batches wait only for one another, or owed long work
        owed = any(c.owed(now, slots.quantum_s) for c in holding)
        owed_waiting = any(c.owed(now, slots.quantum_s) for c in claims if c.long and not c.holding)
        overdue = any(c.overdue(now) for c in claims if not c.holding)
        every_slot_short = slots.num_short_holding >= slots.num_slots
        assert every_slot_short or (owed and slots.num_holding >= slots.num_slots)
        # An overdue one waits only for the bound, or (every slot short work's)
        # for owed long work that waits for the next slot.
        assert not overdue or (
            slots.num_short_holding == bound or (every_slot_short and owed_waiting)
        )
    overdue_at = [at for c in claims if (at := c.overdue_at) is not None]
    assert slots.next_overdue_at == min(overdue_at, default=None)
    if slots.num_waiting > slots.num_short_waiting:  # a long one waits only for a slot
        assert slots.num_holding >= slots.num_slots


def test_a_short_batch_never_waits_for_a_long_one_which_steps_aside_at_its_boundary() -> None:
    slots = ComputeSlots(1, LONG_S)
    long = slots.claim(LONG, now=0.0)
    assert long.holding
    assert not slots.boundary(long, now=0.1)  # alone: it keeps computing
    short = slots.claim(SHORT, now=0.2)
    assert short.holding  # at once, beside the long batch until its next step
    check(slots, [long, short])
    assert slots.boundary(long, now=0.3)  # its next boundary: the slot goes back
    assert not long.holding
    check(slots, [long, short])
    slots.release(short, now=0.31)
    assert long.holding  # and comes back once the short batch has run
    assert slots.num_yields == 1


def test_a_long_batch_that_reaches_no_boundary_keeps_its_slot() -> None:
    slots = ComputeSlots(1, LONG_S)
    long = slots.claim(LONG, now=0.0)
    short = slots.claim(SHORT, now=0.1)
    slots.release(short, now=0.2)  # the short batch ended before the long one's next step
    assert not slots.boundary(long, now=0.3)
    assert slots.num_yields == 0


def test_short_batches_wait_only_for_short_ones_in_arrival_order() -> None:
    slots = ComputeSlots(2, LONG_S)
    long = slots.claim(LONG, now=0.0)
    first, second = slots.claim(SHORT, now=0.1), slots.claim(None, now=0.1)  # None: short
    assert first.holding
    assert second.holding  # the long batch's slot counts as free to short work
    third, fourth = slots.claim(SHORT, now=0.2), slots.claim(SHORT, now=0.3)
    assert not third.holding  # every slot is short work's now
    check(slots, [long, first, second, third, fourth])
    slots.release(first, now=0.4)
    assert third.holding
    assert not fourth.holding
    slots.release(second, now=0.5)
    assert fourth.holding


def test_a_long_batch_waits_for_a_free_slot_after_the_short_ones() -> None:
    slots = ComputeSlots(1, LONG_S)
    short = slots.claim(SHORT, now=0.0)
    long = slots.claim(LONG, now=0.1)
    later_short = slots.claim(SHORT, now=0.2)
    assert not long.holding
    assert not later_short.holding
    slots.release(short, now=0.3)
    assert later_short.holding  # short work first, though it came after
    assert not long.holding
    slots.release(later_short, now=0.4)
    assert long.holding


def test_with_two_long_batches_the_first_to_reach_a_boundary_steps_aside() -> None:
    slots = ComputeSlots(2, LONG_S)
    ocr, chat = slots.claim(LONG, now=0.0), slots.claim(LONG, now=0.0)
    short = slots.claim(SHORT, now=0.1)
    assert short.holding
    assert slots.boundary(chat, now=0.15)  # a decode step ends first
    assert not slots.boundary(ocr, now=0.16)  # back to two slots held: it goes on
    slots.release(short, now=0.2)
    assert chat.holding
    check(slots, [ocr, chat, short])


@pytest.mark.parametrize("start", [0.0, 10.0])  # a turn counts from its grant
def test_long_batches_take_turns_of_a_quantum_in_arrival_order(start: float) -> None:
    slots = ComputeSlots(1, LONG_S, quantum_s=1.0)
    a, b, c = (slots.claim(LONG, now=start) for _ in range(3))
    assert not slots.boundary(a, now=start + 0.5)  # within its quantum
    assert slots.boundary(a, now=start + 1.0)
    assert b.holding
    assert slots.boundary(b, now=start + 2.0)
    assert c.holding  # b waits behind a, who waited first
    assert slots.boundary(c, now=start + 3.0)
    assert a.holding
    check(slots, [a, b, c], start + 3.0)


def test_a_batch_predicted_to_run_exactly_the_long_time_is_long_work() -> None:
    slots = ComputeSlots(1, LONG_S)
    assert slots.claim(LONG_S, now=0.0).long
    assert not slots.claim(LONG_S - 0.001, now=0.0).long


def test_a_batch_that_takes_turns_counts_every_turn_it_ran_and_waited() -> None:
    """Two long batches on one slot, turns of a second: each one's running and
    waiting add up over its turns, and whether it is owed weighs the sums."""
    slots = ComputeSlots(1, LONG_S, quantum_s=1.0)
    assert slots.num_grants == 0
    a, b = slots.claim(LONG, now=0.0), slots.claim(LONG, now=0.0)
    assert slots.boundary(a, now=1.0)  # b's turn
    assert slots.boundary(b, now=2.0)  # a's again: it waited 1 s
    assert (a.ran_s, a.waited_s) == (1.0, 1.0)
    # Holding since 2 s: at 2.5 s it has run 1.5 s in all, waited 1 s.
    assert not a.owed(2.5, 0.0)
    assert slots.boundary(a, now=3.0)
    assert (a.ran_s, a.waited_s) == (2.0, 1.0)
    assert (b.ran_s, b.waited_s) == (1.0, 2.0)
    # Waiting since 3 s: at 4.5 s it has waited 2.5 s in all, run 2 s.
    assert a.owed(4.5, 0.4)
    assert not a.owed(4.5, 0.6)
    assert slots.num_yields == 3
    assert slots.num_grants == 4  # a, b, a, b
    check(slots, [a, b], 3.0)


def test_owed_long_batches_take_only_the_free_slots() -> None:
    slots = ComputeSlots(1, LONG_S)
    short = slots.claim(SHORT, now=0.0)
    first, second = slots.claim(LONG, now=0.0), slots.claim(LONG, now=0.0)
    assert first.owed(1.0, slots.quantum_s)
    assert second.owed(1.0, slots.quantum_s)
    slots.release(short, now=1.0)
    assert first.holding  # the one free slot
    assert not second.holding
    assert slots.num_holding == 1
    check(slots, [first, second], 1.0)


@pytest.mark.parametrize("start", [0.0, 10.0])  # its run counts from its start
def test_a_short_batch_that_runs_as_long_as_long_work_takes_turns_from_then(start: float) -> None:
    slots = ComputeSlots(1, LONG_S)
    misjudged = slots.claim(SHORT, now=start)
    waiting = slots.claim(SHORT, now=start + 0.1)
    assert not waiting.holding
    assert not slots.boundary(misjudged, now=start + 0.4)  # still short: it runs whole
    assert not misjudged.long
    assert slots.boundary(misjudged, now=start + 0.5)  # long now: it steps aside for short work
    assert misjudged.long
    assert waiting.holding
    check(slots, [misjudged, waiting], start + 0.5)
    slots.release(waiting, now=start + 0.6)
    assert misjudged.holding


def test_a_batch_that_waits_for_a_lock_gives_its_slot_up() -> None:
    slots = ComputeSlots(1, LONG_S)
    paused, blocked = slots.claim(LONG, now=0.0), slots.claim(LONG, now=0.0)
    short = slots.claim(SHORT, now=0.1)
    assert slots.boundary(paused, now=0.2)  # a short batch runs; then blocked's turn
    slots.release(short, now=0.3)
    assert blocked.holding
    slots.suspend(blocked, now=0.4)  # it waits for a lock the paused batch holds
    assert paused.holding
    slots.resume(blocked, now=0.5)
    assert not blocked.holding
    slots.release(paused, now=0.6)
    assert blocked.holding
    check(slots, [paused, blocked, short])


def test_a_claim_released_while_it_waits_leaves_the_line() -> None:
    slots = ComputeSlots(1, LONG_S)
    holder, gone = slots.claim(SHORT, now=0.0), slots.claim(LONG, now=0.0)
    assert not gone.holding
    slots.release(gone, now=0.1)
    assert slots.num_waiting == 0
    assert not gone.owed(10.0, slots.quantum_s)  # its wait ended with its release
    tight = slots.claim(SHORT, now=0.2, wait_limit_s=LIMIT_S)
    slots.release(tight, now=0.3)
    assert tight.overdue_at is None
    assert slots.next_overdue_at is None
    slots.release(holder, now=0.2)
    assert slots.num_holding == 0


def test_long_work_that_waited_out_its_share_is_not_starved_by_short_work() -> None:
    """Short batches one after another on the only slot: a long batch waits
    until it has waited a quantum longer than it ran, then takes the next
    free slot before them, keeps it at its boundaries, and no short batch
    takes one beyond it until it has computed as long as it waited."""
    slots = ComputeSlots(1, LONG_S)
    short = slots.claim(SHORT, now=0.0)
    long = slots.claim(LONG, now=0.0)
    now = 0.0
    while not long.holding:
        now += 0.1
        waiting = slots.claim(SHORT, now)  # short work keeps coming
        slots.release(short, now)
        short = waiting
        check(slots, [short, long], now)
    assert now == pytest.approx(LONG_S + 0.1)  # owed at its first grant after a quantum
    assert not short.holding  # the owed long batch went first
    assert not slots.boundary(long, now + 0.05)  # still owed: it computes on
    assert not short.holding  # and no short batch takes a slot beyond it
    # Once it has computed as long as it waited (less a quantum), short work
    # goes first again: long work gets about half the slot under a stream of it.
    assert slots.boundary(long, now + 0.3)
    assert short.holding
    slots.release(short, now + 0.8)
    slots.release(long, now + 0.8)
    assert slots.num_holding == slots.num_waiting == 0


def owed_beside_short(slots: ComputeSlots) -> tuple[SlotClaim, SlotClaim]:
    """On two slots: a short batch holding one from 0.0, and a long batch that
    waited for the other until OWED_AT, owed from then on for a while."""
    assert slots.num_slots == 2
    short, other = slots.claim(SHORT, now=0.0), slots.claim(SHORT, now=0.0)
    long = slots.claim(LONG, now=0.0)
    slots.release(other, now=OWED_AT)
    assert long.holding
    assert long.owed(OWED_AT, slots.quantum_s)
    return short, long


OWED_AT = 2.0  # 1.5 s more than a quantum (LONG_S) after the long batch's claim
LIMIT_S = 0.125  # a short claim's wait limit (exact in binary: the times below are)


def test_an_overdue_short_claim_takes_a_slot_beside_owed_long_work() -> None:
    slots = ComputeSlots(2, LONG_S)
    short, long = owed_beside_short(slots)
    tight = slots.claim(SHORT, now=OWED_AT, wait_limit_s=LIMIT_S)
    assert not tight.holding  # owed long work keeps its slot: none beyond it yet
    assert slots.next_overdue_at == OWED_AT + LIMIT_S
    claims = [short, long, tight]
    check(slots, claims, OWED_AT)
    slots.tick(OWED_AT + LIMIT_S - 0.001)
    assert not tight.holding  # not overdue yet
    check(slots, claims, OWED_AT + LIMIT_S - 0.001)
    slots.tick(OWED_AT + LIMIT_S)
    assert tight.holding  # overdue: a slot beyond the owed batch's
    assert slots.num_holding == 3
    assert slots.next_overdue_at is None
    check(slots, claims, OWED_AT + LIMIT_S)
    # The owed batch computes on beside it while owed, and steps aside once not.
    assert not slots.boundary(long, now=OWED_AT + LIMIT_S + 0.001)
    assert slots.boundary(long, now=2 * OWED_AT)
    check(slots, claims, 2 * OWED_AT)


def test_without_a_wait_limit_a_short_claim_waits_for_owed_long_work_as_before() -> None:
    slots = ComputeSlots(2, LONG_S)
    short, long = owed_beside_short(slots)
    patient = slots.claim(SHORT, now=OWED_AT)
    assert slots.next_overdue_at is None
    slots.tick(OWED_AT + LIMIT_S)
    assert long.owed(OWED_AT + LIMIT_S, slots.quantum_s)
    assert not patient.holding
    check(slots, [short, long, patient], OWED_AT + LIMIT_S)
    slots.release(short, now=OWED_AT + 2 * LIMIT_S)
    assert patient.holding  # a free slot, as ever


def test_a_long_claims_wait_limit_makes_it_no_overdue_short_work() -> None:
    slots = ComputeSlots(1, LONG_S)
    holder = slots.claim(SHORT, now=0.0)
    long = slots.claim(LONG, now=0.0, wait_limit_s=LIMIT_S)
    assert long.overdue_at is None
    assert not long.overdue(10.0)
    slots.release(holder, now=0.1)
    assert long.holding


def test_overdue_claims_go_beyond_owed_work_first_in_their_arrival_order() -> None:
    """A claim with no limit at the head of the line waits; the overdue ones
    behind it take the slots short work may hold, in arrival order, and never
    more: short batches hold at most every slot."""
    slots = ComputeSlots(2, LONG_S)
    short, long = owed_beside_short(slots)
    patient = slots.claim(SHORT, now=OWED_AT)
    first = slots.claim(SHORT, now=OWED_AT, wait_limit_s=LIMIT_S)
    second = slots.claim(SHORT, now=OWED_AT, wait_limit_s=LIMIT_S / 2)
    claims = [short, long, patient, first, second]
    assert slots.next_overdue_at == OWED_AT + LIMIT_S / 2
    slots.tick(OWED_AT + LIMIT_S)  # both overdue: the first to arrive goes
    assert first.holding
    assert not second.holding  # short batches hold both slots now
    assert not patient.holding
    assert slots.num_short_holding == slots.num_slots
    check(slots, claims, OWED_AT + LIMIT_S)
    slots.release(short, now=OWED_AT + 2 * LIMIT_S)
    assert second.holding  # overdue: before the head of the line, beyond the owed batch
    assert not patient.holding
    check(slots, claims, OWED_AT + 2 * LIMIT_S)


def test_a_resumed_short_claim_counts_its_wait_limit_from_its_return() -> None:
    slots = ComputeSlots(1, LONG_S)
    claim = slots.claim(SHORT, now=0.0, wait_limit_s=LIMIT_S)
    slots.suspend(claim, now=0.25)
    assert claim.overdue_at is None  # not in line
    other = slots.claim(SHORT, now=0.25)
    slots.resume(claim, now=0.5)
    assert claim.overdue_at == 0.5 + LIMIT_S
    check(slots, [claim, other], 0.5)


def test_slots_are_at_least_one() -> None:
    with pytest.raises(ValueError, match=r"^num_slots must be >= 1$"):
        ComputeSlots(0, LONG_S)
    with pytest.raises(ValueError, match=r"^overdue_beyond must be >= 0$"):
        ComputeSlots(1, LONG_S, overdue_beyond=-1)


def short_work_on_every_slot(slots: ComputeSlots) -> list[SlotClaim]:
    claims = [slots.claim(SHORT, now=0.0) for _ in range(slots.num_slots)]
    assert all(c.holding for c in claims)
    return claims


def test_an_overdue_short_claim_takes_a_slot_beyond_short_work_on_every_slot() -> None:
    slots = ComputeSlots(2, LONG_S, overdue_beyond=2)
    claims = short_work_on_every_slot(slots)
    tight = slots.claim(SHORT, now=0.0, wait_limit_s=LIMIT_S)
    patient = slots.claim(SHORT, now=0.0)
    claims += [tight, patient]
    assert not tight.holding
    assert slots.next_overdue_at == LIMIT_S
    slots.tick(LIMIT_S - 0.001)
    assert not tight.holding  # not overdue yet
    check(slots, claims, LIMIT_S - 0.001)
    slots.tick(LIMIT_S)
    assert tight.holding  # overdue: a third slot, beside the two short batches
    assert slots.num_short_holding == 3
    assert not patient.holding  # no limit: it waits for a free slot
    check(slots, claims, LIMIT_S)
    slots.tick(10.0)
    assert not patient.holding
    slots.release(claims[0], now=10.0)
    assert not patient.holding  # short work still holds every slot (one beyond)
    check(slots, claims, 10.0)
    slots.release(tight, now=10.1)
    assert patient.holding


def test_overdue_claims_go_beyond_every_slot_up_to_the_bound() -> None:
    slots = ComputeSlots(2, LONG_S, overdue_beyond=2)
    claims = short_work_on_every_slot(slots)
    tight = [slots.claim(SHORT, now=0.0, wait_limit_s=LIMIT_S) for _ in range(3)]
    claims += tight
    slots.tick(LIMIT_S)
    assert [c.holding for c in tight] == [True, True, False]  # arrival order, to the bound
    assert slots.num_short_holding == 4
    check(slots, claims, LIMIT_S)
    slots.release(tight[0], now=0.2)
    assert tight[2].holding
    check(slots, claims, 0.2)


def test_without_a_bound_an_overdue_claim_waits_for_short_work_on_every_slot() -> None:
    slots = ComputeSlots(2, LONG_S)
    claims = short_work_on_every_slot(slots)
    tight = slots.claim(SHORT, now=0.0, wait_limit_s=LIMIT_S)
    slots.tick(LIMIT_S)
    assert not tight.holding
    check(slots, [*claims, tight], LIMIT_S)


def test_an_owed_long_batch_keeps_its_slot_beside_overdue_work_beyond_every_slot() -> None:
    slots = ComputeSlots(2, LONG_S, overdue_beyond=2)
    short, long = owed_beside_short(slots)
    tight = [slots.claim(SHORT, now=OWED_AT, wait_limit_s=LIMIT_S) for _ in range(4)]
    claims = [short, long, *tight]
    slots.tick(OWED_AT + LIMIT_S)
    assert all(c.holding for c in tight[:3])  # beyond the owed batch, and beyond both slots
    assert not tight[3].holding  # the bound: four short batches at most
    assert slots.num_holding == 5
    check(slots, claims, OWED_AT + LIMIT_S)
    # Batches hold more slots than there are; the owed batch keeps its slot.
    assert long.owed(OWED_AT + LIMIT_S + 0.001, slots.quantum_s)
    assert not slots.boundary(long, now=OWED_AT + LIMIT_S + 0.001)
    assert long.holding
    assert slots.num_yields == 0


def test_overdue_work_leaves_the_next_free_slot_to_an_owed_long_batch_waiting() -> None:
    slots = ComputeSlots(2, LONG_S, overdue_beyond=2)
    short, other = short_work_on_every_slot(slots)
    long = slots.claim(LONG, now=0.0)
    first = slots.claim(SHORT, now=0.0, wait_limit_s=LIMIT_S)
    slots.tick(LIMIT_S)
    assert first.holding  # the long batch is not owed yet: overdue work goes beyond
    claims = [short, other, long, first]
    check(slots, claims, LIMIT_S)
    assert long.owed(OWED_AT, slots.quantum_s)
    late = slots.claim(SHORT, now=OWED_AT, wait_limit_s=LIMIT_S)
    claims.append(late)
    slots.tick(OWED_AT + LIMIT_S)
    assert not late.holding  # overdue, but an owed long batch waits for the next slot
    check(slots, claims, OWED_AT + LIMIT_S)
    slots.release(short, now=OWED_AT + 0.2)
    slots.release(other, now=OWED_AT + 0.2)
    assert long.holding  # the first slot short work left (it still held every other)
    assert late.holding  # and overdue work beyond it, as beyond owed work holding
    check(slots, claims, OWED_AT + 0.2)


@pytest.mark.parametrize("overdue_beyond", [0, 1, 3])
@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_random_calls_keep_the_invariants(num_slots: int, overdue_beyond: int) -> None:
    rng = random.Random(num_slots * 10 + overdue_beyond)
    slots = ComputeSlots(num_slots, LONG_S, overdue_beyond=overdue_beyond)
    beyond = 0  # calls after which short batches held more than every slot
    claims: list[SlotClaim] = []
    suspended: list[SlotClaim] = []
    now = 0.0
    for _ in range(2000):
        now += rng.choice((0.0, 0.01, 0.03, 0.3, 1.5))
        holding = [c for c in claims if c.holding]
        move = rng.random()
        if move < 0.3 or not claims:
            limit = rng.choice((None, 0.0, 0.05, 1.0))
            kind = rng.choice((SHORT, SHORT, SHORT, LONG, None))
            claims.append(slots.claim(kind, now, wait_limit_s=limit))
        elif move < 0.35:
            slots.tick(now)
        elif move < 0.65 and holding:
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
        else:  # a call at every step: claims become overdue between calls
            slots.tick(now)
        check(slots, claims, now)
        beyond += slots.num_short_holding > num_slots
    assert (beyond > 0) == (overdue_beyond > 0)  # the calls reach overdue work's slots
    for claim in list(claims):
        slots.release(claim, now)
    assert slots.num_holding == slots.num_waiting == 0
