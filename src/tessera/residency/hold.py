"""Held rooms: a batch's room kept for its model's next batch.

Invariants:

- A model keeps at most one room, and only a room of some bytes.
- A kept room is given back exactly once: when the model's next batch takes
  it (``take``), or when its timer ends (the model's gathering wait and
  ``HOLD_SLACK_S``), whichever comes first; taking it cancels the timer.
  Reason: between two batches of a model that evicted another for its room,
  the room would go to that model's reload, and the next batch would evict
  it again.
- Whether a room is worth keeping (someone waits, every waiter's patience
  outlasts the next batch) is the manager's decision; this part only keeps it.
"""

from __future__ import annotations

from collections.abc import Callable

from tessera.clock import Cancellable, Clock
from tessera.residency.table import Reservation

# How long a batch's room is kept beyond its model's gathering wait: the next
# batch forms as soon as the last one's callers are answered.
HOLD_SLACK_S = 0.05


class HeldRooms:
    """Reservations kept for their model's next batch, and their timers."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._held: dict[str, tuple[Reservation, Cancellable]] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._held

    def keep(
        self, reservation: Reservation, wait_s: float, on_expiry: Callable[[str], None]
    ) -> bool:
        """Keep ``reservation`` for its model's next batch, at most ``wait_s``
        and ``HOLD_SLACK_S``, then ``on_expiry(name)``; False (not kept) if it
        holds no bytes or the model keeps a room already."""
        name = reservation.name
        if reservation.num_bytes <= 0 or name in self._held:
            return False
        timer = self._clock.call_later(wait_s + HOLD_SLACK_S, lambda: on_expiry(name))
        self._held[name] = (reservation, timer)
        return True

    def take(self, name: str) -> Reservation | None:
        """The room kept for ``name``, no longer kept (None: there was none)."""
        held = self._held.pop(name, None)
        if held is None:
            return None
        reservation, timer = held
        timer.cancel()
        return reservation
