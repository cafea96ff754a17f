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
  So while two or more tenants are active on the model (an arrival of each
  within its own pace's window (``TenantActivity``: a few of its typical
  gaps, at least ``latency_horizon_s``), or within the predicted run of the
  batch the backlog would make uncapped, or a backlog of each now: a page of
  OCR every few seconds is active beside requests of eight), a batch's run time is capped at
  ``quantum_s``, and a tenant that arrives waits about one quantum for a
  worker, not one full batch (VTC gets the same from one decoding step).
  The cap is a quantum of work beyond the model's fixed cost a batch, which
  every batch pays (``_shared_cap``). One tenant alone gets full batches.
  ``quantum_s=None`` turns the cap off. The first request of a batch is
  taken whole, so the engine queues a request of more work than a quantum
  as parts of about a quantum each: the cap then holds for large requests
  too, and one tenant alone still gets full batches of its parts.
- ``pop_batch(skip=...)`` fills a batch from the tenants not in ``skip``
  only, in the same order: the batcher's batch for tenants none of whose
  work runs now, started while the model's slots are busy with others'.

Cost: a pick is O(log T) in the backlogged tenants T, from two heaps (the
backlogged tenants by their order key, those whose head has a latency target
by its deadline) whose stale entries are skipped as they surface; only
backlogged tenants are scanned anywhere (``units_ahead``, the oldest head).
A scan of every tenant ever seen at each pick cost 57 us a request with a
hundred tenants and 189 us with a thousand (``benchmarks/fair_queue_bench.py``,
docs/benchmarks.md); now 3-4 us.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator

from tessera.request import QueuedRequest
from tessera.scheduling.activity import TenantActivity
from tessera.scheduling.predictor import LINE_SPREAD, BatchTimePredictor

LATENCY_SHARE_IN_BATCH = 0.5
LATENCY_SHARE_WHILE_ACTIVE = 0.25
# Stale entries the heaps may hold beyond twice their live ones before a rebuild.
REBUILD_SLACK = 64
# Counters kept beyond twice those that mattered at the last prune (``_prune``).
PRUNE_SLACK = 1024


