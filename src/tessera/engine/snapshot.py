"""The engine's stats snapshot, built from its parts' own stats.

Invariant: every version served, loading or being checked is in it, once;
what it holds is copied out, so a reader never sees a part's state change.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from tessera.device import Device, DeviceStats
from tessera.metrics import ModelStats
from tessera.repository.spec import ModelSpec
from tessera.residency import ModelResidency, ResidencyManager

from .host import EngineHost
from .step import ModelLoop

log = logging.getLogger(__name__)


def device_stats(device: Device) -> DeviceStats | None:
    """The device's stats, or None when they fail (a failing NVML must not
    fail every reader)."""
    try:
        return device.stats()
    except Exception:
        log.warning("device stats failed", exc_info=True)
        return None


def model_stats(
    spec: ModelSpec,
    loop: ModelLoop,
    residency: ResidencyManager,
    held_by_key: Mapping[str, ModelResidency],
    host: EngineHost,
    queue: tuple[int, int],
    *,
    current: bool,
    batches_since: int = 0,
) -> ModelStats:
    """Version ``spec``'s stats: residency's, its loop's counters, its
    ``queue`` (requests waiting and dropped, on its own queue and its encoder
    group's: ``ModelLoops.queue_depths``), and the batches it ran after its
    ``batches_since``-th."""
    key = spec.key
    held = held_by_key[key]  # every served version is registered with residency
    counters = loop.counters
    measured = residency.measured(key)
    return ModelStats(
        name=key,
        task=spec.task.value,
        state=held.state,
        bytes=held.bytes,
        weights_bytes=held.weights_bytes,
        measured_bytes=measured.total_bytes if measured is not None else None,
        measured_by=held.measured_by,
        activation_bytes_per_unit=residency.activation_bytes_per_unit(key),
        last_used=held.last_used if held.loads else None,
        load_s=held.load_s,
        miss_s=held.miss_s,
        uses=held.uses,
        eviction_score=held.eviction_score,
        host_tier=held.host_tier,
        host_bytes=held.host_bytes,
        files_load_s=held.files_load_s,
        host_load_s=held.host_load_s,
        host_loads=held.host_loads,
        loads=held.loads,
        evictions=held.evictions,
        pins=held.pins,
        error=held.error,
        queue_depth=queue[0],
        num_requests=counters.num_requests,
        num_items=counters.num_items,
        num_batches=counters.num_batches,
        num_failures=counters.num_failures,
        num_dropped=queue[1],
        recent_batches=counters.batches_since(batches_since),
        model=spec.name,
        version=spec.version_label,
        current=current,
        engine_metrics=host.engine_metrics(key),
        times=counters.times(),
    )
