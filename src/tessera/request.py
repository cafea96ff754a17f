"""A request waiting for a model, as the queues see it: a small, low-level type.

``batching/`` and ``scheduling/`` both import it; neither writes to it. What
happens to a request (when its batch formed, how long it ran, its outputs)
travels back in the ``RequestResult`` its future is resolved with, not in the
request itself.

Two things cross from the caller to the work and back, and only the engine
writes them:

- ``stop``, a thread-safe flag set once the caller has gone (hung up, or its
  deadline passed). The engine runs a batch with its items' flags
  (``with_stops``) and a runtime that works in steps (a generation) reads them
  with ``item_stops`` and stops those items at the next step.
- ``charge``, the work units the request is finally charged, settled once
  when its work ends (admission charged an estimate at arrival): what ran
  for a request that ran, answered or not; nothing for one that never ran or
  whose batch failed. The quota and the audit row both take this figure.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


class StopFlag:
    """A flag set once and read from any thread: ``threading.Event`` without
    its lock and condition (nothing waits on it, and one is made for every
    request; an attribute's write is atomic under the interpreter lock)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What a caller gets back: one output per item, and how its batch went."""

    outputs: list[Any]
    queued_s: float  # from arrival to the forming of its batch
    run_s: float  # the batch's run time
    batch_size: int  # items in the batch it ran in


class Charge:
    """The units a request is charged: settled once, on the event loop (the
    first ``settle`` wins; listeners hear it once, at once if already settled).
    ``device_s``: its share of the run time of the batches it ran in
    (``tessera.costs``), added before it settles."""

    __slots__ = ("_listeners", "device_s", "started", "units")

    def __init__(self) -> None:
        self.started = False  # its batch began to run
        self.units: float | None = None
        self.device_s = 0.0
        self._listeners: list[Callable[[float], None]] = []

    @property
    def settled(self) -> bool:
        return self.units is not None

    def settle(self, units: float) -> None:
        if self.units is not None:
            return
        self.units = units
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener(units)

    def when_settled(self, listener: Callable[[float], None]) -> None:
        if self.units is not None:
            listener(self.units)
        else:
            self._listeners.append(listener)


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
    stop: StopFlag = field(default_factory=StopFlag)  # see the module notes
    charge: Charge = field(default_factory=Charge)
    request_id: str | None = None  # the gateway's x-request-id, for log lines
    # Of its items that its runtime runs apart, one after another, each alone
    # (``runtimes.base.ItemsApart``): their work units in all, and each one's
    # peak units (a spoken text's longest sentence); the rest of ``units`` run together.
    apart_units: float = 0.0
    alone_units: tuple[float, ...] = ()
    # A part of a request queued in parts (more work than one fair quantum, or
    # more items than a batch): throughput work, which the executor runs as
    # long work, so that short batches step past it.
    bulk: bool = False
    # The served version it was queued for (a key): a batch of an encoder
    # group holds several models' requests (``engine/groups.py``).
    model: str = ""

    @property
    def gone(self) -> bool:
        return self.future.done()

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def fits(self, num_items: int, units: float, max_items: int, max_units: float) -> bool:
        """Whether it joins a batch of ``num_items`` items and ``units`` work
        units within those limits (a queue's ``pop_batch`` takes the first
        request of a batch even when it does not)."""
        return num_items + len(self.items) <= max_items and units + self.units <= max_units


@dataclass(frozen=True, slots=True)
class Batch:
    """Requests the batcher took together, and when it took them."""

    requests: list[QueuedRequest]
    formed_at: float

    @property
    def num_items(self) -> int:
        return sum(len(r.items) for r in self.requests)


# The stop flags of the batch the current thread runs, one per item.
_STOPS: contextvars.ContextVar[tuple[StopFlag, ...]] = contextvars.ContextVar(
    "tessera_item_stops", default=()
)
# The tenants of the batch the current thread runs, one per item.
_TENANTS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "tessera_item_tenants", default=()
)


def with_stops(
    fn: Callable[[Sequence[Any]], list[Any]], requests: Sequence[QueuedRequest]
) -> Callable[[Sequence[Any]], list[Any]]:
    """``fn`` (a model's ``run``) to run the items of ``requests`` with their
    stop flags and tenants in view of ``item_stops`` and ``item_tenants``; the
    requests count as started now."""
    stops = tuple(r.stop for r in requests for _ in r.items)
    tenants = tuple(r.tenant for r in requests for _ in r.items)
    for request in requests:
        request.charge.started = True

    def run(items: Sequence[Any]) -> list[Any]:
        token = _STOPS.set(stops)
        tenants_token = _TENANTS.set(tenants)
        try:
            return fn(items)
        finally:
            _TENANTS.reset(tenants_token)
            _STOPS.reset(token)

    return run


def item_stops(num_items: int) -> tuple[StopFlag, ...]:
    """The stop flags of the ``num_items`` items this thread runs now; flags
    never set when it runs none (a warm-up, a test calling a model directly)."""
    stops = _STOPS.get()
    if len(stops) == num_items:
        return stops
    return tuple(StopFlag() for _ in range(num_items))


def item_tenants(num_items: int) -> tuple[str, ...]:
    """The tenant of each of the ``num_items`` items this thread runs now
    (a model that runs its batches on another machine's engine passes them
    on, so that engine attributes its memory to them: ``tessera.costs``);
    ``default`` for each when it runs none."""
    tenants = _TENANTS.get()
    if len(tenants) == num_items:
        return tenants
    return ("default",) * num_items
