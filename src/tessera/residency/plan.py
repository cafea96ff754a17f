"""How a batch is run within the budget: whole, or in parts that each fit.

Invariant: a part's activation reservation (``ActivationStats.reserve_bytes``
of its peak units) fits the room it should take (``activation_room``: while
every model's weights fit, the pool beside them all), unless the part is a
single request, which is never split: it reserves its estimate, evicting for
it where it must, up to the most room the model could ever have beside its own
weights; over that, it reserves that most, runs, and its measured peak is the
next estimate's (what refuses a request for good, 413, is what batches of its
size were measured to need, ``ActivationStats.proven_bytes``, not an
estimate). Reason: cut to the pool instead, a large request would wait for
every other batch to end rather than evict an idle model. Parts keep the
batch's order, so a request is answered by exactly one part.

A part's *peak units* are the work units whose activations it holds at once:
all of them, except for items its runtime runs alone, one after another
(``QueuedRequest.alone_units``): of those only the largest counts, or the
items run together where those are more. Reason: four OCR pages run one at a
time peak at one page's activations; reserving four pages' would evict models
for bytes the batch never uses.
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
    peak_units: float


def items_peak_units(units: float, alone_units: Sequence[float], apart_units: float) -> float:
    """The peak units of items of ``units`` in all, of which ``apart_units``
    run apart, each alone, at the peak units of ``alone_units``."""
    return max(units - apart_units, max(alone_units, default=0.0))


def peak_units(requests: Sequence[QueuedRequest]) -> float:
    """The work units whose activations ``requests`` hold at once, run as one batch."""
    return items_peak_units(
        sum(r.units for r in requests),
        [u for r in requests for u in r.alone_units],
        sum(r.apart_units for r in requests),
    )


def split_to_fit(
    requests: Sequence[QueuedRequest],
    reserve_bytes: Callable[[float], int],
    room_bytes: int,
    most_bytes: int | None = None,
) -> list[BatchPart]:
    """Halve ``requests`` until each part's reservation fits ``room_bytes``
    (a single request's cut to ``most_bytes``, where given)."""
    peak = peak_units(requests)
    need = reserve_bytes(peak)
    if len(requests) > 1 and need > room_bytes:
        half = len(requests) // 2
        return split_to_fit(requests[:half], reserve_bytes, room_bytes, most_bytes) + split_to_fit(
            requests[half:], reserve_bytes, room_bytes, most_bytes
        )
    if most_bytes is not None:
        need = min(need, max(0, most_bytes))
    return [BatchPart(tuple(requests), sum(r.units for r in requests), need, peak)]
