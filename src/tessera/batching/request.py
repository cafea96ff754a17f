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
    queued_s: float = field(default=0.0)

    @property
    def gone(self) -> bool:
        return self.future.done()

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline
