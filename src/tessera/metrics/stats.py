"""What the core reports as it serves: plain events and one snapshot, no Prometheus.

The engine and the gateway call a ``StatsSink``; ``metrics.prometheus`` is the
adapter that turns these events into ``tessera_*`` metric families. Gauges
(memory, residency, queue depths, the device) are read at scrape time from the
engine's ``snapshot()``, an immutable ``EngineStats``: the one object that
metrics, the admin API, KServe metadata, the live page and the CLI read.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar

from tessera.device import DeviceStats

_Stats = TypeVar("_Stats")


def _pickled_as_tuple(cls: type[_Stats]) -> type[_Stats]:
    """``cls`` (a dataclass with slots) pickled as its fields' values in one
    tuple: the dataclass default looks its fields up for each object, and the
    engine process pickles a snapshot of every model for its gateways four
    times a second (a hundred models' took 2.6 ms so, the interpreter lock
    held)."""
    values = operator.attrgetter(*(f.name for f in fields(cls)))  # type: ignore[arg-type]

    def reduce(self: _Stats) -> tuple[Callable[..., _Stats], tuple[Any, ...]]:
        return cls, values(self)

    cls.__reduce__ = reduce  # type: ignore[assignment,method-assign]
    return cls


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """One answered or refused request, as the gateway saw it."""

    model: str | None
    task: str | None
    tier: str | None
    tenant: str | None
    status: int
    total_s: float
    queue_s: float
    reason: str | None  # why it was refused: rate, concurrency, quota, queue_full, deadline, auth


class StatsSink(Protocol):
    def on_request(self, event: RequestEvent) -> None: ...

    def on_batch(self, model: str, size: int, run_s: float) -> None: ...

    def on_load(self, model: str, seconds: float, ok: bool) -> None: ...


class NullSink:
    """Reports nowhere."""

    def on_request(self, event: RequestEvent) -> None:
        return

    def on_batch(self, model: str, size: int, run_s: float) -> None:
        return

    def on_load(self, model: str, seconds: float, ok: bool) -> None:
        return


class FanoutSink:
    """A ``StatsSink`` that passes every event to each of its sinks in turn;
    ``add`` subscribes one more (the engine's sinks are added at start-up)."""

    def __init__(self, *sinks: StatsSink) -> None:
        self.sinks: tuple[StatsSink, ...] = sinks

    def add(self, sink: StatsSink) -> None:
        self.sinks = (*self.sinks, sink)

    def on_request(self, event: RequestEvent) -> None:
        for sink in self.sinks:
            sink.on_request(event)

    def on_batch(self, model: str, size: int, run_s: float) -> None:
        for sink in self.sinks:
            sink.on_batch(model, size, run_s)

    def on_load(self, model: str, seconds: float, ok: bool) -> None:
        for sink in self.sinks:
            sink.on_load(model, seconds, ok)


@_pickled_as_tuple
@dataclass(frozen=True, slots=True)
class Durations:
    """How many, and their seconds together."""

    count: int = 0
    seconds: float = 0.0

    def plus(self, seconds: float) -> Durations:
        return Durations(self.count + 1, self.seconds + seconds)


@_pickled_as_tuple
@dataclass(frozen=True, slots=True)
class RequestTimes:
    """A model version's requests since start, as its engine saw them (what
    Triton's statistics extension reports): those answered (queued and run),
    those failed, their time queued and the time of the batches they ran in;
    and, per batch size, its batches and their run time; when its last batch
    ended (Unix time)."""

    answered: Durations = Durations()
    failed: Durations = Durations()
    queued: Durations = Durations()
    run: Durations = Durations()
    batches: tuple[tuple[int, Durations], ...] = ()  # (batch size, its runs), by size
    last_batch_at: float | None = None


@_pickled_as_tuple
@dataclass(frozen=True, slots=True)
class ModelStats:
    """One model as the engine sees it at one instant.

    ``bytes`` is its share of the budget in use (its own bytes, its reserved
    activations and an equal part of each shared component among the resident
    models using it); ``weights_bytes`` counts its shared components whole;
    ``measured_bytes`` is its first load's measurement, kept for reloads.
    ``host_bytes`` is what it holds in the host tier while it waits there
    (``host_tier``), its shared components whole.
    """

    name: str  # what it is served as: the model's name, or name@version
    task: str
    state: str  # unloaded | loading | ready | unloading | failed
    bytes: int
    weights_bytes: int
    measured_bytes: int | None
    measured_by: str | None  # how the runtime measured its bytes
    activation_bytes_per_unit: int | None  # the window's measured peak; None until measured
    last_used: float | None
    load_s: float | None  # how long its last load took
    miss_s: float | None  # how long callers waited when it was not resident (what evicting costs)
    uses: float  # decayed count of uses (a use weighs half after a minute)
    eviction_score: float  # uses x miss s / target s / bytes: the lowest is evicted first
    host_tier: bool  # waits in the host tier now
    host_bytes: int
    files_load_s: float | None  # its last load from files (the first: with its warm-up)
    host_load_s: float | None  # its last load from the host tier: a copy
    host_loads: int  # loads from the host tier
    loads: int
    evictions: int
    pins: int
    error: str | None
    queue_depth: int
    num_requests: int
    num_items: int
    num_batches: int
    num_failures: int
    num_dropped: int  # dropped before running: caller gone or deadline passed
    recent_batches: tuple[tuple[int, float], ...]  # (items, run seconds), newest last
    model: str  # the model's name
    version: str
    current: bool  # the version requests naming no version get
    # An engine process's own figures (runtime external): requests_running,
    # requests_waiting, kv_cache_usage_ratio, prompt_tokens, generation_tokens,
    # restarts, sleeping (see metrics/prometheus.py's ENGINE_FAMILIES).
    engine_metrics: Mapping[str, float] = field(default_factory=dict)
    times: RequestTimes = RequestTimes()


@_pickled_as_tuple
@dataclass(frozen=True, slots=True)
class RolloutStats:
    """One rollout of a model version: its steps' times (engine clock seconds,
    None until reached), its outcome and the budget's use around it."""

    model: str
    version: str
    replaces: str | None  # the version it replaces; None for a new model
    state: str  # loading | checking | draining | done | rolled_back
    error: str | None
    started_at: float
    loaded_at: float | None
    checked_at: float | None
    switched_at: float | None
    drained_at: float | None
    finished_at: float | None
    # Bytes the models hold (weights; the activation room of running batches,
    # which comes and goes with them, left out).
    used_bytes_before: int
    used_bytes_peak: int
    used_bytes_after: int | None


@_pickled_as_tuple
@dataclass(frozen=True, slots=True)
class TenantCost:
    """What ``tenant`` has cost on ``model`` since the engine started: its share
    of the device time of the batches its requests ran in, and byte-seconds
    of the model's memory (``tessera.costs``; tenant '': held with no use)."""

    tenant: str
    model: str
    device_s: float
    byte_s: float


@_pickled_as_tuple
@dataclass(frozen=True, slots=True)
class RolloutCount:
    """How many rollouts of ``model`` ended with ``outcome`` (done | rolled_back)."""

    model: str
    outcome: str
    num: int


@_pickled_as_tuple
@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine at one instant: budget, workers, device and every model."""

    device_name: str
    device: DeviceStats | None  # None when the device could not be read
    budget_bytes: int
    used_bytes: int
    peak_used_bytes: int
    loads_total: int
    evictions_total: int
    num_workers: int
    threads_per_worker: int
    ready: bool
    models: tuple[ModelStats, ...]  # every served version of every model, by name
    host_budget_bytes: int  # the host tier's budget; 0: no host tier
    host_used_bytes: int
    host_loads_total: int  # loads from the host tier
    host_drops_total: int  # copies dropped from it to make room
    rollouts: tuple[RolloutStats, ...] = ()  # the recent ones, oldest first
    # Rounds of two or more models' batches in one forward (runtimes/stacking.py),
    # and the batches in them.
    stacked_rounds_total: int = 0
    stacked_batches_total: int = 0
    # Batches of encoder groups run through their shared encoder (several
    # head models' requests in one: ``engine/groups.py``), and their items.
    encoder_batches_total: int = 0
    encoder_rows_total: int = 0
    # Evictions to page-locked memory (CUDA): weights copied out, and weights
    # a buffer kept from the model's restore still held (runtimes/hostcopy.py).
    host_copies_out_total: int = 0
    host_copies_kept_total: int = 0
    rollouts_total: tuple[RolloutCount, ...] = ()
    # Admission's shared store (Redis) is lost: limits are kept on this
    # gateway's share of them (``admission.shared``).
    admission_degraded: bool = False
    tenant_costs: tuple[TenantCost, ...] = ()  # each (tenant, model) that cost anything

    def model(self, name: str) -> ModelStats | None:
        """The version served as ``name``, or the current version of model ``name``."""
        for model in self.models:
            if model.name == name:
                return model
        for model in self.models:
            if model.model == name and model.current:
                return model
        return None
