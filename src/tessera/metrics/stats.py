"""What the core reports as it serves: plain events, no Prometheus.

The engine and the gateway call a ``StatsSink``; ``metrics.prometheus`` is the
adapter that turns these events into ``tessera_*`` metric families. Gauges
(memory, residency, queue depths, the device) are read at scrape time from the
engine itself, so they need no events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """One answered or refused request, as the gateway saw it."""

    model: str | None
    task: str | None
    tier: str | None
    tenant: str | None
    status: int
    total_s: float
    queue_s: float
    reason: str | None  # why it was refused: rate, concurrency, quota, queue_full, deadline, auth


class StatsSink(Protocol):
    def on_request(self, event: RequestEvent) -> None: ...

    def on_batch(self, model: str, size: int, run_s: float) -> None: ...

    def on_load(self, model: str, seconds: float, ok: bool) -> None: ...


class NullSink:
    """Reports nowhere."""

    def on_request(self, event: RequestEvent) -> None:
        return

    def on_batch(self, model: str, size: int, run_s: float) -> None:
        return

    def on_load(self, model: str, seconds: float, ok: bool) -> None:
        return
