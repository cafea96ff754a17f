"""The catalogue: every model the engine may be asked for, and the bytes each holds.

Invariants:

- A model's weights are measured at its first load and that figure is kept
  until the model is forgotten: the host does not measure reloads (that
  would hold running batches back).
- ``expected`` is the measured figure where there is one, else the host's
  estimate from the model's files; an estimate that fails counts nothing,
  so that the model's own load fails (its state), not every reader of the
  catalogue.
- ``total_bytes`` is the weights of every registered model together, a
  shared component once; it is recomputed after any registration,
  measurement or forgetting, never read stale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tessera.footprint import Footprint
from tessera.repository.spec import ModelSpec

log = logging.getLogger(__name__)

NO_ESTIMATE = Footprint(0)


class Catalogue:
    """Registered models, their measured footprints and their total."""

    def __init__(self, estimate: Callable[[ModelSpec], Footprint]) -> None:
        self._estimate = estimate
        self._specs: dict[str, ModelSpec] = {}
        self._measured: dict[str, Footprint] = {}
        self._total: int | None = None  # None: not computed since the last change

    def register(self, spec: ModelSpec) -> None:
        self._specs[spec.key] = spec
        self._total = None

    def forget(self, name: str) -> None:
        """``name`` leaves the catalogue, and its measurement with it."""
        self._specs.pop(name, None)
        self._measured.pop(name, None)
        self._total = None

    def measured(self, name: str) -> Footprint | None:
        return self._measured.get(name)

    def measure(self, name: str, footprint: Footprint) -> Footprint:
        """``name``'s measured footprint: the first one given, kept from then on."""
        known = self._measured.get(name)
        if known is not None:
            return known
        self._measured[name] = footprint
        self._total = None
        return footprint

    def expected(self, spec: ModelSpec) -> Footprint:
        """The bytes ``spec`` holds (measured) or should hold (estimated)."""
        measured = self._measured.get(spec.key)
        if measured is not None:
            return measured
        try:
            return self._estimate(spec)
        except Exception as e:
            log.debug("no estimate for %s: %s: %s", spec.key, type(e).__name__, e)
            return NO_ESTIMATE

    def total_bytes(self) -> int | None:
        """The weights of every registered model together (a shared component
        once); None if none is registered."""
        if self._total is None:
            own, shared = 0, dict[str, int]()
            for spec in self._specs.values():
                footprint = self.expected(spec)
                own += footprint.own_bytes
                shared.update(footprint.shared_bytes)
            self._total = own + sum(shared.values()) if self._specs else None
        return self._total

    def all_fit(self, budget_bytes: int) -> bool:
        """Whether every registered model's weights fit ``budget_bytes`` at once."""
        total = self.total_bytes()
        return total is not None and total <= budget_bytes
