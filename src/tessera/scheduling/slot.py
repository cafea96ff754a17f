"""Compute slots: which batch computes next, short work first, long work in steps.

The device's compute is ``num_slots`` slots (the executor's workers, each
with its share of the thread budget), and a batch computes only while it
holds one. A *short* batch (predicted to run under ``long_s``, or not
predicted yet) runs whole once it holds a slot. A *long* one (predicted at
``long_s`` or more) computes a step at a time: at each step boundary it may
give its slot up and wait for it again (``step.step_boundary``). A short
batch whose run reaches ``long_s`` counts as long from its next boundary on,
so a wrong prediction costs one step, not the whole run.

Invariants (a unit test checks them after every call):

- Short batches hold at most ``num_slots`` slots, except overdue ones (below),
  at most ``overdue_beyond`` beyond; and they wait only for one another (and
  owed long work, below): a short batch is granted a slot at once unless
  short batches hold every slot, in arrival order.
- A long batch is granted a slot only while fewer than ``num_slots`` are
  held, after every waiting short batch, long ones in arrival order.
- So batches hold more than ``num_slots`` slots only when short batches took
  slots beyond those long ones held; at its next boundary a long batch then
  gives its slot up, and waits until a slot is free again. A short batch
  thus never waits for long work, and shares the device with it for at most
  one step (the executor runs long work at a lower CPU priority meanwhile).
- At a boundary a long batch also gives its slot up when another long batch
  waits and this one has held the slot for ``quantum_s``: long batches take
  turns of at least a quantum, and one that gave its slot up waits behind
  those already waiting.
- Long work is not starved: a long batch that has waited for a slot more than
  ``quantum_s`` longer than it has computed is *owed*. An owed batch that
  waits is granted the next free slot before short batches; one that holds
  a slot keeps it at its boundaries; and while one holds a slot, short
  batches take no slot beyond it (they wait for a free one), unless overdue
  (below). So under a stream of short work a long batch still computes about
  half the time of a slot (a page of OCR is not held for seconds behind other
  models' short batches), and a short batch waits for long work only while
  it is owed.
- Short work is not held back for long by owed long work either: a short
  claim may carry a wait limit (``claim``'s ``wait_limit_s``: the executor
  passes a share of its requests' tightest latency target), and one that has
  waited in line that long is *overdue*. The owed rule does not hold an
  overdue claim back: the first overdue claim in the short line takes a slot
  beyond owed long work (the operating system then shares the cores between
  them, as between processes; on the CPU the long batch's threads run nicer).
  With two slots, owed OCR on one left every other model's short batches one
  slot, and a MiniLM batch with a 200 ms target waited 150 ms and more behind
  a speech or chat batch.
- Nor by other short work: an overdue claim also takes a slot beyond the
  short batches that hold every slot, while short batches hold fewer than
  ``num_slots + overdue_beyond`` (the executor's bound: as many again), so a
  batch with a latency target waits for a slot about its limit at most, and
  the operating system shares the cores among the batches, as among one
  process per model. With two slots, a TTS batch (~120 ms) and a chat batch
  (~175 ms) held both, and MiniLM batches behind them missed 200 ms targets.
  Not while an owed long batch waits, though: that one takes the next slot
  short work frees, so overdue work does not starve long work (an owed batch
  that holds a slot keeps it at its boundaries, however many short batches
  hold slots beyond it). A long batch that is not owed gives its slot up at
  its boundary while batches hold more slots than there are, as ever.
- The slots keep no clock, and a waiting claim becomes overdue between calls:
  whoever waits calls ``tick(now)`` at its overdue time (``next_overdue_at``:
  the earliest of the line's) to grant it then, not at the next event.

Plain state, no threads and no clock: callers pass the time and wait for a
grant themselves (``engine/executor.py``), so the policy is tested by calls.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(eq=False)
class SlotClaim:
    """One batch's claim on a compute slot."""

    long: bool
    held_since: float | None = None  # since when it holds a slot; None while it waits
    started: float | None = None  # when it first held one
    waiting_since: float | None = None  # since when it waits in line; None otherwise
    ran_s: float = 0.0  # seconds it held a slot, up to its last grant's end
    waited_s: float = 0.0  # seconds it waited in line, up to its last grant
    wait_limit_s: float | None = None  # short work: waited this long in line, it is overdue

    def owed(self, now: float, grace_s: float) -> bool:
        """Long work that has waited more than ``grace_s`` longer than it ran."""
        if not self.long:
            return False
        ran, waited = self.ran_s, self.waited_s
        if self.held_since is not None:
            ran += now - self.held_since
        if self.waiting_since is not None:
            waited += now - self.waiting_since
        return waited > ran + grace_s

    @property
    def overdue_at(self) -> float | None:
        """When this short claim, waiting in line, becomes overdue: its wait
        limit after it joined the line (None: long, not waiting, or no limit)."""
        if self.long or self.wait_limit_s is None or self.waiting_since is None:
            return None
        return self.waiting_since + self.wait_limit_s

    def overdue(self, now: float) -> bool:
        """Short work that has waited in line its wait limit or longer."""
        at = self.overdue_at
        return at is not None and now >= at

    @property
    def holding(self) -> bool:
        return self.held_since is not None


