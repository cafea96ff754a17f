"""Activation room: how many bytes a batch of a model may reserve, and what fits.

Invariants:

- While every registered model's weights fit the budget, a batch reserves at
  most the pool beside all of them (``activation_room``): a batch that fits
  it never needs an eviction, whichever models load meanwhile. Otherwise, at
  most the budget less the model's own weights. Always within the model's
  cap (``max_bytes``).
- A model whose weights alone are over its cap or the budget is refused for
  good (``ModelTooLargeError``, 503); weights that fit but not with a batch's
  activations beside them refuse that batch (``RequestTooLargeError``, 413).
- Only what batches of no more units were measured to need refuses a request
  for good (``ActivationStats.proven_bytes``), never an estimate.
"""

from __future__ import annotations

from tessera.errors import ModelTooLargeError, RequestTooLargeError
from tessera.footprint import Footprint
from tessera.repository.spec import ModelSpec
from tessera.request import QueuedRequest
from tessera.residency.activation import ActivationBook
from tessera.residency.catalogue import Catalogue
from tessera.residency.plan import BatchPart, split_to_fit


class ActivationRoom:
    """Room for batches within ``budget_bytes`` beside the catalogue's weights."""

    def __init__(
        self, budget_bytes: int, catalogue: Catalogue, activations: ActivationBook
    ) -> None:
        self._budget_bytes = budget_bytes
        self._catalogue = catalogue
        self._activations = activations

    def most(self, spec: ModelSpec) -> int:
        """The most activation bytes a batch of ``spec`` could ever have: the
        budget, and its cap, less its own weights."""
        expected = self._catalogue.expected(spec)
        room = self._budget_bytes - expected.total_bytes
        if spec.max_bytes is not None:
            room = min(room, spec.max_bytes - expected.total_bytes)
        return room

    def for_batch(self, spec: ModelSpec) -> int:
        """The most activation bytes a batch of ``spec`` should reserve (see
        the module notes)."""
        return self._pool_within(self.most(spec))

    def _pool_within(self, most: int) -> int:
        """``most``, or the pool beside every model's weights where those all
        fit and it is less."""
        total = self._catalogue.total_bytes()
        if total is not None and total <= self._budget_bytes:
            return min(self._budget_bytes - total, most)
        return most

    def plan_batch(self, spec: ModelSpec, requests: list[QueuedRequest]) -> list[BatchPart]:
        """The parts a batch runs in: whole when its measured activation need
        fits ``for_batch``, else halves that each fit (a single request's
        need cut to ``most``)."""
        stats = self._activations.of(spec.key)
        most = self.most(spec)
        return split_to_fit(requests, stats.reserve_bytes, self._pool_within(most), most)

    def check_fits(self, spec: ModelSpec, footprint: Footprint, activation_bytes: int) -> None:
        """``ModelTooLargeError`` when the weights alone are over the model's
        cap or the budget; ``RequestTooLargeError`` when they fit but not with
        ``activation_bytes`` beside them."""
        weights = footprint.total_bytes
        for limit, what in (
            (spec.max_bytes, "its cap"),
            (self._budget_bytes, "the whole budget"),
        ):
            if limit is None:
                continue
            if weights > limit:
                raise ModelTooLargeError(
                    spec.key, f"needs {weights} bytes, over {what} of {limit} bytes"
                )
            if weights + activation_bytes > limit:
                raise RequestTooLargeError(spec.key, activation_bytes, weights, limit, what)

    def raise_if_never_fits(self, spec: ModelSpec, units: float) -> None:
        """``RequestTooLargeError`` for a request whose own batch, of ``units``
        peak units, could never fit beside the model's measured weights."""
        measured = self._catalogue.measured(spec.key)
        if measured is not None:
            self.check_fits(spec, measured, self._activations.of(spec.key).proven_bytes(units))
