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

- At most ``num_slots`` batches hold a slot.
- A short batch waits only while every slot is held, and waiting short
  batches are granted before any long one, in arrival order.
- While short work is active (a short batch holds or waits for a slot, or
  did within the last ``active_s``), long batches hold at most
  ``num_slots - 1`` slots: a worker is kept for short batches when long ones
  queue. With one slot none can be kept; short batches take it at the next
  boundary. Once short work has been idle for ``active_s`` long batches may
  hold every slot (nothing is left idle for work that does not come).
- At a boundary a long batch gives its slot up when a short batch waits, when
  long batches hold more than their share, or when another long batch waits
  and this one has held the slot for ``quantum_s``: long batches take turns of
  at least a quantum, in arrival order, and one that gave its slot up waits
  behind those already waiting.

Plain state, no threads and no clock: callers pass the time and wait for a
grant themselves (``engine/executor.py``), so the policy is tested by calls.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Short work counts as active this long after its last batch: the fair
# queue's activity window, so that a steady trickle keeps its worker.
SHORT_ACTIVE_S = 2.0


@dataclass(eq=False)
class SlotClaim:
    """One batch's claim on a compute slot."""

    long: bool
    held_since: float | None = None  # since when it holds a slot; None while it waits
    started: float | None = None  # when it first held one

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
        active_s: float = SHORT_ACTIVE_S,
    ) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        self.long_s = long_s
        self.quantum_s = long_s if quantum_s is None else quantum_s
        self.active_s = active_s
        self._holders: list[SlotClaim] = []
        self._short_waiting: deque[SlotClaim] = deque()
        self._long_waiting: deque[SlotClaim] = deque()
        self._short_seen: float | None = None
        self.num_yields = 0  # slots given up at boundaries

    # -- the calls -----------------------------------------------------------

    def claim(self, expected_s: float | None, now: float) -> SlotClaim:
        """A batch predicted to run ``expected_s`` wants a slot: granted now if
        the rules allow (``holding``), else it waits in line."""
        claim = SlotClaim(long=expected_s is not None and expected_s >= self.long_s)
        self.resume(claim, now)
        return claim

    def release(self, claim: SlotClaim, now: float) -> None:
        """The batch has ended (or gave up waiting): its slot goes to the next."""
        if claim in self._holders:
            self._holders.remove(claim)
        else:
            for line in (self._short_waiting, self._long_waiting):
                if claim in line:
                    line.remove(claim)
        claim.held_since = None
        if not claim.long:
            self._short_seen = now
        self._grant(now)

    def boundary(self, claim: SlotClaim, now: float) -> bool:
        """At a step boundary of ``claim``'s batch, which holds its slot: True
        when it has given the slot up and must wait until ``holding`` again."""
        if not claim.long and claim.started is not None and now - claim.started >= self.long_s:
            claim.long = True  # it ran as long as long work does: it takes turns now
        if not claim.long or not self._must_yield(claim, now):
            return False
        self._holders.remove(claim)
        claim.held_since = None
        self._long_waiting.append(claim)
        self.num_yields += 1
        self._grant(now)
        return not claim.holding

    def suspend(self, claim: SlotClaim, now: float) -> None:
        """``claim``'s batch waits for another batch (a lock), not computing: its
        slot goes to the next; ``resume`` puts it back in line."""
        self._holders.remove(claim)
        claim.held_since = None
        self._grant(now)

    def resume(self, claim: SlotClaim, now: float) -> None:
        """A suspended batch wants its slot again: granted now if the rules
        allow, else it waits at the back of its line."""
        if claim.long:
            self._long_waiting.append(claim)
        else:
            self._short_waiting.append(claim)
            self._short_seen = now
        self._grant(now)

    def regrant(self, now: float) -> bool:
        """Grant what time alone allows (short work has gone idle); True if any."""
        return self._grant(now) > 0

    def wake_in(self, now: float) -> float | None:
        """Seconds until time alone may grant a waiting batch (the worker kept for
        short work is freed once it has been idle ``active_s``); None: only a
        claim, a release or a boundary can."""
        if not self._long_waiting or len(self._holders) >= self.num_slots:
            return None
        if self._short_waiting or any(not c.long for c in self._holders):
            return None
        if self._short_seen is None:
            return None
        return max(0.0, self._short_seen + self.active_s - now)

    # -- what the calls read -------------------------------------------------

    @property
    def num_holding(self) -> int:
        return len(self._holders)

    @property
    def num_long_holding(self) -> int:
        return sum(1 for c in self._holders if c.long)

    @property
    def num_waiting(self) -> int:
        return len(self._short_waiting) + len(self._long_waiting)

    @property
    def num_short_waiting(self) -> int:
        return len(self._short_waiting)

    def long_share(self, now: float) -> int:
        """How many slots long batches may hold now."""
        if self.num_slots > 1 and self._short_active(now):
            return self.num_slots - 1
        return self.num_slots

    def _short_active(self, now: float) -> bool:
        if self._short_waiting or any(not c.long for c in self._holders):
            return True
        return self._short_seen is not None and now - self._short_seen < self.active_s

    def _must_yield(self, claim: SlotClaim, now: float) -> bool:
        if self._short_waiting or self.num_long_holding > self.long_share(now):
            return True
        held_since = claim.held_since if claim.held_since is not None else now
        return bool(self._long_waiting) and now - held_since >= self.quantum_s

    def _grant(self, now: float) -> int:
        """Hand free slots out: short batches first, long ones within their
        share, each line in arrival order. Returns how many were granted."""
        granted = 0
        while len(self._holders) < self.num_slots:
            if self._short_waiting:
                claim = self._short_waiting.popleft()
            elif self._long_waiting and self.num_long_holding < self.long_share(now):
                claim = self._long_waiting.popleft()
            else:
                break
            claim.held_since = now
            if claim.started is None:
                claim.started = now
            self._holders.append(claim)
            granted += 1
        return granted