class ComputeSlots:
    """Grants compute slots to batches; see the module notes."""

    def __init__(
        self,
        num_slots: int,
        long_s: float,
        *,
        quantum_s: float | None = None,
        overdue_beyond: int = 0,
    ) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        if overdue_beyond < 0:
            raise ValueError("overdue_beyond must be >= 0")
        self.num_slots = num_slots
        # Slots overdue short claims may take beyond the short batches that hold
        # every slot (module notes).
        self.overdue_beyond = overdue_beyond
        self.long_s = long_s
        self.quantum_s = long_s if quantum_s is None else quantum_s
        self._holders: list[SlotClaim] = []
        self._short_waiting: deque[SlotClaim] = deque()
        self._long_waiting: deque[SlotClaim] = deque()
        self.num_yields = 0  # slots given up at boundaries
        self.num_grants = 0  # slots handed out (a caller wakes its waiters when it moves)

    # -- the calls -----------------------------------------------------------

    def claim(
        self,
        expected_s: float | None,
        now: float,
        *,
        long: bool = False,
        wait_limit_s: float | None = None,
    ) -> SlotClaim:
        """A batch predicted to run ``expected_s`` wants a slot (``long``: as
        long work, whatever its prediction): granted now if the rules allow
        (``holding``), else it waits in line. ``wait_limit_s``: short work that
        waits in line that long is overdue (module notes; None: never)."""
        claim = SlotClaim(
            long=long or (expected_s is not None and expected_s >= self.long_s),
            wait_limit_s=wait_limit_s,
        )
        self.resume(claim, now)
        return claim

    def tick(self, now: float) -> None:
        """Grant what the rules allow at ``now``: a claim that became overdue
        since the last call (``next_overdue_at``) is granted when they allow."""
        self._grant(now)

    def release(self, claim: SlotClaim, now: float) -> None:
        """The batch has ended (or gave up waiting): its slot goes to the next."""
        if claim in self._holders:
            self._unhold(claim, now)
        else:
            for line in (self._short_waiting, self._long_waiting):
                if claim in line:
                    line.remove(claim)
            claim.waiting_since = None
        self._grant(now)

    def boundary(self, claim: SlotClaim, now: float) -> bool:
        """At a step boundary of ``claim``'s batch, which holds its slot: True
        when it has given the slot up and must wait until ``holding`` again."""
        if not claim.long and claim.started is not None and now - claim.started >= self.long_s:
            claim.long = True  # it ran as long as long work does: it takes turns now
        self._grant(now)  # its slot may no longer count as short work's, or as owed
        if not claim.long or not self._must_yield(claim, now):
            return False
        self._unhold(claim, now)
        claim.waiting_since = now
        self._long_waiting.append(claim)
        self.num_yields += 1
        self._grant(now)
        return not claim.holding

    def suspend(self, claim: SlotClaim, now: float) -> None:
        """``claim``'s batch waits for another batch (a lock), not computing: its
        slot goes to the next; ``resume`` puts it back in line."""
        self._unhold(claim, now)
        self._grant(now)

    def resume(self, claim: SlotClaim, now: float) -> None:
        """A suspended batch wants its slot again: granted now if the rules
        allow, else it waits at the back of its line."""
        claim.waiting_since = now
        (self._long_waiting if claim.long else self._short_waiting).append(claim)
        self._grant(now)

    # -- what the calls read -------------------------------------------------

    @property
    def num_holding(self) -> int:
        return len(self._holders)

    @property
    def num_short_holding(self) -> int:
        return sum(1 for c in self._holders if not c.long)

    @property
    def num_waiting(self) -> int:
        return len(self._short_waiting) + len(self._long_waiting)

    @property
    def num_short_waiting(self) -> int:
        return len(self._short_waiting)

    @property
    def next_overdue_at(self) -> float | None:
        """When the first waiting short claim becomes (or became) overdue;
        None when none has a wait limit."""
        times = [at for c in self._short_waiting if (at := c.overdue_at) is not None]
        return min(times, default=None)

    def _must_yield(self, claim: SlotClaim, now: float) -> bool:
        if claim.owed(now, self.quantum_s):
            return False  # it has waited out its share: it computes on
        if len(self._holders) > self.num_slots:
            return True  # a short batch took a slot beyond ours: ours goes back
        held_since = claim.held_since if claim.held_since is not None else now
        return bool(self._long_waiting) and now - held_since >= self.quantum_s

    def _grant(self, now: float) -> None:
        """Hand slots out: owed long batches while any slot is free; short
        batches while they hold fewer than every slot (long ones' slots count
        as free to them, unless an owed one holds a slot: then overdue ones
        only), and overdue ones up to ``overdue_beyond`` beyond every slot
        while no owed long batch waits; then long ones while any slot is
        free, each line in arrival order."""
        grace_s = self.quantum_s
        if self._long_waiting and len(self._holders) < self.num_slots:
            for claim in [c for c in self._long_waiting if c.owed(now, grace_s)]:
                if len(self._holders) >= self.num_slots:
                    break
                self._long_waiting.remove(claim)
                self._hold(claim, now)
        owed_waiting = any(c.owed(now, grace_s) for c in self._long_waiting)
        while self._short_waiting:
            short_holding = self.num_short_holding
            if short_holding >= self.num_slots + self.overdue_beyond:
                break
            claim = self._short_waiting[0]
            every_slot_short = short_holding >= self.num_slots
            behind_owed = len(self._holders) >= self.num_slots and any(
                c.owed(now, grace_s) for c in self._holders
            )
            if every_slot_short or behind_owed:
                # Only an overdue claim goes beyond short work's slots or owed
                # long work's, and beyond short work's only while no owed long
                # batch waits for the next slot it frees.
                if every_slot_short and owed_waiting:
                    break
                overdue = next((c for c in self._short_waiting if c.overdue(now)), None)
                if overdue is None:
                    break
                claim = overdue
            self._short_waiting.remove(claim)
            self._hold(claim, now)
        while self._long_waiting and len(self._holders) < self.num_slots:
            self._hold(self._long_waiting.popleft(), now)

    def _hold(self, claim: SlotClaim, now: float) -> None:
        self.num_grants += 1
        claim.held_since = now
        if claim.started is None:
            claim.started = now
        if claim.waiting_since is not None:
            claim.waited_s += now - claim.waiting_since
            claim.waiting_since = None
        self._holders.append(claim)

    def _unhold(self, claim: SlotClaim, now: float) -> None:
        self._holders.remove(claim)
        if claim.held_since is not None:
            claim.ran_s += now - claim.held_since
        claim.held_since = None
