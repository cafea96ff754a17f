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
    # Own bytes plus every shared component's, whole: summed once (the eviction
    # policy reads it for every candidate of every choice).
    total_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A copy behind a read-only view: the caller's dict may change later.
        shared = MappingProxyType(dict(self.shared_bytes))
        object.__setattr__(self, "shared_bytes", shared)
        object.__setattr__(self, "total_bytes", self.own_bytes + sum(shared.values()))


NO_BYTES = Footprint(0)
"""A model that holds nothing (not loaded, or its load failed)."""
