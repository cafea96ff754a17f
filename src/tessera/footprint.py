"""The bytes a model holds: its own, and those of the components it shares.

One type for every figure of a model's memory: what a runtime reports a loaded
model holds (and how it measured that), what the engine's host expects before
a load, and what the residency table counts against the budget. It sits at the
bottom of the tree (no ``tessera`` imports), so that ``runtimes/`` and
``residency/`` both use it and neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class Footprint:
    """Bytes a model holds on its device, or is expected to.

    ``own_bytes`` belong to this model alone; ``shared_bytes`` maps the key of
    each shared component it uses to that component's bytes (counted once in
    the budget however many models use it). ``method`` says how the numbers
    were measured (``"torch tensors"``, ``"rss delta"``...); None for an
    estimate made before loading.
    """

    own_bytes: int
    shared_bytes: Mapping[str, int] = field(default_factory=dict)
    method: str | None = None

    def __post_init__(self) -> None:
        # A copy behind a read-only view: the caller's dict may change later.
        object.__setattr__(self, "shared_bytes", MappingProxyType(dict(self.shared_bytes)))

    @property
    def total_bytes(self) -> int:
        """Own bytes plus every shared component's, whole."""
        return self.own_bytes + sum(self.shared_bytes.values())


NO_BYTES = Footprint(0)
"""A model that holds nothing (not loaded, or its load failed)."""
