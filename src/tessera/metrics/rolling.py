"""The last minute of traffic, in memory, for the live page and ``/admin/slo``.

Prometheus keeps history; this keeps only a sliding window of request events
so that tessera can answer "what is happening now" without a Prometheus:
per model and tier QPS and p50/p99, per-tenant counts, the batch-size
distribution, and the most recent rejections.

Latency quantiles and SLO shares count answered requests only (status < 400):
a refusal is fast and would flatter them. ``errors`` counts every status >= 400,
refusals included; ``rejected`` only the refusals (``REJECT_REASONS``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tessera.clock import Clock, MonotonicClock
from tessera.metrics.stats import RequestEvent

REJECT_REASONS = ("rate", "concurrency", "quota", "queue_full", "deadline", "auth")
BATCH_BUCKETS = ("1", "2-4", "5-8", "9-16", "17-32", "33+")
# Label for a missing model/tier/tenant, and for a model name the repository
# does not know (a 404): client input must not grow the label set.
NONE_LABEL = "none"
UNKNOWN_MODEL = "unknown"
MAX_EVENTS = 200_000  # a cap on memory: ~3 kQPS sustained over a 60 s window
MAX_REJECTIONS = 50


def batch_bucket(size: int) -> str:
    """The live page's batch-size bucket for ``size`` items."""
    for bound, label in ((1, "1"), (4, "2-4"), (8, "5-8"), (16, "9-16"), (32, "17-32")):
        if size <= bound:
            return label
    return "33+"


def model_label(name: str | None, known: Container[str] | None) -> str:
    if name is None:
        return NONE_LABEL
    if known is not None and name not in known:
        return UNKNOWN_MODEL
    return name


def quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


@dataclass(frozen=True, slots=True)
class _Request:
    at: float
    model: str
    tier: str
    tenant: str | None
    status: int
    total_s: float
    rejected: bool


@dataclass(frozen=True, slots=True)
class ModelWindow:
    name: str
    qps: float
    p50_ms: float | None
    p99_ms: float | None
    requests: int
    errors: int
    rejected: int


@dataclass(frozen=True, slots=True)
class TierWindow:
    tier: str
    qps: float
    p50_ms: float | None
    p99_ms: float | None
    requests: int


@dataclass(frozen=True, slots=True)
class TenantWindow:
    tenant: str
    requests: int


@dataclass(frozen=True, slots=True)
class Rejection:
    time: float  # unix seconds
    tenant: str | None
    model: str | None
    reason: str
    status: int


@dataclass(frozen=True, slots=True)
class RollingSnapshot:
    """``GET /admin/stats``: the window, as JSON-ready dataclasses."""

    window_s: float
    models: list[ModelWindow]
    tiers: list[TierWindow]
    tenants: list[TenantWindow]
    rejections: list[Rejection]
    batch_sizes: dict[str, dict[str, int]]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class SloWindow:
    """One model's latency objective over the window (answered requests only).

    ``ok`` is None where there is nothing to judge: no target, or no requests.
    """

    name: str
    target_ms: float | None
    requests: int
    within_target: int
    share_within: float | None
    p99_ms: float | None
    ok: bool | None


