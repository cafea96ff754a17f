"""Per-tenant admission: decided at arrival, before a request costs anything.

- ``TokenBucket``: QPS with a burst; refills continuously.
- concurrency: requests in flight per tenant, released when answered.
- daily quota: work units per UTC day, charged at admission with the
  request's estimate (for chat: prompt plus maximum new tokens), then
  ``settle``d to what the request is finally charged (what ran; nothing for a
  request that never ran), the figure its audit row records too. A refusal
  that only the estimates of the tenant's requests in flight make (they
  hold them until they settle, most for less) says so, with a Retry-After of
  a second, not of the next day (``quota_refusal``).

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
    held: float = 0.0  # of ``units_today``: estimates of requests not yet settled
    limits: TenantLimits = field(default_factory=lambda: TenantLimits(""))


@dataclass(frozen=True, slots=True)
class Admission:
    """A granted admission; ``release`` it when the request is answered and
    ``settle`` it once its final charge is known."""

    tenant: str
    units: float = 0.0  # the estimate charged at admission
    day: int = -1  # the UTC day it was charged to
    # Admitted on a gateway's own share while the shared store was lost
    # (``admission.shared``): released and settled there.
    local: bool = False


def refuse_over_quota(limits: TenantLimits, units: float) -> None:
    """A request larger than its tenant's whole daily quota can never be
    admitted: 413 that says so, not a 429 whose Retry-After (the next day)
    its client would wait out to be refused again."""
    if limits.daily_units is not None and units > limits.daily_units:
        raise PayloadTooLargeError(
            f"this request needs {units:g} work units, more than tenant"
            f" {limits.name!r}'s whole daily quota of {limits.daily_units:g}"
        )


# The Retry-After of a quota refusal that requests in flight may lift as they settle.
HELD_RETRY_S = 1.0


def quota_refusal(
    limits: TenantLimits, units: float, used: float, held: float, reset_s: float
) -> RateLimitedError:
    """The refusal of ``units`` that would pass the tenant's daily quota:
    ``used`` counted today, ``held`` of it the estimates of requests still in
    flight. Without those estimates the request fits: a retry once they settle
    (most for less than they hold) may be admitted, so its wait is a second,
    not the day's end."""
    daily = limits.daily_units if limits.daily_units is not None else math.inf
    if held > 0 and used - held + units <= daily:
        message = (
            f"tenant {limits.name!r} is at its daily quota of {daily:g} work units while"
            f" its requests in flight hold {held:g} of the {used:g} counted until they end"
            f" (this request needs {units:g}); retry as they do"
        )
        retry_after_s = HELD_RETRY_S
    else:
        message = (
            f"tenant {limits.name!r} has used its daily quota of {daily:g}"
            f" work units ({used:g} used, this request needs {units:g})"
        )
        retry_after_s = reset_s
    return RateLimitedError(
        message,
        reason="quota",
        retry_after_s=retry_after_s,
        limit=limits.daily_units,
        remaining=max(0.0, daily - used),
        reset_s=reset_s,
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

    @property
    def degraded(self) -> bool:
        """Admission's shared store is lost: limits are kept on this process's share."""
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
        self._roll(state, self._today())
        state.units_today = units_today

    def _today(self) -> int:
        return int(self._wall_time() // DAY_S)

    @staticmethod
    def _roll(state: _TenantState, today: int) -> None:
        """Start a new day's count (and its held estimates) if ``today`` is one."""
        if state.day != today:
            state.day, state.units_today, state.held = today, 0.0, 0.0

    def admit(self, limits: TenantLimits, units: float) -> Admission:
        """Admit one request of ``units`` work units, or raise ``RateLimitedError``."""
        refuse_over_quota(limits, units)
        state = self._state(limits)
        now = self._clock.now()
        today = self._today()
        self._roll(state, today)
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
            held = state.held if state.in_flight else 0.0
            reset = (today + 1) * DAY_S - self._wall_time()
            raise quota_refusal(limits, units, state.units_today, held, reset)
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
        state.held += units
        return Admission(limits.name, units, today)

    def settle(self, admission: Admission, units: float) -> None:
        """Charge ``units`` in place of the estimate admitted. A request that
        ends on a later day than it was admitted is charged to that day (the
        day its audit row is written in)."""
        state = self._tenants.get(admission.tenant)
        if state is None:
            return
        today = self._today()
        self._roll(state, today)
        charged = admission.units if admission.day == today else 0.0
        state.units_today = max(0.0, state.units_today + units - charged)
        state.held = max(0.0, state.held - charged)

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

    @property
    def degraded(self) -> bool:
        return False  # its counters are this process's: never out of reach

    def take_units(self) -> dict[str, float]:
        """Each tenant's units counted today, counted from zero again (a
        shared store taking them over)."""
        taken = {}
        for tenant, state in self._tenants.items():
            if state.day == self._today() and state.units_today > 0:
                taken[tenant] = state.units_today
            state.units_today, state.held = 0.0, 0.0
        return taken
