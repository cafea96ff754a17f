"""Sliding-window statistics of measured activation peaks, per model.

Each measured batch contributes its peak bytes per work unit; a batch of ``u``
units reserves ``ceil(max(window) * u)`` bytes, so a reservation is never
below what a recent batch really used per unit. (A fixed part of a batch's
peak is spread over its units: it is over-reserved for batches larger than
the measured ones and under-reserved for smaller ones.) Until a model has a
measurement, it reserves nothing extra (its warm-up batch is measured right
after load).
"""

from __future__ import annotations

import math
from collections import deque


class ActivationStats:
    def __init__(self, window: int = 64) -> None:
        self._per_unit: deque[float] = deque(maxlen=window)
        self.num_samples = 0

    def observe(self, peak_bytes: int, units: float) -> None:
        if peak_bytes < 0 or units <= 0:
            return
        self._per_unit.append(peak_bytes / units)
        self.num_samples += 1

    def reserve_bytes(self, units: float) -> int:
        if not self._per_unit:
            return 0
        return math.ceil(max(self._per_unit) * units)


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

    def observe(self, name: str, peak_bytes: int, units: float) -> None:
        self.of(name).observe(peak_bytes, units)

    def forget(self, name: str) -> None:
        """Drop a retired model's measurements."""
        self._stats.pop(name, None)
