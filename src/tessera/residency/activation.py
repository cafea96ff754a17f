"""Sliding-window statistics of measured activation peaks, per model.

Each measured batch contributes its peak bytes and its work units. A batch of
``u`` units reserves the most that a reading near its size scaled to ``u``
says (``reserve_bytes``): each reading's peak times ``u`` over its units, over
the readings no smaller than half the largest one of at most ``u`` units (all
of them where none is that small). So a reservation is never below what a
recent batch of about its size used per unit. Readings much smaller than one
nearer the size are left out: a batch's peak has a fixed part, which a
reading of a few units spreads over those few: scaled up to hundreds of
units it would reserve many times what a batch needs. (A fixed part is still over-reserved above the
nearest reading and under-reserved below it; and a text's attention grows with
the square of its length, which a linear scale from a shorter one leaves out.)
Until a model has a measurement, it reserves nothing extra (its warm-up batch
is measured right after load).

A model's first readings settle before they count: the warm-up's reading and
then each lower one (per unit) replaces the last, until a reading is no lower
than the one before (or ``SETTLING_READINGS`` were taken); from then on every
reading goes into the window. Reason: a first run carries one-off costs the
runs after it do not, and as the window's maximum those first readings would
hold that excess for the whole window, every batch evicting for bytes it
never needs.

What refuses a request for good (413: it could never run) is not that
estimate but ``proven_bytes``: what two real batches of no more units each
peaked at, at least (the lower of the two highest). A peak only grows with a
batch's units, so such a request needs as much; an extrapolation, a warm-up's
reading or a single first run with its one-off costs would refuse requests
for good, with no batch run to correct it. A single request's reservation
over the most room its model could ever have beside its weights is cut to
that room (``room.ActivationRoom.plan_batch``): the batch runs, and its
reading is the next estimate's.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

# The most readings a model's first, falling readings may take to settle.
SETTLING_READINGS = 8


class _Reading(NamedTuple):
    units: float
    peak_bytes: int
    provisional: bool  # a warm-up's (``observe``)

    @property
    def per_unit(self) -> float:
        return self.peak_bytes / self.units


# A reservation scales the readings of at least this share of the largest
# reading's units at or below its own (``reserve_bytes``).
NEAR_SHARE = 0.5


class ActivationStats:
    def __init__(self, window: int = 64) -> None:
        self._window: deque[_Reading] = deque(maxlen=window)
        self._settling: _Reading | None = None  # the last of the first, falling readings
        self._settling_readings = 0
        self.num_samples = 0

    def observe(self, peak_bytes: int, units: float, *, provisional: bool = False) -> None:
        """One batch's peak; ``provisional`` for a warm-up run, which only
        ever stands in for the first real readings (see the module notes)."""
        if peak_bytes < 0 or units <= 0:
            return
        self.num_samples += 1
        reading = _Reading(units, peak_bytes, provisional)
        if self._window:
            if not provisional:
                self._window.append(reading)
            return
        last = self._settling
        self._settling_readings += 1
        if last is None or reading.per_unit < last.per_unit:
            self._settling = reading
        elif not provisional:
            self._window.extend((last, reading))
        if self._settling_readings >= SETTLING_READINGS and not self._window:
            self._window.append(self._settling if self._settling is not None else reading)

    def reserve_bytes(self, units: float) -> int:
        """The bytes a batch of ``units`` reserves (see the module notes)."""
        readings: Sequence[_Reading] = self._window
        if not readings:
            if self._settling is None:
                return 0
            readings = (self._settling,)
        below = [r.units for r in readings if r.units <= units]
        near = max(below) * NEAR_SHARE if below else 0.0
        return math.ceil(max(r.per_unit for r in readings if r.units >= near) * units)

    def proven_bytes(self, units: float) -> int:
        """The least a batch of ``units`` must need: the lower of the two
        highest peaks of real batches of no more units (0 with fewer than two)."""
        peaks = heapq.nlargest(
            2, (r.peak_bytes for r in self._window if r.units <= units and not r.provisional)
        )
        return peaks[-1] if len(peaks) == 2 else 0


class ActivationBook:
    """Every model's ``ActivationStats``: written by measured batches (the warm-up
    after a load, and batches that ran alone), read when a batch reserves room."""

    def __init__(self, window: int = 64) -> None:
        self._window = window
        self._stats: dict[str, ActivationStats] = {}

    def of(self, name: str) -> ActivationStats:
        found = self._stats.get(name)
        if found is None:
            found = self._stats[name] = ActivationStats(self._window)
        return found

    def observe(
        self, name: str, peak_bytes: int, units: float, *, provisional: bool = False
    ) -> None:
        self.of(name).observe(peak_bytes, units, provisional=provisional)

    def forget(self, name: str) -> None:
        """Drop a retired model's measurements."""
        self._stats.pop(name, None)
