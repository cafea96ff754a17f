"""Weighted fair queueing across tenants, with latency tiers (VTC-style).

Invariants:

- Each tenant has a virtual counter: the work units it was served divided by
  its weight. A batch is filled by repeatedly taking the head request of the
  backlogged tenant with the smallest counter, so backlogged tenants are
  served in proportion to their weights, in their tasks' own units.
- A tenant that becomes backlogged is lifted to the smallest counter among
  the other backlogged tenants, or, when none is, to the counter of the last
  tenant whose backlog was served out: time spent idle banks no credit (even
  across a moment when the queue was empty, as it is after most batches),
  and a returning tenant is served next without starving the others (the
  counter lift of VTC, Sheng et al. 2024).
- Requests of a latency tier (``latency_target_s`` set) go before all others,
  earliest deadline first. While any of them is in the batch, the batch stops
  growing once its predicted run time (``BatchTimePredictor``) would exceed
  half the smallest remaining latency budget among them (the other half is
  margin for the prediction, the HTTP round trip and the other worker).
- A latency-tier request that arrives must first wait for a running batch to
  end. So while such a tier is active (one of its requests arrived in the last
  ``latency_horizon_s``), every batch is capped to a quarter of its target; a
  single request is still taken whole. Once the tier has been quiet for the
  horizon, batches grow to their full size again (Clockwork's and Nexus's idea:
  size batches from measured execution times to meet the tightest target).
- Batches are the quantum of service: a request cannot join one that runs.
  So while two or more tenants are active on the model (an arrival in the last
  ``latency_horizon_s``), a batch's predicted run time is capped at
  ``quantum_s``, and a tenant that arrives waits about one quantum for a
  worker, not one full batch (VTC gets the same from one decoding step). One
  tenant alone gets full batches. ``quantum_s=None`` turns the cap off.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from tessera.request import QueuedRequest
from tessera.scheduling.predictor import BatchTimePredictor

LATENCY_SHARE_IN_BATCH = 0.5
LATENCY_SHARE_WHILE_ACTIVE = 0.25


class FairQueue:
    def __init__(
        self,
        predictor: BatchTimePredictor | None = None,
        latency_horizon_s: float = 2.0,
        quantum_s: float | None = None,
    ) -> None:
        self._predictor = predictor
        self._quantum_s = quantum_s
        self._tenant_seen: dict[str, float] = {}  # tenant -> last arrival
        self._latency_horizon_s = latency_horizon_s
        self._queues: dict[str, deque[QueuedRequest]] = {}
        self._units: dict[str, float] = {}  # tenant -> units of its backlog
        self.counters: dict[str, float] = {}
        self._last_left = 0.0  # the counter of the last tenant served out of its backlog
        self._len = 0
        self._latency_seen: dict[float, float] = {}  # latency target -> last arrival

    # -- RequestQueue -----------------------------------------------------

    def push(self, request: QueuedRequest) -> None:
        if request.latency_target_s is not None:
            self._latency_seen[request.latency_target_s] = request.arrival
        self._tenant_seen[request.tenant] = request.arrival
        queue = self._queues.get(request.tenant)
        if not queue:
            self._lift(request.tenant)
            queue = self._queues.setdefault(request.tenant, deque())
        queue.append(request)
        self._units[request.tenant] = self._units.get(request.tenant, 0.0) + request.units
        self._len += 1

    def pop_batch(self, max_items: int, max_units: float, now: float) -> list[QueuedRequest]:
        batch: list[QueuedRequest] = []
        num_items, units = 0, 0.0
        # The batch's run-time budget: a share of the tightest active target,
        # then of the smallest remaining budget of a latency request in it.
        budget_s = self._active_cap(now)
        while self._len:
            tenant = self._next_tenant()
            head = self._queues[tenant][0]
            if batch and not head.fits(num_items, units, max_items, max_units):
                break
            head_budget = _remaining(head, now)
            if head_budget is not None:
                head_budget *= LATENCY_SHARE_IN_BATCH
            new_budget = _min_optional(budget_s, head_budget)
            if (
                batch
                and new_budget is not None
                and not self._fits_budget(units + head.units, new_budget)
            ):
                break
            self._take(tenant)
            batch.append(head)
            num_items += len(head.items)
            units += head.units
            budget_s = new_budget
        return batch

    def remove_if(self, predicate: Callable[[QueuedRequest], bool]) -> list[QueuedRequest]:
        removed: list[QueuedRequest] = []
        for tenant, queue in self._queues.items():
            kept = deque(r for r in queue if not predicate(r))
            if len(kept) != len(queue):
                removed.extend(r for r in queue if predicate(r))
                self._queues[tenant] = kept
                self._units[tenant] = sum(r.units for r in kept)
        self._len -= len(removed)
        return removed

    def oldest_arrival(self) -> float | None:
        heads = [queue[0].arrival for queue in self._queues.values() if queue]
        return min(heads, default=None)

    def units_ahead(self, request: QueuedRequest) -> float:
        """Its tenant's backlog, and of each other backlogged tenant's what the
        weights serve before it: each of them up to the counter this tenant
        will have when ``request`` heads its backlog. (Latency-tier requests that arrive
        later go first; they are not foreseen.)"""
        tenant = request.tenant
        weight = max(request.weight, 1e-9)
        own = self._units.get(tenant, 0.0) if self._queues.get(tenant) else 0.0
        if own:
            start = self.counters[tenant]
        else:  # it would be lifted as it is pushed
            others = [self.counters[t] for t in self._backlogged() if t != tenant]
            floor = min(others, default=self._last_left)
            start = max(self.counters.get(tenant, floor), floor)
        reached = start + own / weight  # its counter when it heads its tenant's queue
        ahead = own
        for other in self._backlogged():
            if other != tenant:
                share = max(0.0, reached - self.counters[other]) * self._queues[other][0].weight
                ahead += min(self._units[other], share)
        return ahead

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[QueuedRequest]:
        for queue in self._queues.values():
            yield from queue

    # -- internals --------------------------------------------------------

    def _active_cap(self, now: float) -> float | None:
        horizon = self._latency_horizon_s
        targets = [t for t, seen in self._latency_seen.items() if now - seen <= horizon]
        cap = min(targets) * LATENCY_SHARE_WHILE_ACTIVE if targets else None
        if self._quantum_s is not None:
            active = sum(1 for seen in self._tenant_seen.values() if now - seen <= horizon)
            if active >= 2:
                cap = _min_optional(cap, self._quantum_s)
        return cap

    def _backlogged(self) -> list[str]:
        return [tenant for tenant, queue in self._queues.items() if queue]

    def _lift(self, tenant: str) -> None:
        others = [self.counters[t] for t in self._backlogged() if t != tenant]
        floor = min(others, default=self._last_left)
        self.counters[tenant] = max(self.counters.get(tenant, floor), floor)

    def _next_tenant(self) -> str:
        backlogged = self._backlogged()
        urgent = [t for t in backlogged if self._queues[t][0].latency_target_s is not None]
        if urgent:
            return min(urgent, key=lambda t: _deadline(self._queues[t][0]))
        # Ties (a tenant just lifted to the smallest counter) go to the lighter
        # backlog: a newcomer with one request runs before a flooder's next one.
        return min(
            backlogged,
            key=lambda t: (self.counters[t], len(self._queues[t]), self._queues[t][0].arrival),
        )

    def _take(self, tenant: str) -> None:
        request = self._queues[tenant].popleft()
        self._units[tenant] = self._units[tenant] - request.units if self._queues[tenant] else 0.0
        self._len -= 1
        self.counters[tenant] += request.units / max(request.weight, 1e-9)
        if not self._queues[tenant]:
            self._last_left = self.counters[tenant]

    def _fits_budget(self, units: float, budget_s: float) -> bool:
        if self._predictor is None:
            return True
        predicted = self._predictor.predict(units)
        return predicted is None or predicted <= budget_s


def _deadline(request: QueuedRequest) -> float:
    assert request.latency_target_s is not None
    return request.arrival + request.latency_target_s


def _remaining(request: QueuedRequest, now: float) -> float | None:
    if request.latency_target_s is None:
        return None
    return _deadline(request) - now


def _min_optional(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)