class RollingStats:
    """A ``StatsSink`` that keeps the last ``window_s`` seconds of events.

    ``clock`` (monotonic) bounds the window; ``wall_clock`` stamps rejections.
    ``models``, when given, maps names it does not contain to "unknown".
    """

    def __init__(
        self,
        window_s: float = 60.0,
        *,
        clock: Clock | None = None,
        wall_clock: Callable[[], float] = time.time,
        models: Container[str] | None = None,
        max_events: int = MAX_EVENTS,
        max_rejections: int = MAX_REJECTIONS,
    ) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._clock: Clock = clock or MonotonicClock()
        self._wall = wall_clock
        self._models = models
        self._started = self._clock.now()
        self._requests: deque[_Request] = deque(maxlen=max_events)
        self._batches: deque[tuple[float, str, int]] = deque(maxlen=max_events)
        self._rejections: deque[Rejection] = deque(maxlen=max_rejections)
        # The engine calls sinks on its event loop, but nothing forbids a thread:
        # a snapshot must not iterate a deque another thread is appending to.
        self._lock = threading.Lock()

    # -- StatsSink -----------------------------------------------------------

    def on_request(self, event: RequestEvent) -> None:
        now = self._clock.now()
        model = model_label(event.model, self._models)
        rejected = event.reason in REJECT_REASONS
        record = _Request(
            now,
            model,
            event.tier or NONE_LABEL,
            event.tenant,
            event.status,
            event.total_s,
            rejected,
        )
        with self._lock:
            self._requests.append(record)
            if rejected and event.reason is not None:
                self._rejections.append(
                    Rejection(self._wall(), event.tenant, event.model, event.reason, event.status)
                )
            self._prune(now)

    def on_batch(self, model: str, size: int, run_s: float) -> None:
        now = self._clock.now()
        with self._lock:
            self._batches.append((now, model_label(model, self._models), size))
            self._prune(now)

    def on_load(self, model: str, seconds: float, ok: bool) -> None:
        return

    # -- reading -------------------------------------------------------------

    def snapshot(self) -> RollingSnapshot:
        now = self._clock.now()
        with self._lock:
            self._prune(now)
            requests = list(self._requests)
            batches = list(self._batches)
            rejections = list(reversed(self._rejections))  # newest first
        span = self._span(now)
        by_model = _group(requests, lambda r: r.model)
        by_tier = _group(requests, lambda r: r.tier)
        models = [
            ModelWindow(
                name,
                round(len(rs) / span, 3),
                *_p50_p99(rs),
                len(rs),
                sum(1 for r in rs if r.status >= 400),
                sum(1 for r in rs if r.rejected),
            )
            for name, rs in sorted(by_model.items())
        ]
        tiers = [
            TierWindow(tier, round(len(rs) / span, 3), *_p50_p99(rs), len(rs))
            for tier, rs in sorted(by_tier.items())
        ]
        tenant_counts = Counter(r.tenant for r in requests if r.tenant is not None)
        tenants = [TenantWindow(t, n) for t, n in sorted(tenant_counts.items())]
        batch_sizes: dict[str, dict[str, int]] = {}
        for _, model, size in batches:
            buckets = batch_sizes.setdefault(model, dict.fromkeys(BATCH_BUCKETS, 0))
            buckets[batch_bucket(size)] += 1
        return RollingSnapshot(self.window_s, models, tiers, tenants, rejections, batch_sizes)

    def slo(
        self, targets_ms: Mapping[str, float | None], objective: float = 0.99
    ) -> list[SloWindow]:
        """Per model in ``targets_ms``: the share of answered requests within its target."""
        now = self._clock.now()
        with self._lock:
            self._prune(now)
            requests = list(self._requests)
        answered = _group([r for r in requests if r.status < 400], lambda r: r.model)
        result = []
        for name, target_ms in sorted(targets_ms.items()):
            latencies = [r.total_s for r in answered.get(name, [])]
            within = (
                sum(1 for s in latencies if s * 1000.0 <= target_ms) if target_ms is not None else 0
            )
            share = within / len(latencies) if latencies and target_ms is not None else None
            result.append(
                SloWindow(
                    name,
                    target_ms,
                    len(latencies),
                    within,
                    None if share is None else round(share, 6),
                    _ms(quantile(latencies, 0.99)),
                    None if share is None else share >= objective,
                )
            )
        return result

    # -- internals -------------------------------------------------------------

    def _span(self, now: float) -> float:
        # A fresh server has not seen a whole window yet: divide by what it has
        # seen (at least a second, so one early burst does not read as 1000 QPS).
        return max(1.0, min(self.window_s, now - self._started))

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        while self._requests and self._requests[0].at < horizon:
            self._requests.popleft()
        while self._batches and self._batches[0][0] < horizon:
            self._batches.popleft()


def _group(
    requests: Iterable[_Request], key: Callable[[_Request], str]
) -> dict[str, list[_Request]]:
    groups: dict[str, list[_Request]] = {}
    for request in requests:
        groups.setdefault(key(request), []).append(request)
    return groups


def _p50_p99(requests: list[_Request]) -> tuple[float | None, float | None]:
    latencies = [r.total_s for r in requests if r.status < 400]
    return _ms(quantile(latencies, 0.5)), _ms(quantile(latencies, 0.99))
