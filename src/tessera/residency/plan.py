"""How a batch is run within the budget: whole, or in parts that each fit.

Invariant: a part's activation reservation (measured peak per unit x its
units) fits the room the model could have beside its own weights, unless the
part is a single request, which is never split (the reservation then decides
whether it waits for room or fails as too large). Parts keep the batch's
order, so a request is answered by exactly one part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tessera.request import QueuedRequest


@dataclass(frozen=True, slots=True)
class BatchPart:
    """Requests run together, and the activation bytes reserved for them."""

    requests: tuple[QueuedRequest, ...]
    units: float
    activation_bytes: int


def split_to_fit(
    requests: Sequence[QueuedRequest],
    reserve_bytes: Callable[[float], int],
    room_bytes: int,
) -> list[BatchPart]:
    """Halve ``requests`` until each part's reservation fits ``room_bytes``."""
    units = sum(r.units for r in requests)
    need = reserve_bytes(units)
    if len(requests) > 1 and need > room_bytes:
        half = len(requests) // 2
        return split_to_fit(requests[:half], reserve_bytes, room_bytes) + split_to_fit(
            requests[half:], reserve_bytes, room_bytes
        )
    return [BatchPart(tuple(requests), units, need)]
