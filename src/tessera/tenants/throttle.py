"""Throttling of failed authentication, per client address.

Invariants:

- An address is throttled while it has ``max_failures`` failed attempts within
  the last ``window_s`` seconds; a throttled attempt that fails again gets
  429 with ``retry_after_s`` (until its oldest failure in the window leaves it)
  and is not counted (a client hammering a 429 does not lengthen its own wait).
- A right key passes even from a throttled address. Keys carry 256 random
  bits, so guessing is hopeless whether or not it is slowed; refusing right
  keys too would let anyone with a bad key lock out every tenant behind the
  same address (a NAT, a proxy). What the throttle bounds is the cost and the
  noise of a flood of bad keys.
- Memory is bounded: at most ``max_failures`` times per address, and at most
  ``max_addresses`` addresses; past that the address whose last failure is
  oldest is forgotten (an attacker rotating addresses pushes out its own
  oldest ones first, and each new address gets ``max_failures`` attempts).

Plain Python over a ``Clock``: the tests drive it with a fake one.
"""

from __future__ import annotations

import collections
from collections import OrderedDict

from tessera.clock import Clock

DEFAULT_MAX_FAILURES = 20
DEFAULT_WINDOW_S = 60.0
DEFAULT_MAX_ADDRESSES = 10_000


class AuthThrottle:
    """Failed authentications per client address, in a sliding window."""

    def __init__(
        self,
        clock: Clock,
        *,
        max_failures: int = DEFAULT_MAX_FAILURES,
        window_s: float = DEFAULT_WINDOW_S,
        max_addresses: int = DEFAULT_MAX_ADDRESSES,
    ) -> None:
        if max_failures < 1 or window_s <= 0 or max_addresses < 1:
            raise ValueError("max_failures, window_s and max_addresses must be positive")
        self._clock = clock
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_addresses = max_addresses
        # Address -> times of its latest failures (oldest first); the dict's order
        # is that of the latest failure, oldest address first.
        self._failures: OrderedDict[str, collections.deque[float]] = OrderedDict()

    def retry_after_s(self, address: str) -> float | None:
        """Seconds until ``address`` may fail again unthrottled; None if it may now."""
        times = self._failures.get(address)
        if times is None or len(times) < self.max_failures:
            return None
        wait_s = times[0] + self.window_s - self._clock.now()
        return wait_s if wait_s > 0 else None

    def failed(self, address: str) -> float | None:
        """Count a failed attempt from ``address``; the seconds it must wait if it
        is throttled now (this attempt then gets 429), else None."""
        wait_s = self.retry_after_s(address)
        if wait_s is not None:
            return wait_s
        times = self._failures.pop(address, None)
        if times is None:
            times = collections.deque(maxlen=self.max_failures)
            while len(self._failures) >= self.max_addresses:
                self._failures.popitem(last=False)
        times.append(self._clock.now())
        self._failures[address] = times  # now the most recent
        return None

    def __len__(self) -> int:
        """Addresses remembered."""
        return len(self._failures)
