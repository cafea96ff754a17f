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
    """The fit is kept as running sums over the window (a refit over the whole
    window after each batch cost O(window) per request with batches of one,
    as a hundred models round robin run), recounted from the samples once a
    window to shed the rounding that adding and taking away leaves."""

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._window = window
        self._samples: deque[tuple[float, float]] = deque()
        self._n_x = self._n_y = self._n_xx = self._n_xy = 0.0
        self._since_recount = 0
        # The smallest and largest sizes in the window: (sequence, size), each
        # deque's sizes increasing (smallest) or decreasing (largest) from its front.
        self._seq = 0
        self._smallest: deque[tuple[int, float]] = deque()
        self._largest: deque[tuple[int, float]] = deque()
        # The fit of the samples as they are (admission asks for every request).
        self._fit: tuple[float, float] | None = None
        self._fitted = False

    def observe(self, units: float, run_s: float) -> None:
        if not (units > 0 and run_s >= 0):
            return
        if len(self._samples) == self._window:
            old_x, old_y = self._samples.popleft()
            self._add(old_x, old_y, -1.0)
            first = self._seq - self._window
            for extremes in (self._smallest, self._largest):
                if extremes and extremes[0][0] == first:
                    extremes.popleft()
        self._samples.append((units, run_s))
        self._add(units, run_s, 1.0)
        while self._smallest and self._smallest[-1][1] >= units:
            self._smallest.pop()
        while self._largest and self._largest[-1][1] <= units:
            self._largest.pop()
        self._smallest.append((self._seq, units))
        self._largest.append((self._seq, units))
        self._seq += 1
        self._since_recount += 1
        if self._since_recount >= self._window:
            self._recount()
        self._fitted = False

    def _add(self, x: float, y: float, sign: float) -> None:
        self._n_x += sign * x
        self._n_y += sign * y
        self._n_xx += sign * x * x
        self._n_xy += sign * x * y

    def _recount(self) -> None:
        self._n_x = self._n_y = self._n_xx = self._n_xy = 0.0
        for x, y in self._samples:
            self._add(x, y, 1.0)
        self._since_recount = 0

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def smallest_units(self) -> float | None:
        """The smallest batch size in the window; None before a measurement."""
        return self._smallest[0][1] if self._smallest else None

    def coefficients(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per unit), both non-negative."""
        if not self._fitted:
            self._fit, self._fitted = self._least_squares(), True
        return self._fit

    def _least_squares(self) -> tuple[float, float] | None:
        n = len(self._samples)
        if n == 0:
            return None
        mean_x = self._n_x / n
        mean_y = max(0.0, self._n_y / n)
        smallest, largest = self._smallest[0][1], self._largest[0][1]
        var_x = self._n_xx - n * mean_x * mean_x
        if largest < LINE_SPREAD * smallest or var_x <= 1e-12:
            return 0.0, mean_y / mean_x
        slope = max((self._n_xy - n * mean_x * mean_y) / var_x, 0.0)
        intercept = max(mean_y - slope * mean_x, 0.0)
        return intercept, slope

    def line(self) -> tuple[float, float] | None:
        """``coefficients`` where they are a line fitted over sizes at least
        ``LINE_SPREAD`` apart; None before (the mean time per unit has no
        fixed part: a batch's fixed cost is not seen until sizes differ)."""
        n = len(self._samples)
        if n < 2 or self._largest[0][1] < LINE_SPREAD * self._smallest[0][1]:
            return None
        return self.coefficients()

    def predict(self, units: float) -> float | None:
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        intercept, slope = coefficients
        return intercept + slope * units
