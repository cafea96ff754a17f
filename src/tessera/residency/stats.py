"""The residency snapshot: the budget's use and each model's residency."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tessera.footprint import Footprint
from tessera.residency.policy import eviction_score
from tessera.residency.table import ResidencyTable
from tessera.residency.tier import HostTier


@dataclass(frozen=True, slots=True)
class ModelResidency:
    """One model's residency. ``bytes`` is its share of the budget in use: its
    own bytes and reserved activations plus an equal part of each shared
    component among the resident models that use it (so the models' ``bytes``
    add up to ``used_bytes``, but for rounding); ``weights_bytes`` counts its
    shared components whole."""

    name: str
    state: str
    bytes: int
    weights_bytes: int
    last_used: float
    loads: int
    evictions: int
    pins: int
    error: str | None
    measured_by: str | None  # how the runtime measured its bytes
    load_s: float | None  # how long its last load took
    miss_s: float | None  # how long its callers waited for it when not resident (table.ModelEntry)
    uses: float  # decayed count of its uses (see table.USE_HALF_LIFE_S)
    eviction_score: float  # the cost policy's: uses x miss s / target s / bytes; lowest first
    host_tier: bool = False  # waits in the host tier now
    host_bytes: int = 0  # what it holds there (its shared components whole)
    files_load_s: float | None = None  # its last load from files
    host_load_s: float | None = None  # its last load from the host tier
    host_loads: int = 0  # loads from the host tier


@dataclass(frozen=True, slots=True)
class ResidencyStats:
    budget_bytes: int
    used_bytes: int
    peak_used_bytes: int
    loads_total: int
    evictions_total: int
    models: tuple[ModelResidency, ...]
    host_budget_bytes: int = 0  # 0: no host tier
    host_used_bytes: int = 0
    host_loads_total: int = 0  # loads from the host tier
    host_drops_total: int = 0  # copies dropped from it to make room


def residency_stats(
    table: ResidencyTable,
    tier: HostTier | None,
    measured: Callable[[str], Footprint | None],
    peak_used_bytes: int,
    now: float,
) -> ResidencyStats:
    """The snapshot of ``table`` and ``tier`` at ``now``."""
    entries = list(table.entries.values())
    device = table.shares()
    host = tier.table.shares() if tier is not None else {}

    def measured_by(name: str) -> str | None:
        footprint = measured(name)
        return footprint.method if footprint is not None else None

    return ResidencyStats(
        budget_bytes=table.budget_bytes,
        used_bytes=table.used_bytes(),
        peak_used_bytes=peak_used_bytes,
        loads_total=sum(e.loads for e in entries),
        evictions_total=sum(e.evictions for e in entries),
        host_budget_bytes=tier.budget_bytes if tier is not None else 0,
        host_used_bytes=tier.used_bytes() if tier is not None else 0,
        host_loads_total=sum(e.host_loads for e in entries),
        host_drops_total=tier.drops_total() if tier is not None else 0,
        models=tuple(
            ModelResidency(
                name=e.name,
                state=e.state.value,
                bytes=device.get(e.name, 0),
                weights_bytes=e.weights_bytes,
                last_used=e.last_used,
                loads=e.loads,
                evictions=e.evictions,
                pins=e.pins,
                error=e.error,
                measured_by=measured_by(e.name),
                load_s=e.load_s,
                miss_s=e.miss_s,
                uses=e.uses_at(now),
                eviction_score=eviction_score(e, now),
                host_tier=tier is not None and tier.holds(e.name),
                host_bytes=host.get(e.name, 0),
                files_load_s=e.files_load_s,
                host_load_s=e.host_load_s,
                host_loads=e.host_loads,
            )
            for e in entries
        ),
    )
