"""Admission shared by many gateways: the same limits as ``AdmissionController``
(a token bucket per tenant, requests in flight, daily work units), kept in
Redis so that they hold across every gateway at once.

Design notes (the invariants first):

- Every decision is one Lua script, which Redis runs alone: ``admit`` refills
  and takes from the bucket, checks concurrency and the day's units, and
  counts the request, or refuses with the reason and the wait, as the
  in-process controller does (the same checks in the same order, the same
  ``RateLimitedError`` figures). Two gateways can never both take the last
  token or the last slot.
- Time is Redis's own (``TIME`` inside the script), for the bucket and the UTC
  day alike, so gateways with skewed clocks agree.
- Requests in flight are counted per gateway, each count with a lease (an
  expiry in Redis time) that the gateway renews every third of ``lease_s``
  while it has requests in flight, and that each admit and release renews
  too. A count whose lease lapsed belongs to a gateway that died (or stalled
  for longer than the lease) and is dropped by the next script that reads the
  tenant's counts: a dead gateway's slots come back after ``lease_s``. A
  gateway that finds its count dropped while it lives writes it back.
- The day's units are a hash of UTC day -> units, which expires two days
  after its last write; beside it, of those units, the estimates of requests
  not yet settled (``held``, UTC day -> units), which a quota refusal reads
  while the tenant has requests in flight (``quota_refusal``: a second's
  wait, not the next day's, where only they stand in the way);
  ``seed_usage`` (from the audit log, at a gateway's start) only fills a day
  that Redis does not hold yet, so a restarted gateway never overwrites what
  the others counted.
- Keys are ``<prefix>{<tenant>}:bucket|flight|units|held``: the hash tag keeps one
  tenant's keys in one slot of a Redis Cluster, and each script names every
  key it touches.
- Each gateway writes a heartbeat (``<prefix>gateways``: its id -> its
  lease's end) with every lease renewal, and reads how many gateways live.
- Redis lost (a command fails to reach it): this gateway admits on its own
  share of every limit (``gateway_share``: the limit divided by the gateways
  it last saw live), in its own memory, and says so (``degraded``; readiness
  says ``degraded``), logging the loss once. Together the gateways then keep
  about the limits, and no tenant is refused for the store's fault. The
  renewer thread tries Redis every ``retry_s``; once it answers, admission is
  shared again and the units admitted meanwhile are added to the tenants'
  days there. Requests admitted on the share are released and settled on it.
  ``release`` and ``settle`` of a shared admission that cannot reach Redis log
  and go on (the lease returns the slot; the audit log keeps the true charge).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any

from tessera.admission.limits import (
    Admission,
    AdmissionController,
    TenantLimits,
    default_burst,
    quota_refusal,
    refuse_over_quota,
)
from tessera.clock import Clock, MonotonicClock
from tessera.errors import RateLimitedError, TenantError

if TYPE_CHECKING:
    import redis
    from redis.commands.core import Script

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "tessera:"
DEFAULT_LEASE_S = 30.0
# How often a gateway that lost Redis tries it again.
DEFAULT_RETRY_S = 1.0

# Shared by the scripts: Redis time, and the live in-flight count of a tenant
# (dropping the counts whose lease lapsed). Fields of KEYS flight: n:<gateway>
# (its count) and u:<gateway> (its lease's end, Redis time).
_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local day = math.floor(now / 86400)
local function live_in_flight(key)
  local fields = redis.call('HGETALL', key)
  local counts, untils = {}, {}
  for i = 1, #fields, 2 do
    local kind, gw = string.sub(fields[i], 1, 1), string.sub(fields[i], 3)
    local value = tonumber(fields[i + 1])
    if kind == 'n' then counts[gw] = value else untils[gw] = value end
  end
  local total = 0
  for gw, n in pairs(counts) do
    local lease = untils[gw]
    if lease == nil or lease < now then
      redis.call('HDEL', key, 'n:' .. gw, 'u:' .. gw)
    else
      total = total + n
    end
  end
  for gw, _ in pairs(untils) do
    if counts[gw] == nil then redis.call('HDEL', key, 'u:' .. gw) end
  end
  return total
end
"""

