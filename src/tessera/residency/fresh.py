"""Fresh models: loaded for a waiting caller and not used by a batch yet.

Invariants:

- A model is fresh from the end of a load made for a caller until its first
  batch reserves room (``discard``) or ``protection_s`` have passed, whichever
  comes first. Reason: a model loaded for a batch that still waits for room
  would otherwise be evicted before that batch ran, and loaded again.
- A fresh model is never a candidate for eviction, and its first batch takes
  room in its turn (it was loaded in its turn).
- A speculative load (``ResidencyManager.fill``) is never fresh: no caller
  waits for it.
"""

from __future__ import annotations

from tessera.clock import Clock

# How long a model loaded for a waiting batch is kept from eviction before
# that batch has pinned it.
FRESH_PROTECTION_S = 5.0


class FreshModels:
    """Which models are fresh, and when each one's protection ends."""

    def __init__(self, clock: Clock, protection_s: float = FRESH_PROTECTION_S) -> None:
        self._clock = clock
        self._protection_s = protection_s
        self._since: dict[str, float] = {}  # when each became ready

    def add(self, name: str) -> None:
        """``name`` was loaded for a caller just now."""
        self._since[name] = self._clock.now()

    def discard(self, name: str) -> None:
        """``name``'s first batch has reserved room (or it is gone)."""
        self._since.pop(name, None)

    def names(self) -> set[str]:
        """The models fresh now (those whose protection has ended are dropped)."""
        now = self._clock.now()
        for name, since in list(self._since.items()):
            if now - since >= self._protection_s:
                del self._since[name]
        return set(self._since)

    def seconds_to_expiries(self) -> list[float]:
        """Seconds until each protection ends, for those still running: an end
        is a change no event announces, so a waiter wakes for it."""
        now = self._clock.now()
        ends = (since + self._protection_s - now for since in self._since.values())
        return [s for s in ends if s > 0]
