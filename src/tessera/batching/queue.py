"""The queue a model's batcher draws from.

A queue strategy is a Protocol, an enum of names, and a factory. FIFO is the
baseline; the fair tenant scheduler (``scheduling/``) implements the same
Protocol.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from tessera.request import QueuedRequest

if TYPE_CHECKING:
    from tessera.scheduling.predictor import BatchTimePredictor


class RequestQueue(Protocol):
    def push(self, request: QueuedRequest) -> None: ...

    def pop_batch(
        self, max_items: int, max_units: float, now: float, skip: frozenset[str] = frozenset()
    ) -> list[QueuedRequest]:
        """Remove and return whole requests for one batch within the limits
        (the first request is always taken, even alone over a limit), none of
        them of a tenant in ``skip``."""
        ...

    def has_other_than(self, tenants: frozenset[str]) -> bool:
        """Whether a request of a tenant not in ``tenants`` waits."""
        ...

    def remove_if(self, predicate: Callable[[QueuedRequest], bool]) -> list[QueuedRequest]: ...

    def oldest_arrival(self) -> float | None: ...

    def units_ahead(self, request: QueuedRequest, enough: float = 0.0) -> float:
        """The work units this queue would serve before ``request`` if it
        were pushed now (an estimate: arrivals after it may go first); where
        all the units queued are fewer than ``enough`` (by default none are),
        their total may stand for it (a bound the caller only compares with
        ``enough``)."""
        ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[QueuedRequest]: ...


class QueuePolicyName(StrEnum):
    FIFO = "fifo"
    FAIR = "fair"


class FifoQueue:
    """First come, first served."""

    def __init__(self) -> None:
        self._items: deque[QueuedRequest] = deque()
        self._units = 0.0

    def push(self, request: QueuedRequest) -> None:
        self._items.append(request)
        self._units += request.units

    def pop_batch(
        self, max_items: int, max_units: float, now: float, skip: frozenset[str] = frozenset()
    ) -> list[QueuedRequest]:
        if skip:
            return self._pop_skipping(max_items, max_units, skip)
        batch: list[QueuedRequest] = []
        num_items, units = 0, 0.0
        while self._items:
            head = self._items[0]
            if batch and not head.fits(num_items, units, max_items, max_units):
                break
            batch.append(self._items.popleft())
            num_items += len(head.items)
            units += head.units
        self._units = self._units - units if self._items else 0.0
        return batch

    def _pop_skipping(
        self, max_items: int, max_units: float, skip: frozenset[str]
    ) -> list[QueuedRequest]:
        """``pop_batch`` over the requests of tenants not in ``skip``, in
        arrival order (a scan of the queue: the batcher asks it only while
        every slot of the model is busy)."""
        batch: list[QueuedRequest] = []
        num_items, units = 0, 0.0
        for request in self._items:
            if request.tenant in skip:
                continue
            if batch and not request.fits(num_items, units, max_items, max_units):
                break
            batch.append(request)
            num_items += len(request.items)
            units += request.units
        if batch:
            taken = set(map(id, batch))
            self._items = deque(r for r in self._items if id(r) not in taken)
            self._units = sum(r.units for r in self._items)
        return batch

    def has_other_than(self, tenants: frozenset[str]) -> bool:
        return any(r.tenant not in tenants for r in self._items)

    def remove_if(self, predicate: Callable[[QueuedRequest], bool]) -> list[QueuedRequest]:
        removed = [r for r in self._items if predicate(r)]
        if removed:
            self._items = deque(r for r in self._items if not predicate(r))
            self._units = sum(r.units for r in self._items)
        return removed

    def oldest_arrival(self) -> float | None:
        return self._items[0].arrival if self._items else None

    def units_ahead(self, request: QueuedRequest, enough: float = 0.0) -> float:
        return self._units

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[QueuedRequest]:
        return iter(self._items)


def make_queue(
    name: QueuePolicyName | str,
    predictor: BatchTimePredictor | None = None,
    quantum_s: float | None = None,
) -> RequestQueue:
    """A queue by policy name; ``fair`` uses ``predictor`` to size batches for
    latency tiers and for its ``quantum_s`` when tenants share the model."""
    match QueuePolicyName(name):
        case QueuePolicyName.FIFO:
            return FifoQueue()
        case QueuePolicyName.FAIR:
            from tessera.scheduling.fair import FairQueue

            return FairQueue(predictor, quantum_s=quantum_s)
