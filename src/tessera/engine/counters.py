"""Per-version request and batch counters, read into ``ModelStats``."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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
