"""Sliding-window statistics of measured activation peaks, per model.

Each measured batch contributes its peak bytes per work unit; a batch of ``u``
units reserves ``ceil(max(window) * u)`` bytes, so a reservation is never
below what a recent batch really used per unit. (A fixed part of a batch's
peak is spread over its units: it is over-reserved for batches larger than
the measured ones and under-reserved for smaller ones.) Until a model has a
measurement, it reserves nothing extra (its warm-up batch is measured right
after load).

A model's first readings settle before they count: the warm-up's reading and
then each lower one replaces the last, until a reading is no lower than the one
before (or ``SETTLING_READINGS`` were taken); from then on every reading goes
into the window. A first run carries one-off costs the runs after it do not:
PP-OCRv6 on CPU read 148 MiB a page-unit at its warm-up, then 103, 83, 70.3,
and 70-71 for every page after those. As the window's maximum the first
readings would hold that excess for the next 64 batches: under a budget that
cannot hold every model and one such batch beside them, every page evicted
twice the bytes it needed.
"""

from __future__ import annotations

import math
from collections import deque

# The most readings a model's first, falling readings may take to settle.
SETTLING_READINGS = 8


class ActivationStats:
    def __init__(self, window: int = 64) -> None:
        self._per_unit: deque[float] = deque(maxlen=window)
        self._settling: float | None = None  # the last of the first, falling readings
        self._settling_readings = 0
        self.num_samples = 0

    def observe(self, peak_bytes: int, units: float, *, provisional: bool = False) -> None:
        """One batch's peak; ``provisional`` for a warm-up run, which only
        ever stands in for the first real readings (see the module notes)."""
        if peak_bytes < 0 or units <= 0:
            return
        self.num_samples += 1
        value = peak_bytes / units
        if self._per_unit:
            if not provisional:
                self._per_unit.append(value)
            return
        last = self._settling
        self._settling_readings += 1
        if last is None or value < last:
            self._settling = value
        elif not provisional:
            self._per_unit.extend((last, value))
        if self._settling_readings >= SETTLING_READINGS and not self._per_unit:
            self._per_unit.append(self._settling if self._settling is not None else value)

    def reserve_bytes(self, units: float) -> int:
        if self._per_unit:
            return math.ceil(max(self._per_unit) * units)
        if self._settling is not None:
            return math.ceil(self._settling * units)
        return 0


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
