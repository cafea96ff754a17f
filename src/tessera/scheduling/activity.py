"""Which tenants are active on a model: each one judged by its own pace.

A tenant is active from its arrival until ``ACTIVE_GAPS`` of its typical
gaps between arrivals have passed (the mean gap over its last
``PACE_ARRIVALS`` arrivals), and for at least ``horizon_s``; never more than
``MAX_ACTIVE_S``. The fair queue caps its batches at a quantum while two
tenants are active, so a tenant that returns finds a part of another's work
running, not a whole batch of it.

Why its own pace: with one fixed horizon, a tenant that sends a page every two
seconds (a Poisson stream) came back after the horizon about a third of the
time and found the other tenant's full batch of eight pages running (2 s on
two cores); five mean gaps cover all but e^-5 (under 1%) of a Poisson
stream's gaps. The mean of several gaps, not a moving average weighted to
the latest: a Poisson stream's gaps come in bursts and lulls, and the latest
few say little of the next. A tenant's arrivals are kept past the end of its
activity (for ``MAX_ACTIVE_S`` after its last), so one back after a lull is
judged with the lull in its pace, not afresh from two close arrivals.

Invariants: ``num_active(now)`` counts the tenants whose activity reaches
``now``; parts of one request share its arrival and are one arrival here;
the tracker holds the arrivals of tenants seen in the last ``MAX_ACTIVE_S``
and, between prunes, at most about twice as many.
"""

from __future__ import annotations

import heapq
from collections import deque

# A tenant stays active this many of its typical gaps between arrivals.
ACTIVE_GAPS = 5.0
# The arrivals a tenant's pace (its mean gap) is measured over.
PACE_ARRIVALS = 8
# The longest a tenant stays active after an arrival, whatever its pace.
MAX_ACTIVE_S = 60.0
# Entries kept beyond twice the live ones before a rebuild or a prune.
SLACK = 64


class TenantActivity:
    def __init__(self, horizon_s: float) -> None:
        self._horizon_s = horizon_s
        # tenant -> its latest arrivals, oldest first
        self._arrivals: dict[str, deque[float]] = {}
        self._prune_at = SLACK  # tenants' arrivals kept before the next prune
        self._until: dict[str, float] = {}  # active tenant -> the end of its activity
        # (until, tenant): an entry is current while it is the tenant's ``_until``.
        self._ends: list[tuple[float, str]] = []

    def arrived(self, tenant: str, at: float) -> None:
        arrivals = self._arrivals.get(tenant)
        if arrivals is None:
            arrivals = self._arrivals[tenant] = deque(maxlen=PACE_ARRIVALS)
        elif at <= arrivals[-1]:
            return  # another part of the same request, or a clock that did not move
        arrivals.append(at)
        gap = (at - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else 0.0
        until = at + max(self._horizon_s, min(MAX_ACTIVE_S, ACTIVE_GAPS * gap))
        if until > self._until.get(tenant, -1.0):
            self._until[tenant] = until
            heapq.heappush(self._ends, (until, tenant))
            if len(self._ends) > 2 * len(self._until) + SLACK:
                self._ends = [(end, t) for t, end in self._until.items()]
                heapq.heapify(self._ends)
        if len(self._arrivals) > self._prune_at:
            self._prune(at)

    def num_active(self, now: float) -> int:
        ends = self._ends
        while ends and ends[0][0] < now:
            until, tenant = heapq.heappop(ends)
            if self._until.get(tenant) == until:
                del self._until[tenant]
        return len(self._until)

    def active_other_than(self, tenant: str, now: float) -> bool:
        """Whether a tenant other than ``tenant`` is active at ``now``."""
        count = self.num_active(now)
        return count > 1 or (count == 1 and tenant not in self._until)

    def _prune(self, now: float) -> None:
        """Forget the arrivals of tenants not seen in the last ``MAX_ACTIVE_S``."""
        since = now - MAX_ACTIVE_S
        self._arrivals = {t: a for t, a in self._arrivals.items() if a[-1] >= since}
        self._prune_at = 2 * len(self._arrivals) + SLACK