# KEYS: bucket, flight, units, held. ARGV: gateway, lease_s, max_concurrency (-1: none),
# daily_units (-1: none), units, rate (-1: none), burst.
# Returns {'ok', day} or {'concurrency', in_flight} or {'quota', used, reset_s, held}
# or {'rate', wait_s, reset_s}; numbers as strings (Lua numbers would be cut to integers).
_ADMIT = (
    _COMMON
    + """
local gw, lease = ARGV[1], tonumber(ARGV[2])
local max_concurrency, daily, units = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local rate, burst = tonumber(ARGV[6]), tonumber(ARGV[7])
local in_flight = live_in_flight(KEYS[2])
if max_concurrency >= 0 and in_flight >= max_concurrency then
  return {'concurrency', tostring(in_flight)}
end
local used = tonumber(redis.call('HGET', KEYS[3], day) or '0')
if daily >= 0 and used + units > daily then
  local held = 0
  if in_flight > 0 then held = tonumber(redis.call('HGET', KEYS[4], day) or '0') end
  return {'quota', tostring(used), tostring((day + 1) * 86400 - now), tostring(held)}
end
if rate >= 0 then
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'updated', 'rate', 'burst')
  local tokens = burst
  -- A bucket made under other limits starts again full, as a new one would.
  if b[1] and tonumber(b[3]) == rate and tonumber(b[4]) == burst then
    tokens = math.min(burst, tonumber(b[1]) + math.max(0, now - tonumber(b[2])) * rate)
  end
  local ok = tokens >= 1
  if ok then tokens = tokens - 1 end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'updated', tostring(now),
             'rate', ARGV[6], 'burst', ARGV[7])
  -- Idle long enough to be full again, a bucket is the same as none.
  redis.call('PEXPIRE', KEYS[1], math.ceil((burst / rate + 60) * 1000))
  if not ok then
    return {'rate', tostring((1 - tokens) / rate), tostring((burst - tokens) / rate)}
  end
end
redis.call('HINCRBY', KEYS[2], 'n:' .. gw, 1)
redis.call('HSET', KEYS[2], 'u:' .. gw, tostring(now + lease))
redis.call('PEXPIRE', KEYS[2], math.ceil(lease * 2000))
for _, key in ipairs({KEYS[3], KEYS[4]}) do
  redis.call('HINCRBYFLOAT', key, day, units)
  redis.call('EXPIRE', key, 2 * 86400)
  for _, field in ipairs(redis.call('HKEYS', key)) do
    if tonumber(field) < day - 1 then redis.call('HDEL', key, field) end
  end
end
return {'ok', tostring(day)}
"""
)

# KEYS: flight. ARGV: gateway, lease_s.
_RELEASE = (
    _COMMON
    + """
local n = tonumber(redis.call('HGET', KEYS[1], 'n:' .. ARGV[1]) or '0')
if n > 1 then
  redis.call('HINCRBY', KEYS[1], 'n:' .. ARGV[1], -1)
  redis.call('HSET', KEYS[1], 'u:' .. ARGV[1], tostring(now + tonumber(ARGV[2])))
elseif n == 1 then
  redis.call('HDEL', KEYS[1], 'n:' .. ARGV[1], 'u:' .. ARGV[1])
end
return 0
"""
)

# KEYS: flight. ARGV: gateway, lease_s, this gateway's count (written back if dropped).
_RENEW = (
    _COMMON
    + """
redis.call('HSETNX', KEYS[1], 'n:' .. ARGV[1], ARGV[3])
redis.call('HSET', KEYS[1], 'u:' .. ARGV[1], tostring(now + tonumber(ARGV[2])))
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 2000))
return 0
"""
)

# KEYS: units, held. ARGV: the day admitted, the estimate charged then, the final charge.
_SETTLE = (
    _COMMON
    + """
local charged = 0
if tonumber(ARGV[1]) == day then
  charged = tonumber(ARGV[2])
  local held = tonumber(redis.call('HGET', KEYS[2], day) or '0') - charged
  if held > 1e-9 then redis.call('HSET', KEYS[2], day, tostring(held))
  else redis.call('HDEL', KEYS[2], day) end
end
local used = tonumber(redis.call('HGET', KEYS[1], day) or '0')
redis.call('HSET', KEYS[1], day, tostring(math.max(0, used + tonumber(ARGV[3]) - charged)))
redis.call('EXPIRE', KEYS[1], 2 * 86400)
return 0
"""
)