class FairQueue:
    def __init__(
        self,
        predictor: BatchTimePredictor | None = None,
        latency_horizon_s: float = 2.0,
        quantum_s: float | None = None,
    ) -> None:
        self._predictor = predictor
        self._quantum_s = quantum_s
        # The last arrival of the tenant that arrived last, and of the last
        # other one: two tenants are active while the second is recent.
        self._last: tuple[str, float] | None = None
        self._other_last = -math.inf
        self._latency_horizon_s = latency_horizon_s
        self._activity = TenantActivity(latency_horizon_s)
        self._queues: dict[str, deque[QueuedRequest]] = {}  # backlogged tenants only
        self._units: dict[str, float] = {}  # tenant -> units of its backlog
        self._total_units = 0.0  # of every backlog
        self.counters: dict[str, float] = {}
        self._prune_at = PRUNE_SLACK  # counters kept before the next prune (``_prune``)
        self._last_left = 0.0  # the counter of the last tenant served out of its backlog
        self._len = 0
        self._latency_seen: dict[float, float] = {}  # latency target -> last arrival
        # Each backlogged tenant's order key, and a heap of keys (stale ones
        # among them: a key is current while it is the tenant's in ``_keys``).
        self._keys: dict[str, tuple[float, int, float, int]] = {}
        self._order: list[tuple[float, int, float, int, str]] = []
        # Heads with a latency target by deadline (current while still the head).
        self._urgent: list[tuple[float, int, str, QueuedRequest]] = []
        self._seq = itertools.count()  # ties in both heaps go to the earlier entry

    # -- RequestQueue -----------------------------------------------------

    def push(self, request: QueuedRequest) -> None:
        if request.latency_target_s is not None:
            self._latency_seen[request.latency_target_s] = request.arrival
        tenant = request.tenant
        last = self._last
        if last is not None and last[0] != tenant:
            self._other_last = last[1]
        self._last = (tenant, request.arrival)
        self._activity.arrived(tenant, request.arrival)
        queue = self._queues.get(tenant)
        if queue is None:
            self._lift(tenant)
            queue = self._queues[tenant] = deque()
        queue.append(request)
        self._units[tenant] = self._units.get(tenant, 0.0) + request.units
        self._total_units += request.units
        self._len += 1
        self._rekey(tenant, new_head=len(queue) == 1)

    def pop_batch(
        self, max_items: int, max_units: float, now: float, skip: frozenset[str] = frozenset()
    ) -> list[QueuedRequest]:
        batch: list[QueuedRequest] = []
        num_items, units = 0, 0.0
        # The batch's run-time budget: a share of the tightest active target,
        # then of the smallest remaining budget of a latency request in it.
        budget_s = self._active_cap(now, max_units)
        while self._len:
            tenant = self._next_tenant() if not skip else self._next_tenant_but(skip)
            if tenant is None:
                break
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
        for tenant, queue in list(self._queues.items()):
            kept = deque(r for r in queue if not predicate(r))
            if len(kept) != len(queue):
                removed.extend(r for r in queue if predicate(r))
                if kept:
                    self._queues[tenant] = kept
                    self._units[tenant] = sum(r.units for r in kept)
                else:
                    self._empty(tenant)
                self._rekey(tenant)
        self._len -= len(removed)
        self._total_units = sum(self._units.values()) if self._len else 0.0
        self._prune()
        return removed

    def has_other_than(self, tenants: frozenset[str]) -> bool:
        return any(tenant not in tenants for tenant in self._queues)

    def oldest_arrival(self) -> float | None:
        return min((queue[0].arrival for queue in self._queues.values()), default=None)

    def units_ahead(self, request: QueuedRequest, enough: float = 0.0) -> float:
        """Its tenant's backlog, and of each other backlogged tenant's what the
        weights serve before it: each of them up to the counter this tenant
        will have when ``request`` heads its backlog. (Latency-tier requests that arrive
        later go first; they are not foreseen.) The queue's whole work where
        that is fewer than ``enough`` units: the count is a scan of the
        backlogged tenants, and its caller asks only whether the wait fits."""
        if self._total_units < enough:
            return self._total_units
        tenant = request.tenant
        weight = max(request.weight, 1e-9)
        own = self._units.get(tenant, 0.0) if tenant in self._queues else 0.0
        if own:
            start = self.counters[tenant]
        else:  # it would be lifted as it is pushed
            floor = self._floor()
            start = max(self.counters.get(tenant, floor), floor)
        reached = start + own / weight  # its counter when it heads its tenant's queue
        ahead = own
        for other in self._queues:
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

    def _active_cap(self, now: float, max_units: float) -> float | None:
        horizon = self._latency_horizon_s
        targets = [t for t, seen in self._latency_seen.items() if now - seen <= horizon]
        cap = min(targets) * LATENCY_SHARE_WHILE_ACTIVE if targets else None
        backlogged = next(iter(self._queues), None)
        if self._quantum_s is not None and (
            len(self._queues) > 1
            or (backlogged is not None and self._activity.active_other_than(backlogged, now))
            or now - self._other_last <= self._other_horizon(max_units)
        ):
            cap = _min_optional(cap, self._shared_cap(self._quantum_s))
        return cap

    def _shared_cap(self, quantum_s: float) -> float:
        """A batch's longest run while tenants share the model: a quantum of
        work beyond the model's fixed cost a batch (the intercept of a line
        fitted over its measured batches), which any batch pays, a
        newcomer's own too. On a CPU a batch of one sentence takes about a
        quantum, and batches capped at one request held four tenants to half
        their offered rate, each paying the fixed cost for one sentence. A
        cap of several times the fixed cost instead let a flooder's parts
        join a quiet tenant's sentence and doubled its p99. Before a line can
        be fitted (every batch measured within ``LINE_SPREAD`` of one size),
        a batch of up to ``LINE_SPREAD`` + 1 times the smallest measured,
        once: its measurement spans sizes enough for the line."""
        predictor = self._predictor
        if predictor is None:
            return quantum_s
        line = predictor.line()
        if line is not None:
            return quantum_s + line[0]
        smallest = predictor.smallest_units()
        explore = None if smallest is None else predictor.predict((LINE_SPREAD + 1) * smallest)
        return quantum_s if explore is None else max(quantum_s, explore)

    def _other_horizon(self, max_units: float) -> float:
        """How recent another tenant's arrival makes it active: the latency
        horizon, or the predicted run of the batch the backlog would make
        uncapped, if longer (a tenant likely to arrive while it runs)."""
        full_s = None
        if self._predictor is not None and self._total_units > 0:
            full_s = self._predictor.predict(min(max_units, self._total_units))
        return max(self._latency_horizon_s, full_s or 0.0)

    def _floor(self) -> float:
        """The smallest counter among the backlogged tenants, or the last
        one served out of its backlog's when none is (a tenant's lift)."""
        top = self._top()
        return self._last_left if top is None else self.counters[top]

    def _top(self) -> str | None:
        """The backlogged tenant first in order (counter, backlog, head's
        arrival), its heap's stale keys dropped on the way."""
        order, keys = self._order, self._keys
        while order:
            counter, length, arrival, seq, tenant = order[0]
            if keys.get(tenant) == (counter, length, arrival, seq):
                return tenant
            heapq.heappop(order)
        return None

    def _rekey(self, tenant: str, new_head: bool = True) -> None:
        """File ``tenant`` under its order key now (its counter, backlog or
        head changed), and a ``new_head`` by deadline if it has a latency
        target. The heaps are rebuilt once mostly stale: a tenant served out
        with a high counter leaves its keys deep in the order's heap."""
        queue = self._queues.get(tenant)
        if queue is None:
            self._keys.pop(tenant, None)
        else:
            head = queue[0]
            seq = next(self._seq)
            key = (self.counters[tenant], len(queue), head.arrival, seq)
            self._keys[tenant] = key
            heapq.heappush(self._order, (*key, tenant))
            if new_head and head.latency_target_s is not None:
                heapq.heappush(self._urgent, (_deadline(head), seq, tenant, head))
        if len(self._order) > 2 * len(self._keys) + REBUILD_SLACK:
            self._order = [(*key, t) for t, key in self._keys.items()]
            heapq.heapify(self._order)
        if len(self._urgent) > 2 * len(self._queues) + REBUILD_SLACK:
            self._urgent = [
                entry
                for entry in self._urgent
                if (q := self._queues.get(entry[2])) is not None and q[0] is entry[3]
            ]
            heapq.heapify(self._urgent)

    def _lift(self, tenant: str) -> None:
        floor = self._floor()
        self.counters[tenant] = max(self.counters.get(tenant, floor), floor)

    def _next_tenant(self) -> str:
        # Heads with a latency target first, earliest deadline first (stale
        # entries: no longer a head, or their tenant's backlog changed).
        urgent, queues = self._urgent, self._queues
        while urgent:
            _, _, tenant, head = urgent[0]
            queue = queues.get(tenant)
            if queue is not None and queue[0] is head:
                return tenant
            heapq.heappop(urgent)
        # Ties (a tenant just lifted to the smallest counter) go to the lighter
        # backlog: a newcomer with one request runs before a flooder's next one.
        top = self._top()
        assert top is not None  # called only while requests are queued
        return top

    def _next_tenant_but(self, skip: frozenset[str]) -> str | None:
        """``_next_tenant`` among the backlogged tenants not in ``skip`` (a
        scan of them: asked only for a batch that steps past running ones)."""
        others = [t for t in self._queues if t not in skip]
        urgent = [t for t in others if self._queues[t][0].latency_target_s is not None]
        if urgent:
            return min(urgent, key=lambda t: _deadline(self._queues[t][0]))
        return min(others, key=self._keys.__getitem__, default=None)

    def _take(self, tenant: str) -> None:
        queue = self._queues[tenant]
        request = queue.popleft()
        self._len -= 1
        self._total_units = self._total_units - request.units if self._len else 0.0
        self.counters[tenant] += request.units / max(request.weight, 1e-9)
        if queue:
            self._units[tenant] -= request.units
        else:
            self._empty(tenant)
            self._last_left = self.counters[tenant]
        self._rekey(tenant)
        if not queue:
            self._prune()

    def _empty(self, tenant: str) -> None:
        """``tenant``'s backlog is served out (or dropped): it is no longer backlogged."""
        del self._queues[tenant]
        del self._units[tenant]

    def _prune(self) -> None:
        """Past ``_prune_at`` counters, drop those of tenants not backlogged
        and not above the floor (with every tenant filed under its key now):
        the floor never falls (a lift is to it at least, and serving only
        raises counters), so a returning tenant's lift gives it the floor with
        or without its old counter, and a server that has met many tenants
        does not keep one for each."""
        if len(self.counters) <= self._prune_at:
            return
        floor, queues = self._floor(), self._queues
        self.counters = {t: c for t, c in self.counters.items() if t in queues or c > floor}
        self._prune_at = 2 * len(self.counters) + PRUNE_SLACK

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
