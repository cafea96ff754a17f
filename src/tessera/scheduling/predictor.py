"""Predicted run time of a batch, from execution times measured per model.

A least-squares line ``run_s = a + b * units`` over a sliding window of
measured batches (kept up to date while serving), once the batches measured
span sizes at least ``LINE_SPREAD`` apart (the largest over the smallest).
Until then it scales the mean time per unit (total seconds over total units):
a line through sizes close together extrapolates their noise. Two rerank
batches of 60 and 64 units, one of them slowed 25-fold by a load beside it,
set a slope that predicted 73 s for a batch of 80 units that ran in 0.1 s,
and every batch of the model after it was scheduled as long work.
``predict`` returns ``None`` until there is a measurement, and callers then
do not cap the batch.
"""

from __future__ import annotations

from collections import deque

# How far apart the measured batch sizes must be (largest / smallest) to fit a line.
LINE_SPREAD = 2.0


class BatchTimePredictor:
    def __init__(self, window: int = 256) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        # The fit of the samples as they are (admission asks for every request).
        self._fit: tuple[float, float] | None = None
        self._fitted = False

    def observe(self, units: float, run_s: float) -> None:
        if units > 0 and run_s >= 0:
            self._samples.append((units, run_s))
            self._fitted = False

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def coefficients(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per unit), both non-negative."""
        if not self._fitted:
            self._fit, self._fitted = self._least_squares(), True
        return self._fit

    def _least_squares(self) -> tuple[float, float] | None:
        n = len(self._samples)
        if n == 0:
            return None
        mean_x = sum(x for x, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in self._samples)
        sizes = [x for x, _ in self._samples]
        if var_x <= 1e-12 or max(sizes) < LINE_SPREAD * min(sizes):
            return 0.0, mean_y / mean_x
        slope = sum((x - mean_x) * (y - mean_y) for x, y in self._samples) / var_x
        slope = max(slope, 0.0)
        intercept = max(mean_y - slope * mean_x, 0.0)
        return intercept, slope

    def predict(self, units: float) -> float | None:
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        intercept, slope = coefficients
        return intercept + slope * units