# KEYS: units. ARGV: units used today, as the audit log counts them.
_SEED = (
    _COMMON
    + """
if redis.call('HSETNX', KEYS[1], day, ARGV[1]) == 1 then
  redis.call('EXPIRE', KEYS[1], 2 * 86400)
end
return 0
"""
)

# KEYS: bucket. ARGV: rate, burst. The tokens now (a bucket absent or made
# under other limits is full).
_TOKENS = (
    _COMMON
    + """
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'updated', 'rate', 'burst')
if b[1] and tonumber(b[3]) == rate and tonumber(b[4]) == burst then
  return tostring(math.min(burst, tonumber(b[1]) + math.max(0, now - tonumber(b[2])) * rate))
end
return tostring(burst)
"""
)

# KEYS: flight.
_IN_FLIGHT = _COMMON + "return live_in_flight(KEYS[1])"

# KEYS: gateways. ARGV: gateway, lease_s. This gateway's heartbeat; returns
# how many gateways live (their heartbeats not lapsed; lapsed ones dropped).
_HEARTBEAT = (
    _COMMON
    + """
redis.call('HSET', KEYS[1], ARGV[1], tostring(now + tonumber(ARGV[2])))
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 2000))
local live = 0
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if tonumber(fields[i + 1]) < now then redis.call('HDEL', KEYS[1], fields[i])
  else live = live + 1 end
end
return live
"""
)


