"""Per-tenant admission: decided at arrival, before a request costs anything.

- ``TokenBucket``: QPS with a burst; refills continuously.
- concurrency: requests in flight per tenant, released when answered.
- daily quota: work units per UTC day, charged at admission with the
  request's estimate (for chat: prompt plus maximum new tokens), then
  ``settle``d to what the request is finally charged (what ran; nothing for a
  request that never ran), the figure its audit row records too.

The controller is plain Python over a ``Clock`` (monotonic, for the bucket)
and a wall-clock function (for the day boundary), so tests fake both.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tessera.clock import Clock
from tessera.errors import PayloadTooLargeError, RateLimitedError

DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's limits; ``None`` means unlimited."""

    name: str
    qps: float | None = None
    burst: int | None = None
    max_concurrency: int | None = None
    daily_units: float | None = None


def default_burst(limits: TenantLimits) -> int:
    """The bucket's size: the tenant's burst, else one second of its rate."""
    if limits.burst is not None:
        return limits.burst
    return max(1, math.ceil(limits.qps)) if limits.qps is not None else 1


class TokenBucket:
    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = max(1.0, burst)
        self.tokens = self.burst
        self.updated = now

    def refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def try_take(self, now: float) -> bool:
        self.refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def wait_s(self) -> float:
        """Seconds until one token is available."""
        return max(0.0, (1.0 - self.tokens) / self.rate) if self.rate > 0 else math.inf

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, (self.burst - self.tokens) / self.rate) if self.rate > 0 else math.inf


@dataclass
class _TenantState:
    bucket: TokenBucket | None = None
    in_flight: int = 0
    day: int = -1
    units_today: float = 0.0
    limits: TenantLimits = field(default_factory=lambda: TenantLimits(""))


@dataclass(frozen=True, slots=True)
class Admission:
    """A granted admission; ``release`` it when the request is answered and
    ``settle`` it once its final charge is known."""

    tenant: str
    units: float = 0.0  # the estimate charged at admission
    day: int = -1  # the UTC day it was charged to


def refuse_over_quota(limits: TenantLimits, units: float) -> None:
    """A request larger than its tenant's whole daily quota can never be
    admitted: 413 that says so, not a 429 whose Retry-After (the next day)
    its client would wait out to be refused again."""
    if limits.daily_units is not None and units > limits.daily_units:
        raise PayloadTooLargeError(
            f"this request needs {units:g} work units, more than tenant"
            f" {limits.name!r}'s whole daily quota of {limits.daily_units:g}"
        )


class AdmissionControl(Protocol):
    """Admission as the engine asks for it: this process's counters
    (``AdmissionController``) or counters shared by many gateways
    (``admission.shared.RedisAdmissionController``)."""

    def admit(self, limits: TenantLimits, units: float) -> Admission:
        """Admit one request of ``units`` work units, or raise ``RateLimitedError``."""
        ...

    def settle(self, admission: Admission, units: float) -> None:
        """Charge ``units`` in place of the estimate admitted."""
        ...

    def release(self, admission: Admission) -> None:
        """The request is answered: its slot in flight is free."""
        ...

    def seed_usage(self, tenant: str, units_today: float) -> None:
        """Start the day's count from what the audit log recorded."""
        ...

    def remaining(self, limits: TenantLimits) -> float | None:
        """Whole tokens in the tenant's bucket now; None without a bucket."""
        ...

    def in_flight(self, tenant: str) -> int:
        """The tenant's requests admitted and not yet released."""
        ...


class AdmissionController:
    """``AdmissionControl`` in this process's memory."""

    def __init__(self, clock: Clock, wall_time: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._wall_time = wall_time
        self._tenants: dict[str, _TenantState] = {}

    def _state(self, limits: TenantLimits) -> _TenantState:
        state = self._tenants.get(limits.name)
        if state is None:
            state = self._tenants[limits.name] = _TenantState()
        if state.limits != limits:  # limits changed without a restart
            state.limits = limits
            state.bucket = None
        if state.bucket is None and limits.qps is not None:
            state.bucket = TokenBucket(limits.qps, default_burst(limits), self._clock.now())
        return state

    def seed_usage(self, tenant: str, units_today: float) -> None:
        """Start the day's count from what the audit log recorded (after a restart)."""
        state = self._tenants.setdefault(tenant, _TenantState(limits=TenantLimits(tenant)))
        state.day = self._today()
        state.units_today = units_today

    def _today(self) -> int:
        return int(self._wall_time() // DAY_S)

    def admit(self, limits: TenantLimits, units: float) -> Admission:
        """Admit one request of ``units`` work units, or raise ``RateLimitedError``."""
        refuse_over_quota(limits, units)
        state = self._state(limits)
        now = self._clock.now()
        today = self._today()
        if state.day != today:
            state.day, state.units_today = today, 0.0
        if limits.max_concurrency is not None and state.in_flight >= limits.max_concurrency:
            raise RateLimitedError(
                f"tenant {limits.name!r} has {state.in_flight} requests in flight,"
                f" its limit is {limits.max_concurrency}",
                reason="concurrency",
                retry_after_s=1.0,
                limit=limits.max_concurrency,
                remaining=0,
            )
        if limits.daily_units is not None and state.units_today + units > limits.daily_units:
            reset = (today + 1) * DAY_S - self._wall_time()
            raise RateLimitedError(
                f"tenant {limits.name!r} has used its daily quota of {limits.daily_units:g}"
                f" work units ({state.units_today:g} used, this request needs {units:g})",
                reason="quota",
                retry_after_s=reset,
                limit=limits.daily_units,
                remaining=max(0.0, limits.daily_units - state.units_today),
                reset_s=reset,
            )
        bucket = state.bucket
        if bucket is not None and not bucket.try_take(now):
            raise RateLimitedError(
                f"tenant {limits.name!r} is over its rate of {limits.qps:g} requests/s",
                reason="rate",
                retry_after_s=bucket.wait_s(),
                limit=limits.qps,
                remaining=0,
                reset_s=bucket.reset_s(),
            )
        state.in_flight += 1
        state.units_today += units
        return Admission(limits.name, units, today)

    def settle(self, admission: Admission, units: float) -> None:
        """Charge ``units`` in place of the estimate admitted. A request that
        ends on a later day than it was admitted is charged to that day (the
        day its audit row is written in)."""
        state = self._tenants.get(admission.tenant)
        if state is None:
            return
        today = self._today()
        if state.day != today:
            state.day, state.units_today = today, 0.0
        charged = admission.units if admission.day == today else 0.0
        state.units_today = max(0.0, state.units_today + units - charged)

    def remaining(self, limits: TenantLimits) -> float | None:
        state = self._tenants.get(limits.name)
        if state is None or state.bucket is None:
            return None
        state.bucket.refill(self._clock.now())
        return math.floor(state.bucket.tokens)

    def release(self, admission: Admission) -> None:
        state = self._tenants.get(admission.tenant)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1

    def in_flight(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return state.in_flight if state is not None else 0
