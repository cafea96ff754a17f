"""Sliding-window statistics of measured activation peaks, per model.

Each measured batch contributes its peak bytes per work unit; a batch of ``u``
units reserves ``ceil(max(window) * u)`` bytes (plus the largest fixed
overhead seen), so a reservation is never below what a recent batch really
used per unit. Until a model has a measurement, it reserves nothing extra
(its warm-up batch is measured right after load).
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