def gateway_share(limits: TenantLimits, num_gateways: int) -> TenantLimits:
    """One gateway's share of ``limits`` among ``num_gateways``: each limit
    divided among them (a burst and a concurrency at least 1)."""
    n = max(1, num_gateways)
    if n == 1:
        return limits
    return TenantLimits(
        limits.name,
        qps=limits.qps / n if limits.qps is not None else None,
        burst=max(1, default_burst(limits) // n) if limits.qps is not None else limits.burst,
        max_concurrency=(
            max(1, limits.max_concurrency // n) if limits.max_concurrency is not None else None
        ),
        daily_units=limits.daily_units / n if limits.daily_units is not None else None,
    )


class RedisAdmissionController:
    """``AdmissionControl`` over Redis; see the module notes. ``close`` stops
    the lease renewals (the counts then lapse after ``lease_s``)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        lease_s: float = DEFAULT_LEASE_S,
        gateway_id: str | None = None,
        retry_s: float = DEFAULT_RETRY_S,
        clock: Clock | None = None,
    ) -> None:
        if not lease_s > 0 or not retry_s > 0:
            raise ValueError("lease_s and retry_s must be positive")
        self._client = client
        self.prefix = prefix
        self.lease_s = lease_s
        self.gateway_id = gateway_id or secrets.token_hex(8)
        self._admit = client.register_script(_ADMIT)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)
        self._settle = client.register_script(_SETTLE)
        self._seed = client.register_script(_SEED)
        self._tokens = client.register_script(_TOKENS)
        self._in_flight = client.register_script(_IN_FLIGHT)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self.retry_s = retry_s
        # While Redis is lost (``_lost_since`` set, under ``_lock``): this
        # gateway's share of the limits, in its own memory (module notes).
        self._local = AdmissionController(clock or MonotonicClock())
        self._lost_since: float | None = None
        self._num_gateways = 1  # gateways live at the last heartbeat
        # This gateway's requests in flight by tenant: whose leases to renew.
        self._mine: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._renewer = threading.Thread(
            target=self._renew_until_closed, name="admission-leases", daemon=True
        )
        self._renewer.start()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        lease_s: float = DEFAULT_LEASE_S,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> RedisAdmissionController:
        import redis

        client = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)
        return cls(client, prefix=prefix, lease_s=lease_s, retry_s=retry_s)

    def close(self) -> None:
        self._closing.set()
        self._renewer.join()
        self._client.close()

    @property
    def degraded(self) -> bool:
        """Redis is lost: this gateway admits on its share of the limits."""
        return self._lost_since is not None

    @property
    def num_gateways(self) -> int:
        """Gateways live at this one's last heartbeat (its share's divisor)."""
        return self._num_gateways

    # -- the AdmissionControl interface ---------------------------------------

    def admit(self, limits: TenantLimits, units: float) -> Admission:
        """Admit one request of ``units`` work units, or raise ``RateLimitedError``."""
        refuse_over_quota(limits, units)
        with self._lock:
            if self._lost_since is None:
                try:
                    return self._admit_shared(limits, units)
                except TenantError as e:
                    self._lose(e)
            share = gateway_share(limits, self._num_gateways)
            return dataclasses.replace(self._local.admit(share, units), local=True)

    def _admit_shared(self, limits: TenantLimits, units: float) -> Admission:
        """``admit`` by the script (``_lock`` held); ``TenantError``: Redis failed."""
        rate = limits.qps if limits.qps is not None else -1.0
        burst = max(1.0, default_burst(limits)) if limits.qps is not None else 1.0
        args = (
            self.gateway_id,
            self.lease_s,
            limits.max_concurrency if limits.max_concurrency is not None else -1,
            limits.daily_units if limits.daily_units is not None else -1,
            units,
            rate,
            burst,
        )
        # Counted under the lock before any renewal can read the count.
        reply = self._run(self._admit, self._keys(limits.name), args)
        verdict = _text(reply[0])
        if verdict == "ok":
            self._mine[limits.name] = self._mine.get(limits.name, 0) + 1
            return Admission(limits.name, units, int(_text(reply[1])))
        raise _refusal(limits, units, verdict, [float(_text(r)) for r in reply[1:]])

    def release(self, admission: Admission) -> None:
        if admission.local:
            with self._lock:
                self._local.release(admission)
            return
        with self._lock:
            held = self._mine.get(admission.tenant, 0)
            if held <= 1:
                self._mine.pop(admission.tenant, None)
            else:
                self._mine[admission.tenant] = held - 1
            self._quietly(
                "release",
                self._release,
                [self._key(admission.tenant, "flight")],
                (self.gateway_id, self.lease_s),
            )

    def settle(self, admission: Admission, units: float) -> None:
        """Charge ``units`` in place of the estimate admitted (to today, Redis's
        UTC day, if the request ends on a later day than it was admitted)."""
        if admission.local:
            with self._lock:
                self._local.settle(admission, units)
            return
        args = (admission.day, admission.units, units)
        keys = [self._key(admission.tenant, kind) for kind in ("units", "held")]
        self._quietly("settle", self._settle, keys, args)

    def seed_usage(self, tenant: str, units_today: float) -> None:
        """Start today's count from the audit log's, unless Redis holds it
        already (Redis lost: this gateway's share of it, in its own count)."""
        if not self.degraded:
            try:
                self._run(self._seed, [self._key(tenant, "units")], (units_today,))
                return
            except TenantError as e:
                with self._lock:
                    self._lose(e)
        with self._lock:
            self._local.seed_usage(tenant, units_today / self._num_gateways)

    def remaining(self, limits: TenantLimits) -> float | None:
        if limits.qps is None:
            return None
        if not self.degraded:
            args = (limits.qps, max(1.0, default_burst(limits)))
            try:
                tokens = self._run(self._tokens, [self._key(limits.name, "bucket")], args)
                return math.floor(float(_text(tokens)))
            except TenantError as e:
                with self._lock:
                    self._lose(e)
        with self._lock:
            return self._local.remaining(gateway_share(limits, self._num_gateways))

    def in_flight(self, tenant: str) -> int:
        """Requests of ``tenant`` in flight on every live gateway (Redis
        lost: on this one, its share's)."""
        if not self.degraded:
            try:
                return int(self._run(self._in_flight, [self._key(tenant, "flight")], ()))
            except TenantError as e:
                with self._lock:
                    self._lose(e)
        with self._lock:
            return self._local.in_flight(tenant)

    # -- leases ------------------------------------------------------------------

    def renew(self) -> None:
        """Beat this gateway's heartbeat (counting the gateways live) and renew
        its leases on the tenants it has requests in flight for; Redis lost:
        admission goes on this gateway's share."""
        try:
            live = self._run(
                self._heartbeat, [self.prefix + "gateways"], (self.gateway_id, self.lease_s)
            )
        except TenantError as e:
            with self._lock:
                self._lose(e)
            return
        self._num_gateways = max(1, int(live))
        with self._lock:
            tenants = list(self._mine)
        for tenant in tenants:
            # Each tenant's count read and written back under the lock that
            # admit and release hold: a count read before a release and
            # written back after it would bring back a slot already given up.
            with self._lock:
                count = self._mine.get(tenant, 0)
                if count > 0:
                    args = (self.gateway_id, self.lease_s, count)
                    self._quietly("renew", self._renew, [self._key(tenant, "flight")], args)

    def _renew_until_closed(self) -> None:
        wait_s = 0.0  # the first heartbeat at once: the count of gateways
        while not self._closing.wait(wait_s):
            if self.degraded:
                self.try_return()
            else:
                self.renew()
            wait_s = self.retry_s if self.degraded else self.lease_s / 3

    def try_return(self) -> bool:
        """Redis lost: if it answers again, share admission there once more,
        adding the units this gateway admitted meanwhile to the tenants' days."""
        try:
            live = self._run(
                self._heartbeat, [self.prefix + "gateways"], (self.gateway_id, self.lease_s)
            )
        except TenantError:
            return False
        with self._lock:
            if self._lost_since is None:
                return True
            usage = self._local.take_units()
            lost_s = time.monotonic() - self._lost_since
            self._lost_since = None
            self._num_gateways = max(1, int(live))
        for tenant, units in usage.items():
            keys = [self._key(tenant, kind) for kind in ("units", "held")]
            self._quietly("return", self._settle, keys, (-1, 0.0, units))
        log.warning("admission store back after %.1f s: limits are shared again", lost_s)
        return True

    def _lose(self, error: TenantError) -> None:
        """Redis failed (``_lock`` held): admit on this gateway's share until it returns."""
        if self._lost_since is not None:
            return
        self._lost_since = time.monotonic()
        log.warning(
            "admission store lost (%s): this gateway admits on its share of each limit"
            " (1/%d) until it returns",
            error.__cause__ or error,
            self._num_gateways,
        )

    # -- internals -----------------------------------------------------------------

    def _key(self, tenant: str, kind: str) -> str:
        return f"{self.prefix}{{{tenant}}}:{kind}"

    def _keys(self, tenant: str) -> list[str]:
        return [self._key(tenant, kind) for kind in ("bucket", "flight", "units", "held")]

    def _run(self, script: Script, keys: list[str], args: tuple[str | int | float, ...]) -> Any:
        import redis

        try:
            return script(keys=keys, args=list(args))
        except redis.RedisError as e:
            raise TenantError(f"admission counters in Redis: {e}") from e

    def _quietly(
        self, what: str, script: Script, keys: list[str], args: tuple[str | int | float, ...]
    ) -> None:
        try:
            self._run(script, keys, args)
        except TenantError:
            log.warning(
                "admission %s failed; its lease or the audit log makes up", what, exc_info=True
            )


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _refusal(
    limits: TenantLimits, units: float, reason: str, figures: list[float]
) -> RateLimitedError:
    """The same refusal the in-process controller makes, from the script's figures."""
    if reason == "concurrency":
        return RateLimitedError(
            f"tenant {limits.name!r} has {figures[0]:g} requests in flight,"
            f" its limit is {limits.max_concurrency}",
            reason="concurrency",
            retry_after_s=1.0,
            limit=limits.max_concurrency,
            remaining=0,
        )
    if reason == "quota":
        used, reset, held = figures
        return quota_refusal(limits, units, used, held, reset)
    wait, reset = figures
    return RateLimitedError(
        f"tenant {limits.name!r} is over its rate of {limits.qps:g} requests/s",
        reason="rate",
        retry_after_s=wait,
        limit=limits.qps,
        remaining=0,
        reset_s=reset,
    )
