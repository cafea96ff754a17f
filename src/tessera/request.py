"""A request waiting for a model, as the queues see it: a small, low-level type.

``batching/`` and ``scheduling/`` both import it; neither writes to it. What
happens to a request (when its batch formed, how long it ran, its outputs)
travels back in the ``RequestResult`` its future is resolved with, not in the
request itself.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What a caller gets back: one output per item, and how its batch went."""

    outputs: list[Any]
    queued_s: float  # from arrival to the forming of its batch
    run_s: float  # the batch's run time
    batch_size: int  # items in the batch it ran in


@dataclass(frozen=True, eq=False, slots=True)
class QueuedRequest:
    """One caller's items for one model, and the future its answer goes to.

    The caller cancels ``future`` when it goes away; the batcher then drops
    the request before it runs.
    """

    items: list[Any]
    units: float
    arrival: float
    future: asyncio.Future[RequestResult]
    deadline: float | None = None
    tenant: str = "default"
    tier: str = "standard"
    weight: float = 1.0
    latency_target_s: float | None = None  # set for requests of a latency tier

    @property
    def gone(self) -> bool:
        return self.future.done()

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


@dataclass(frozen=True, slots=True)
class Batch:
    """Requests the batcher took together, and when it took them."""

    requests: list[QueuedRequest]
    formed_at: float

    @property
    def num_items(self) -> int:
        return sum(len(r.items) for r in self.requests)
