"""Per-version request and batch counters, read into ``ModelStats``."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tessera.metrics.stats import Durations, RequestTimes

RECENT_BATCHES = 1024


@dataclass
class ModelCounters:
    num_requests: int = 0
    num_items: int = 0
    num_batches: int = 0
    num_failures: int = 0
    # The most recent batches: (items, run seconds), for /admin/batches.
    recent_batches: deque[tuple[int, float]] = field(
        default_factory=lambda: deque(maxlen=RECENT_BATCHES)
    )
    answered: Durations = field(default_factory=Durations)
    failed: Durations = field(default_factory=Durations)
    queued: Durations = field(default_factory=Durations)
    run: Durations = field(default_factory=Durations)
    by_size: dict[int, Durations] = field(default_factory=dict)
    last_batch_at: float | None = None

    def batch_ran(self, size: int, run_s: float) -> None:
        self.num_batches += 1
        self.recent_batches.append((size, run_s))
        self.by_size[size] = self.by_size.get(size, Durations()).plus(run_s)
        self.last_batch_at = time.time()

    def batches_since(self, count: int) -> tuple[tuple[int, float], ...]:
        """The recent batches run after the ``count``-th (all of the window
        where ``count`` is not below ``num_batches``: these counters were made
        anew since)."""
        recent = self.recent_batches
        new = self.num_batches - count
        if new < 0 or new >= len(recent):
            return tuple(recent)
        return tuple(recent[-i] for i in range(new, 0, -1))

    def request_answered(self, queued_s: float, run_s: float) -> None:
        self.answered = self.answered.plus(queued_s + run_s)
        self.queued = self.queued.plus(queued_s)
        self.run = self.run.plus(run_s)

    def request_failed(self, waited_s: float) -> None:
        self.failed = self.failed.plus(waited_s)

    def times(self) -> RequestTimes:
        batches = tuple(sorted(self.by_size.items()))
        return RequestTimes(
            self.answered, self.failed, self.queued, self.run, batches, self.last_batch_at
        )
