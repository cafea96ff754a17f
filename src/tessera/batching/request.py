"""A request waiting in a model's queue."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class PendingRequest:
    """One caller's items for one model, and the future its answer goes to.

    The caller cancels ``future`` when it goes away; the batcher then drops
    the request before it runs.
    """

    items: list[Any]
    units: float
    arrival: float
    future: asyncio.Future[list[Any]]
    deadline: float | None = None
    tenant: str = "default"
    tier: str = "standard"
    weight: float = 1.0
    latency_target_s: float | None = None  # set for requests of a latency tier
    queued_s: float = field(default=0.0)
    batch_size: int = 0  # items in the batch it ran in, once run
    run_s: float = 0.0

    @property
    def gone(self) -> bool:
        return self.future.done()

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline
