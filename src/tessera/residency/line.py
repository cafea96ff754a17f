"""The waiting line for room: loads and batch reservations short of bytes.

Invariants:

- A place holds one ticket from when it first waits until it leaves; tickets
  only grow, so the place with the smallest ticket is the line's head and
  places get room in the order they began to wait. Reason: a large model is
  not starved by small ones taking every byte that frees up, and a batch is
  not starved by loads (nor a load by batches).
- Callers loading one model share one place (``LoadPlace``); a place that
  already held a ticket (a batch whose model was evicted meanwhile) may hand
  it to the load it now waits for.
- Each place records what it waits for (``need_bytes``: a load, its weights
  and its first batch; a batch, its activation bytes) and its caller's
  patience (``patience.py``).
- ``passed_bytes`` is the activation bytes held by batches that took room
  ahead of older places; a batch may pass only while the room beside the
  weights, less those and its own, still holds what each older place waits
  for (backfilling: no older place waits longer than for the batches that
  ran before it).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from tessera.residency.patience import Patience


@dataclass(frozen=True, slots=True)
class LoadPlace:
    """The place in line of the callers loading model ``name``."""

    name: str


@dataclass(frozen=True, slots=True)
class NextLoad:
    """A load waiting behind another place, and the bytes it waits for."""

    name: str
    need_bytes: int


class WaitingLine:
    """Places waiting for room, by ticket."""

    def __init__(self) -> None:
        self._tickets = itertools.count()
        # Every place in line has a ticket and a need: the two keep the same keys.
        self._places: dict[object, int] = {}  # place -> ticket
        self._needs: dict[object, int] = {}
        self._patience: dict[object, Patience] = {}
        self.passed_bytes = 0

    def __len__(self) -> int:
        return len(self._places)

    def __contains__(self, place: object) -> bool:
        return place in self._places

    def join(
        self,
        place: object,
        need_bytes: int,
        patience: Patience | None = None,
        ticket: int | None = None,
    ) -> None:
        """``place`` waits for ``need_bytes``: it keeps the ticket it holds,
        else takes ``ticket`` (one it held before), else the next one; it
        keeps the first patience it joined with."""
        if place not in self._places:
            self._places[place] = next(self._tickets) if ticket is None else ticket
        self._needs[place] = need_bytes
        if patience is not None:
            self._patience.setdefault(place, patience)

    def leave(self, place: object) -> int | None:
        """Take ``place`` out of the line; its ticket, if it held one."""
        self._needs.pop(place, None)
        self._patience.pop(place, None)
        return self._places.pop(place, None)

    def head(self) -> object | None:
        """The place that has waited longest (None: the line is empty)."""
        return min(self._places, key=self._places.__getitem__) if self._places else None

    def behind(self, place: object) -> bool:
        """Whether another place has waited longer than ``place`` (any place,
        if ``place`` is not in line)."""
        mine = self._places.get(place, math.inf)
        return bool(self._places) and min(self._places.values()) < mine

    def loads_next(self, place: object, num: int) -> list[NextLoad]:
        """The first ``num`` loads behind ``place``, in line order."""
        mine = self._places.get(place, math.inf)
        behind = [
            (ticket, self._needs[p], p.name)
            for p, ticket in self._places.items()
            if ticket > mine and isinstance(p, LoadPlace)
        ]
        return [NextLoad(name, need) for _, need, name in heapq.nsmallest(num, behind)]

    def patience_ends_before(self, when: float) -> bool:
        """Whether some place's patience ends before ``when``."""
        return any(patience.until < when for patience in self._patience.values())

    def may_pass(self, place: object, need_bytes: int, pool_bytes: int) -> bool:
        """Whether a batch at ``place`` needing ``need_bytes`` may take room
        ahead of older places, with ``pool_bytes`` beside the weights (see the
        module notes)."""
        mine = self._places.get(place, math.inf)
        older = [self._needs[p] for p, ticket in self._places.items() if ticket < mine]
        return pool_bytes - self.passed_bytes - need_bytes >= max(older, default=0)
