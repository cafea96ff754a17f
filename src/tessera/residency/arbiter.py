"""The room arbiter: who takes the bytes that free up, and when a waiter wakes.

Invariants:

- Room goes in line order (``line.py``) while every model's weights fit:
  a waiter takes bytes in its turn (no older place in line, or its model is
  fresh) or passes older places where that delays none of them. Under
  pressure only loads wait in line among themselves; a batch takes room
  when it finds some.
- Only evictions free what ``bytes_only_evictions_free`` says: while every
  model fits, running batches' activation bytes come back when they end,
  so nothing is evicted for them.
- Every wait is bounded by its caller's deadline (then ``OverloadedError``)
  and also ends when a fresh model's protection or the caller's patience
  ends: those are changes no event announces.
- A batch's room is kept for its model's next batch (``hold.py``) only while
  someone waits for room and every waiter's patience outlasts that batch.
- ``peak_used_bytes`` is the most the table held at any change announced
  (``notify``).
"""

from __future__ import annotations

from tessera.clock import Clock
from tessera.errors import OverloadedError
from tessera.residency.catalogue import Catalogue
from tessera.residency.fresh import FreshModels
from tessera.residency.hold import HeldRooms
from tessera.residency.line import LoadPlace, WaitingLine
from tessera.residency.patience import BatchEnds
from tessera.residency.table import Reservation, ResidencyTable
from tessera.residency.transfer import TierTransfers
from tessera.residency.wakeup import Wakeups

# Under pressure, the line's head evicts for itself and for up to this many
# loads next in line: each eviction waits for a copy and a thread's answer
# while the line waits behind it.
EVICT_AHEAD = 3


class RoomArbiter:
    """The waiting line, its wake-ups, held rooms and running batches' ends
    over ``table``."""

    def __init__(
        self,
        table: ResidencyTable,
        catalogue: Catalogue,
        fresh: FreshModels,
        transfers: TierTransfers,
        clock: Clock,
    ) -> None:
        self._table = table
        self._catalogue = catalogue
        self._fresh = fresh
        self._transfers = transfers
        self._clock = clock
        self.line = WaitingLine()
        self.wakeups = Wakeups(clock)
        self.held = HeldRooms(clock)
        self.batch_ends = BatchEnds(clock)
        self.peak_used_bytes = 0

    def notify(self) -> None:
        """The bytes or the line changed: wake whoever waits for any change."""
        self.peak_used_bytes = max(self.peak_used_bytes, self._table.used_bytes())
        self.wakeups.wake_all()

    def every_model_fits(self) -> bool:
        return self._catalogue.all_fit(self._table.budget_bytes)

    async def wait_for_change(
        self, deadline: float, name: str, until: float | None = None, place: object = None
    ) -> None:
        """Wait for a change of the bytes or the line (with ``place``: for that
        place to become the line's head), a fresh model's protection to end,
        ``until`` or ``deadline``; ``OverloadedError`` once the deadline has
        passed (on a timeout the caller's loop re-checks, and comes here)."""
        now = self._clock.now()
        remaining = deadline - now
        if remaining <= 0:
            raise OverloadedError(
                f"no room in the memory budget for model {name!r}: other models are busy",
                retry_after_s=1.0,
            )
        expiries = self._fresh.seconds_to_expiries()
        if until is not None and until > now:
            expiries.append(until - now)
        await self.wakeups.sleep(min([remaining, *expiries]), place)

    def leave_line(self, place: object) -> int | None:
        """Take ``place`` out of the line, waking the new head; its ticket, if any."""
        ticket = self.line.leave(place)
        if ticket is not None:
            head = self.line.head()
            if head is not None:
                self.wakeups.wake(head)
        return ticket

    def in_turn(self, place: object, name: str) -> bool:
        """Whether ``place``, for model ``name``, may take bytes now: no older
        place is in line, or ``name`` is fresh (loaded in its turn, unused)."""
        return name in self._fresh.names() or not self.line.behind(place)

    def may_pass(self, place: object, need_bytes: int) -> bool:
        """Whether a batch may take ``need_bytes`` ahead of older places (``line.py``)."""
        pool = self._table.budget_bytes - self._table.weight_bytes()
        return self.line.may_pass(place, need_bytes, pool)

    def bytes_only_evictions_free(self, wanted_bytes: int) -> int:
        """Bytes of ``wanted_bytes`` that only evictions can free: what the free
        bytes do not cover, less (while every model fits) the running batches'
        activation bytes, which come back when those end. Under pressure an
        idle model goes at once rather than every batch behind waiting."""
        short = wanted_bytes - self._table.free_bytes()
        if self.every_model_fits():
            short -= self._table.activation_bytes_held()
        return short

    def bytes_for_loads_next(self, place: object) -> int:
        """What the next ``EVICT_AHEAD`` loads behind ``place`` wait for, counting
        loads from the host tier only as far as they could begin now (room made
        for one that must wait is room held empty); 0 while every model fits
        (the line's loads then wait for batches, not evictions)."""
        if self.every_model_fits():
            return 0
        ahead = self.line.loads_next(place, EVICT_AHEAD)
        transfers = self._transfers
        if not transfers.max_loads:
            return sum(load.need_bytes for load in ahead)
        slots = transfers.max_loads - transfers.num_loads
        if isinstance(place, LoadPlace) and transfers.holds(place.name):
            slots -= 1
        total = 0
        for load in ahead:
            if transfers.holds(load.name):
                if slots <= 0:
                    break
                slots -= 1
            total += load.need_bytes
        return total

    def keep_for_next_batch(
        self, reservation: Reservation, next_batch_s: float, wait_s: float
    ) -> bool:
        """Keep a batch's room for its model's next batch, predicted to run
        ``next_batch_s`` and gathered within ``wait_s`` (``hold.py``), unless no
        one waits for room or a waiter's patience ends before that batch does."""
        if not self.line and not self.wakeups.has_sleepers():
            return False  # no one would take the room meanwhile
        if self.line.patience_ends_before(self._clock.now() + next_batch_s):
            return False
        return self.held.keep(reservation, wait_s, self.held_room_expired)

    def give_back_held(self, name: str) -> bool:
        """Give back the room kept for ``name``'s next batch; whether there was one."""
        reservation = self.held.take(name)
        if reservation is None:
            return False
        self.release(reservation)
        return True

    def held_room_expired(self, name: str) -> None:
        """The room kept for ``name`` is given back to others."""
        if self.give_back_held(name):
            self.notify()

    def release(self, reservation: Reservation) -> None:
        """Give a batch's room back; the model's batch end once none runs."""
        self._table.release(reservation, self._clock.now())
        entry = self._table.entries.get(reservation.name)
        if entry is None or entry.pins == 0:
            self.batch_ends.end(reservation.name)
