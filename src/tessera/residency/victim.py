"""Which idle models to evict for a caller short of room, or whether to wait
for busy ones instead.

Invariants:

- Never a candidate: the caller's own model, a kept model (``keep``: a
  version serving while its successor loads), a fresh one (``fresh.py``),
  or a pinned or loading one.
- Before its patience ends, a caller waits rather than evict idle models
  where models busy now (running a batch, fresh, or loading for a batch)
  would free the room at a lower expected cost (``policy.expected_cost``),
  and those busy models' batch ends still bound its patience
  (``patience.py``). Reason: a cheap model busy for a second is worth
  waiting for before evicting models whose reload is their whole target.
- Room for the loads next in line is taken from idle models only, and only
  where the caller's own need is met.
- One ordering by the policy serves both answers (to wait, and which
  victims): the choice runs at every load under pressure.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.clock import Clock
from tessera.residency.fresh import FreshModels
from tessera.residency.patience import BatchEnds, Patience
from tessera.residency.policy import EvictionPolicy, expected_cost, take
from tessera.residency.table import ModelEntry, ModelState, ResidencyTable

# Models that will be idle soon, or are: running a batch, loading, or ready.
SOON_IDLE = frozenset({ModelState.READY, ModelState.LOADING})
# The same for a load: not one loading. Reason: a load that waits for another
# model to load, run and go idle holds the whole line of loads for a swap.
SOON_IDLE_FOR_A_LOAD = frozenset({ModelState.READY})


@dataclass(frozen=True, slots=True)
class Victims:
    """The idle models to evict (None: nothing needs evicting, or too few), or
    ``wait``: wait for busy models instead."""

    names: list[str] | None
    wait: bool = False


class VictimChooser:
    """Chooses victims over ``table`` by ``policy``, sparing fresh models."""

    def __init__(
        self,
        table: ResidencyTable,
        policy: EvictionPolicy,
        clock: Clock,
        fresh: FreshModels,
        batch_ends: BatchEnds,
    ) -> None:
        self._table = table
        self._policy = policy
        self._clock = clock
        self._fresh = fresh
        self._batch_ends = batch_ends
        self._kept: set[str] = set()  # never victims (``keep``)

    def keep(self, name: str, kept: bool = True) -> None:
        """Never evict ``name`` (while ``kept``): a version serving while its
        successor loads beside it."""
        if kept:
            self._kept.add(name)
        else:
            self._kept.discard(name)

    def to_settle(self, need_bytes: int) -> list[str] | None:
        """Idle models, neither kept nor fresh, that free ``need_bytes`` for a
        load's measured bytes (the loading model is no candidate: it is not
        ready), by the policy; None if too few."""
        candidates = self._table.evictable(self._fresh.names() | self._kept)
        return self._policy.choose(candidates, need_bytes, self._table.freed_by)

    def for_caller(
        self,
        short_bytes: int,
        name: str,
        patience: Patience,
        ahead_bytes: int = 0,
        load: bool = False,
    ) -> Victims:
        """For a caller short of ``short_bytes`` for ``name``: the idle
        models to evict, ``ahead_bytes`` more where they can (for the loads
        next in line), or whether to wait for busy ones (see the module
        notes). ``load``: the caller loads a model (``SOON_IDLE_FOR_A_LOAD``)."""
        if short_bytes <= 0:
            return Victims(None)
        protect = {name} | self._kept
        fresh = self._fresh.names()
        freed_by = self._table.freed_by
        entries = self._table.entries
        ordered: list[ModelEntry] | None = None  # busy and idle ones, while patient
        ready = ModelState.READY  # read once: an enum member's lookup costs a call
        if self._clock.now() < patience.until:
            states = SOON_IDLE_FOR_A_LOAD if load else SOON_IDLE
            soon = [e for e in entries.values() if e.state in states and e.name not in protect]
            ordered = self._policy.order(soon)  # the idle ones among them too: one sort for both
            idle = [e for e in ordered if e.state is ready and e.pins == 0 and e.name not in fresh]
        else:
            idle = self._policy.order(self._table.evictable(protect | fresh))
        victims = take(idle, short_bytes, freed_by)
        if not victims:
            return Victims(victims)
        later = take(ordered, short_bytes, freed_by) if ordered is not None else None
        if later is not None and later != victims:
            now = self._clock.now()

            def cost(names: list[str]) -> float:
                return sum(expected_cost(entries[n], now) for n in names)

            if cost(later) < cost(victims):
                busy = [
                    n
                    for n in later
                    if entries[n].state is not ready or entries[n].pins or n in fresh
                ]
                if self._batch_ends.bound(patience, busy):
                    return Victims(victims, wait=True)
        if ahead_bytes > 0:
            victims = take(idle, short_bytes + ahead_bytes, freed_by) or victims
        return Victims(victims)
