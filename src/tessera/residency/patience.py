"""Patience: how long a caller short of room waits for busy models rather
than evict idle ones, and the predicted ends of running batches that bound it.

Invariants:

- A caller's patience only shrinks: it begins at a share of its latency
  target (``PATIENCE_SHARE``) and, once the caller waits for busy models
  whose batches' ends are predicted, it ends no later than the latest of
  those ends plus that batch's predicted run again (a batch may run twice
  its prediction). Reason: new cheap models keep appearing, each just
  loaded and busy with its first batch; unbounded, a caller would wait its
  whole patience for one after another.
- A model is in ``BatchEnds`` only while a batch of it runs (from
  ``start`` until its last pin is released, ``end``), with the latest
  predicted end among its batches.
"""

from __future__ import annotations

import math

from tessera.clock import Clock

# The share of its latency target a caller short of room waits for busy models
# that cost less to evict before it evicts idle ones.
PATIENCE_SHARE = 0.5


class Patience:
    """Until when a caller short of room waits for busy models that cost less
    to evict than idle ones (see the module notes)."""

    __slots__ = ("until",)

    def __init__(self, until: float) -> None:
        self.until = until


class BatchEnds:
    """Models running batches: the latest predicted end among each one's
    batches, and that batch's predicted run."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._ends: dict[str, tuple[float, float]] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._ends

    def start(self, name: str, run_s: float) -> None:
        """A batch of ``name`` runs from now, predicted to take ``run_s``."""
        ends = self._clock.now() + run_s
        known = self._ends.get(name)
        if known is None or known[0] < ends:
            self._ends[name] = (ends, run_s)

    def end(self, name: str) -> None:
        """No batch of ``name`` runs any more."""
        self._ends.pop(name, None)

    def bound(self, patience: Patience, busy: list[str]) -> bool:
        """Whether a caller still waits for the ``busy`` models it would evict
        rather than idle ones, its ``patience`` bounded by their batches' ends
        (see the module notes). A model that loads, or waits for its first
        batch, gives no end: the patience stands until one does."""
        now = self._clock.now()
        latest = -math.inf
        for name in busy:
            known = self._ends.get(name)
            if known is None:
                return now < patience.until
            ends, run_s = known
            latest = max(latest, ends + run_s)
        patience.until = min(patience.until, latest)
        return now < patience.until
