"""The engine: a loop of plan, execute, report over the policies below it.

Its face is a handful of calls: ``submit``/``wait`` (or ``infer``), ``load``,
``unload``, ``add_model``/``remove_model`` (the model lifecycle: versions
rolled out while serving, see ``lifecycle.py``), ``snapshot()`` (one
immutable ``EngineStats`` that every reader uses) and ``subscribe`` (stats
sinks). Nothing outside ``engine/`` reaches into its parts.

The loop, per batch (vLLM v1's schedule / execute / update split):

- plan: the model's batcher (batching, with the fair queue of scheduling)
  decides which requests run together; residency decides whether the batch
  runs whole or in parts that each fit the budget (``plan_batch``), and
  reserves each part's room when it runs (``lease``).
- execute: the compute executor runs a part on a worker thread.
- report: the outcome goes back to the policies that learn from it (residency's
  activation peaks, scheduling's run-time predictor), to the counters, and
  to the callers' futures.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tessera.admission import Admission, AdmissionControl, AdmissionController, TenantLimits
from tessera.batching import ModelBatcher, make_queue
from tessera.clock import Clock, MonotonicClock
from tessera.device import Device, DeviceStats, default_host_budget_bytes, make_device
from tessera.errors import (
    DeadlineExceededError,
    InferenceError,
    InvalidInputError,
    ModelUnavailableError,
    OverloadedError,
    PayloadTooLargeError,
    ShuttingDownError,
    TesseraError,
)
from tessera.logs import request_id as request_id_var
from tessera.metrics import EngineStats, FanoutSink, ModelStats, StatsSink
from tessera.repository import ModelRepository, ModelSpec
from tessera.repository.trust import DEFAULT_ENGINE_COMMANDS
from tessera.request import Batch, Charge, QueuedRequest, RequestResult, with_stops
from tessera.residency import (
    MAX_HOST_LOADS,
    PATIENCE_SHARE,
    ActivationBook,
    BatchPart,
    ModelResidency,
    ResidencyManager,
    items_peak_units,
    make_eviction_policy,
    peak_units,
)
from tessera.runtimes.base import ModelLoader, stacks
from tessera.runtimes.cache import prune
from tessera.runtimes.hostcopy import PINNED_POOL
from tessera.runtimes.memory import freeze_heap
from tessera.runtimes.stacking import stacked_totals
from tessera.runtimes.tokens import TokenCounter, token_counter
from tessera.scheduling import BatchTimePredictor
from tessera.tasks.finiteness import finite_run
from tessera.tasks.types import ChatOutput, Task, cut_to_window, request_units, work_units

from .counters import ModelCounters
from .executor import ACROSS_MODELS_THREADS, BatchRun, ComputeExecutor, default_workers
from .host import UNMEASURED_RUNTIMES, EngineHost
from .lifecycle import (
    ModelLifecycle,
    ServedModel,
    served_spec,
    served_versions,
    spec_for_task,
)

log = logging.getLogger(__name__)

# The most of a part's run its batch's fixed cost may be (``Engine._part_units``).
PART_FIXED_SHARE = 0.2
# The longest a request may wait for its answer, whatever its caller asks
# (``x-request-timeout: 1e308`` made a deadline no clock or prediction can hold).
MAX_TIMEOUT_S = 86400.0


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings, parsed once at start and passed down."""

    memory_budget_bytes: int | None = None  # None: the device's default share
    # The host tier's budget: evicted models kept ready in host memory, so that
    # a reload is a copy. None: a quarter of the machine's RAM; 0: no host tier.
    host_memory_budget_bytes: int | None = None
    device: str = "auto"
    num_threads: int | None = None  # None: every core
    num_workers: int | None = None  # None: one per thread
    eviction_policy: str = "cost"
    # The share of its latency target a caller short of room waits for busy
    # models cheaper to evict than idle ones (residency/manager.py's
    # ``PATIENCE_SHARE``); 0: it evicts idle ones at once. A knob to measure
    # with: in the model of a GPU's host side, 100 models under a budget of
    # 20, Zipf(1.1), misses waited out the whole of it (docs/benchmarks.md).
    eviction_patience: float = PATIENCE_SHARE
    # Requests waiting per model, at most: a bound on memory; before it, a
    # request whose predicted wait passes its deadline is refused (batcher.py).
    max_queue: int = 1000
    default_timeout_s: float = 60.0
    residency_wait_s: float = 30.0
    # Loads from the host tier in flight at once (residency/manager.py's
    # ``MAX_HOST_LOADS``); None: that on CUDA, whose copies back run one at a
    # time on a copy stream, no bound on the CPU; 0: no bound.
    max_host_loads: int | None = None
    preload: tuple[str, ...] | None = None  # None: the models marked preload
    # After the preloads, load more models while they fit the budget without
    # an eviction, before the server is ready; None: when ``preload`` is None
    # (``fills``).
    fill: bool | None = None
    scheduling: str = "fair"  # fair | fifo
    # While two or more tenants use a model, cap a batch's predicted run time
    # here (the fair queue's quantum); None: full batches whatever the mix.
    fair_quantum_s: float | None = 0.025
    # Fairness at the grain of work: a request of more work than one quantum
    # is queued as parts of about a quantum each (from the model's measured
    # run time per unit), run as long work; a tenant with nothing running
    # starts a batch beyond the model's busy slots. False: a request runs
    # whole (up to ``max_batch_size`` items a part), as one batch.
    fair_parts: bool = True
    # Batches predicted to run this long (a page of OCR, a chat generation) are
    # long work; None: every batch is short, in one lane.
    long_batch_s: float | None = 0.5
    # How long work shares the workers (executor.py): "steps", compute slots that
    # short batches never wait for, long ones stepping aside at their next step
    # boundary; "lane", threads of their own beside the short ones' workers.
    long_work: str = "steps"
    # Where loaders keep converted weights (a GGUF model's) between loads and
    # restarts; None: no cache. At start, entries unused for longer than
    # cache_max_age_s are removed, then the least recently used over
    # cache_max_bytes (runtimes/cache.py); None: no bound of that kind.
    cache_dir: Path | None = None
    cache_max_age_s: float | None = 30 * 86400.0
    cache_max_bytes: int | None = None
    # The engine process's interpreter switch interval (``sys.setswitchinterval``):
    # how long a thread that wants the interpreter lock waits before it asks the
    # holder to drop it. None: Python's own (5 ms). A knob to measure with (the
    # GPU check's variants): whether the compute workers' waits off the core are
    # waits for the lock is not settled (docs/benchmarks.md).
    gil_switch_interval_s: float | None = None
    # Threads for batches that may run in one forward with other models'
    # (executor.py, ``ACROSS_MODELS_THREADS``); a knob for a device to settle.
    across_models_threads: int = ACROSS_MODELS_THREADS
    # The command lines a card's options.command may name, per engine, and the
    # folders pickle files may load from (``repository/trust.py``).
    engine_commands: Mapping[str, tuple[tuple[str, ...], ...]] = field(
        default_factory=lambda: dict(DEFAULT_ENGINE_COMMANDS)
    )
    trusted_pickle_dirs: tuple[Path, ...] = ()
    # Adapters beyond the built-in ones: name -> "module:Class", a ModelLoader
    # imported when a card names it (``runtimes/registry.py``).
    adapters: Mapping[str, str] = field(default_factory=dict)

    @property
    def fills(self) -> bool:
        """Whether the budget is filled at start: ``fill``, or by default unless
        ``preload`` names the models."""
        return self.fill if self.fill is not None else self.preload is None


class PreloadProgress(Protocol):
    """Told as preload models finish loading (the CLI draws a progress bar)."""

    def start(self, names: list[str]) -> None: ...

    def loaded(self, name: str, error: BaseException | None) -> None: ...

    def finish(self) -> None: ...


@dataclass(frozen=True)
class Caller:
    """Who sends a request: the tenant's limits, its tier's weight and latency target."""

    limits: TenantLimits
    tier: str = "standard"
    weight: float = 1.0
    latency_target_s: float | None = None

    @property
    def tenant(self) -> str:
        return self.limits.name


@dataclass
class RequestTrace:
    """Filled in by ``Engine.infer`` for the audit log and the metrics."""

    units: float = 0.0
    queued_s: float = 0.0
    run_s: float = 0.0
    batch_size: int = 0
    # The request's final charge, settled when its work ends (which may be
    # after ``wait`` returns: a generation stops at its next step).
    charge: Charge | None = None

    def record(self, request: QueuedRequest, result: RequestResult | None) -> None:
        """What a wait on ``request`` ended with (``result``: None if unanswered)."""
        self.charge = request.charge
        self.units = request.charge.units if request.charge.units is not None else 0.0
        if result is not None:
            self.queued_s = result.queued_s
            self.run_s = result.run_s
            self.batch_size = result.batch_size


@dataclass(frozen=True)
class Submission:
    """A queued request, and the admission to release once it is answered;
    ``model`` is the version it was queued on (its key), ``version`` that
    version's label: the one that answers it."""

    model: str
    request: QueuedRequest
    admission: Admission | None
    version: str = "1"
    # A request of more items than a batch holds is queued as these parts,
    # a batch's worth each; ``request`` is their whole (``_joined``).
    parts: tuple[QueuedRequest, ...] = ()

    @property
    def started(self) -> bool:
        """Whether any of its work began to run."""
        return self.request.charge.started or any(p.charge.started for p in self.parts)


class Engine(ModelLifecycle):
    def __init__(
        self,
        repository: ModelRepository,
        config: EngineConfig,
        *,
        clock: Clock | None = None,
        device: Device | None = None,
        stats: StatsSink | None = None,
        admission: AdmissionControl | None = None,
        loaders: Mapping[str, ModelLoader] | None = None,
    ) -> None:
        """``loaders``: loaders by adapter name beside the registry's (the
        cluster gateway's ``cluster`` runtime)."""
        self.config = config
        self.clock: Clock = clock or MonotonicClock()
        self._switch_interval_before: float | None = None
        if config.gil_switch_interval_s is not None:
            self._switch_interval_before = sys.getswitchinterval()
            sys.setswitchinterval(config.gil_switch_interval_s)
        self._device = device or make_device(config.device)
        num_threads = config.num_threads or os.cpu_count() or 1
        num_workers = config.num_workers or default_workers(self._device, num_threads)
        self._executor = ComputeExecutor(
            self._device,
            num_threads,
            num_workers,
            long_batch_s=config.long_batch_s,
            long_work=config.long_work,
            across_models_threads=config.across_models_threads,
        )
        self._stats = FanoutSink() if stats is None else FanoutSink(stats)
        activations = ActivationBook()
        self._host = EngineHost(
            self._device,
            self._executor,
            activations,
            self._stats,
            cache_dir=config.cache_dir,
            loaders=loaders,
            adapters=config.adapters,
            trusted_pickle_dirs=config.trusted_pickle_dirs,
        )
        budget = config.memory_budget_bytes or self._device.default_budget_bytes()
        host_budget = config.host_memory_budget_bytes
        self._residency = ResidencyManager(
            budget,
            self._host,
            make_eviction_policy(config.eviction_policy, self.clock),
            self.clock,
            wait_s=config.residency_wait_s,
            activations=activations,
            host_budget_bytes=default_host_budget_bytes() if host_budget is None else host_budget,
            max_host_loads=self._max_host_loads(config),
            patience_share=config.eviction_patience,
        )
        self._served: dict[str, ServedModel] = {}
        for name in repository.names():
            versions = repository.versions(name)
            self._served[name] = ServedModel({s.key: s for s in versions}, versions[-1].key)
            self._residency.register(versions)
        self._counters: dict[str, ModelCounters] = {
            key: ModelCounters() for served in self._served.values() for key in served.specs
        }
        self._batchers: dict[str, ModelBatcher] = {}
        self._predictors: dict[str, BatchTimePredictor] = {}
        # This process's counters, unless the gateways share theirs (in Redis).
        self._admission = admission if admission is not None else AdmissionController(self.clock)
        self._preload_done = False
        self._demand: dict[str, int] = {}  # ``seed_demand``
        # Tokenizers of ``truncate: false`` cards, by version and folder.
        self._token_counters: dict[tuple[str, Path], TokenCounter | None] = {}
        # Requests queued and not yet answered; while draining, set when none is.
        self._pending: set[QueuedRequest] = set()
        self._pending_by_key: dict[str, set[QueuedRequest]] = {}
        self._draining = False
        self._drained = asyncio.Event()
        # A version switched to while its predecessor still had requests: its
        # batches wait here until those are answered (answers switch at one point).
        self._gates: dict[str, asyncio.Event] = {}
        self._drain_wait_s = config.default_timeout_s
        self._init_lifecycle(config.engine_commands)

    # -- lifecycle --------------------------------------------------------

    def subscribe(self, sink: StatsSink) -> None:
        """Report batches and loads to ``sink`` too (metrics, the live page)."""
        self._stats.add(sink)

    def seed_usage(self, tenant: str, units: float) -> None:
        """Count ``units`` already used today by ``tenant`` (from the audit log)."""
        self._admission.seed_usage(tenant, units)

    def seed_demand(self, requests: dict[str, int]) -> None:
        """Requests per model remembered from before a restart (the audit log,
        ``name`` or ``name@version``): the fill at start loads the most
        asked-for first."""
        self._demand = {}
        for model, count in requests.items():
            name = model.partition("@")[0]
            self._demand[name] = self._demand.get(name, 0) + count

    def preload_names(self) -> list[str]:
        if self.config.preload is not None:
            return list(self.config.preload)
        return [s.current_spec.key for s in self._served.values() if s.current_spec.preload]

    async def preload(self, progress: PreloadProgress | None = None) -> None:
        """Load and warm the preload models; ``ready`` once each has loaded or
        failed (a failed one is that model's state, retried on demand)."""
        names = self.preload_names()
        if progress is not None:
            progress.start(names)
        cache_dir = self.config.cache_dir
        if cache_dir is not None:  # before any load reads it
            await asyncio.to_thread(
                prune,
                cache_dir,
                max_age_s=self.config.cache_max_age_s,
                max_bytes=self.config.cache_max_bytes,
            )

        async def load(name: str) -> None:
            error: BaseException | None = None
            try:
                await self._residency.ensure_loaded(self.spec(name))
            except Exception as e:
                error = e
                raise
            finally:
                if progress is not None:
                    progress.loaded(name, error)

        results = await asyncio.gather(*(load(n) for n in names), return_exceptions=True)
        if progress is not None:
            progress.finish()
        failures = [
            f"{n}: {r}" for n, r in zip(names, results, strict=True) if isinstance(r, BaseException)
        ]
        for failure in failures:
            log.error("preload failed: %s", failure)
        if self.config.fills:
            await self._fill()
        # What started the server (its modules, its preloaded models) lives as
        # long as it does: out of the collector's way (``memory.freeze_heap``).
        freeze_heap()
        self._preload_done = True

    async def _fill(self) -> None:
        """Fill the idle budget with what fits (``ResidencyManager.fill``), as
        Triton loads its whole repository at start: the first requests for
        those models find them ready rather than wait behind loads."""
        specs = [served.current_spec for served in self._served.values()]
        started = self.clock.now()
        loaded = await self._residency.fill(specs, self._demand)
        if loaded:
            log.info(
                "filled the budget at start in %.1f s: %s (%d MiB of %d MiB in use)",
                self.clock.now() - started,
                ", ".join(loaded),
                self._residency.table.used_bytes() >> 20,
                self._residency.table.budget_bytes >> 20,
            )

    @property
    def phase(self) -> str:
        """``starting`` (preloading), ``ready``, or ``draining`` (stopping)."""
        if self._draining:
            return "draining"
        return "ready" if self._preload_done else "starting"

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    async def drain(self, grace_s: float) -> int:
        """Stop taking work (``ready`` turns False; new requests get
        ``ShuttingDownError``), wait up to ``grace_s`` for the accepted ones,
        then answer those still pending with ``ShuttingDownError``. Returns how
        many were answered so."""
        self._draining = True
        if not self._pending:
            self._drained.set()
        with contextlib.suppress(TimeoutError):
            await self.clock.wait_for(self._drained.wait(), grace_s)
        left = [r for r in self._pending if not r.future.done()]
        grace = f"{grace_s:g}s grace" if grace_s > 0 else "its grace cut short"
        for request in left:
            request.future.set_exception(
                ShuttingDownError(f"the server stopped before this request finished ({grace})")
            )
        return len(left)

    def _forget(self, key: str, request: QueuedRequest, _: object) -> None:
        self._pending.discard(request)
        self._pending_by_key[key].discard(request)
        if self._draining and not self._pending:
            self._drained.set()

    async def load(self, name: str) -> ModelStats:
        """Load model ``name`` now (if it is not resident) and return its stats."""
        spec = self.spec(name)
        await self._residency.ensure_loaded(spec)
        return self._model_stats(spec, self._residency_by_name())

    async def unload(self, name: str) -> bool:
        """Unload model ``name`` once idle; False if it was not loaded."""
        return await self._residency.unload(self.spec(name).key)

    async def close(self) -> None:
        """Fail what still waits, wait for running batches, unload every model
        and stop the workers (a load still running unloads itself at its end)."""
        for gate in self._gates.values():
            gate.set()
        for batcher in self._batchers.values():
            await batcher.close()
        self._host.begin_close()
        await self._residency.close()
        self._executor.shutdown()
        self._host.shutdown()
        if self._switch_interval_before is not None:
            sys.setswitchinterval(self._switch_interval_before)

    def _max_host_loads(self, config: EngineConfig) -> int:
        """Loads from the host tier in flight at once: the config's, else
        ``MAX_HOST_LOADS`` on CUDA (copies back one at a time on a copy
        stream) and no bound (0) on the CPU."""
        if config.max_host_loads is not None:
            return config.max_host_loads
        return MAX_HOST_LOADS if self._device.kind == "cuda" else 0

    # -- what every reader sees -------------------------------------------

    @property
    def device_kind(self) -> str:
        """``cpu`` or ``cuda``."""
        return self._device.kind

    def snapshot(self, batches_since: Mapping[str, int] | None = None) -> EngineStats:
        """The engine at this instant, as one immutable object.

        ``batches_since`` (model version -> its ``num_batches`` in an earlier
        snapshot): each model's ``recent_batches`` holds only the batches run
        after that count (the engine process's pushes to its gateways, which
        keep the windows themselves: a hundred models' whole windows were
        1.4 MB and 21 ms of pickling every quarter of a second)."""
        residency = self._residency.stats()
        by_name = {m.name: m for m in residency.models}
        stacked_rounds, stacked_batches = stacked_totals()
        copies_out, copies_kept = PINNED_POOL.copies()
        return EngineStats(
            device_name=self._device.name,
            device=self._device_stats(),
            budget_bytes=residency.budget_bytes,
            used_bytes=residency.used_bytes,
            peak_used_bytes=residency.peak_used_bytes,
            loads_total=residency.loads_total,
            evictions_total=residency.evictions_total,
            host_budget_bytes=residency.host_budget_bytes,
            host_used_bytes=residency.host_used_bytes,
            host_loads_total=residency.host_loads_total,
            host_drops_total=residency.host_drops_total,
            host_copies_out_total=copies_out,
            host_copies_kept_total=copies_kept,
            num_workers=self._executor.num_workers,
            threads_per_worker=self._executor.threads_per_worker,
            ready=self.ready,
            models=tuple(
                self._model_stats(spec, by_name, batches_since)
                for spec in sorted(self._all_versions().values(), key=lambda s: s.key)
            ),
            rollouts=self.recent_rollouts(),
            rollouts_total=self.rollout_counts(),
            stacked_rounds_total=stacked_rounds,
            stacked_batches_total=stacked_batches,
            admission_degraded=self._admission.degraded,
        )

    def _all_versions(self) -> dict[str, ModelSpec]:
        """Every version served, loading or being checked, by key."""
        versions = self.staged_versions()
        for served in self._served.values():
            versions.update(served.specs)
        return versions

    def _residency_by_name(self) -> dict[str, ModelResidency]:
        return {m.name: m for m in self._residency.stats().models}

    def _device_stats(self) -> DeviceStats | None:
        try:
            return self._device.stats()
        except Exception:  # a failing NVML must not fail every reader
            log.warning("device stats failed", exc_info=True)
            return None

    def _model_stats(
        self,
        spec: ModelSpec,
        residency: dict[str, ModelResidency],
        batches_since: Mapping[str, int] | None = None,
    ) -> ModelStats:
        name = spec.key
        held = residency[name]  # every served version is registered with residency
        counters = self._counters[name]
        batcher = self._batchers.get(name)
        measured = self._residency.measured(name)
        return ModelStats(
            name=name,
            task=spec.task.value,
            state=held.state,
            bytes=held.bytes,
            weights_bytes=held.weights_bytes,
            measured_bytes=measured.total_bytes if measured is not None else None,
            measured_by=held.measured_by,
            activation_bytes_per_unit=self._residency.activation_bytes_per_unit(name),
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
            queue_depth=batcher.depth if batcher is not None else 0,
            num_requests=counters.num_requests,
            num_items=counters.num_items,
            num_batches=counters.num_batches,
            num_failures=counters.num_failures,
            num_dropped=batcher.num_dropped if batcher is not None else 0,
            recent_batches=counters.batches_since(
                batches_since.get(name, 0) if batches_since is not None else 0
            ),
            model=spec.name,
            version=spec.version_label,
            current=spec.name in self._served and self._served[spec.name].current == name,
            engine_metrics=self._host.engine_metrics(name),
            times=counters.times(),
        )

    # -- the request path ---------------------------------------------------

    def model_names(self) -> list[str]:
        """The models served now, by name."""
        return sorted(self._served)

    def served_models(self) -> dict[str, ServedModel]:
        """Each model's served versions, as of now (a copy)."""
        return {name: ServedModel(dict(s.specs), s.current) for name, s in self._served.items()}

    def versions(self, name: str) -> list[ModelSpec]:
        """The versions of model ``name`` served now, oldest first."""
        return served_versions(self._served, name)

    def spec(self, name: str) -> ModelSpec:
        """The version ``name`` names: ``model`` (its current version) or
        ``model@version`` (that version, while it is served)."""
        return served_spec(self._served, name)

    def spec_for(self, name: str, task: Task) -> ModelSpec:
        return spec_for_task(self.spec(name), name, task)

    def _batcher(self, spec: ModelSpec) -> ModelBatcher:
        batcher = self._batchers.get(spec.key)
        if batcher is None:
            predictor = self._predictor(spec.key)
            batcher = self._batchers[spec.key] = ModelBatcher(
                spec.key,
                spec.batching,
                functools.partial(self._execute, spec),
                self.clock,
                max_queue=self.config.max_queue,
                queue=make_queue(self.config.scheduling, predictor, self.config.fair_quantum_s),
                max_concurrent_batches=self._executor.num_workers,
                predictor=predictor,
                gather_idle=self._device.kind != "cuda",
                step_past=self._steps_past(spec),
            )
        return batcher

    def _steps_past(self, spec: ModelSpec) -> bool:
        """Whether a tenant with nothing running on ``spec``'s model may start
        a batch beyond its busy slots (``ModelBatcher.step_past``): with fair
        parts and fair scheduling, unless the card fixes the batches at once
        for an in-process runtime (an external engine's window has room)."""
        fair = self.config.fair_parts and self.config.scheduling == "fair"
        fixed = spec.batching.max_concurrent_batches is not None
        return fair and (not fixed or spec.runtime == "external")

    def _predictor(self, name: str) -> BatchTimePredictor:
        predictor = self._predictors.get(name)
        if predictor is None:
            predictor = self._predictors[name] = BatchTimePredictor()
        return predictor

    async def infer(
        self,
        name: str,
        task: Task,
        items: Sequence[Any],
        *,
        timeout_s: float | None = None,
        caller: Caller | None = None,
        trace: RequestTrace | None = None,
    ) -> list[Any]:
        """Run ``items`` on model ``name`` and return one output per item."""
        submission = self.submit(name, task, items, timeout_s=timeout_s, caller=caller)
        return await self.wait(submission, trace)

    def submit(
        self,
        name: str,
        task: Task,
        items: Sequence[Any],
        *,
        timeout_s: float | None = None,
        caller: Caller | None = None,
    ) -> Submission:
        """Queue a request, or refuse it now, before it costs anything: validation,
        the caller's admission (rate, concurrency, quota), the model's queue bound.
        The caller must ``wait`` on the submission (that releases the admission)."""
        return self._submit(self.spec_for(name, task), items, timeout_s, caller)

    async def asubmit(
        self,
        name: str,
        task: Task,
        items: Sequence[Any],
        *,
        timeout_s: float | None = None,
        caller: Caller | None = None,
    ) -> Submission:
        """``submit``, as a gateway in another process has it (``ServingEngine``)."""
        return self.submit(name, task, items, timeout_s=timeout_s, caller=caller)

    def _submit(
        self,
        spec: ModelSpec,
        items: Sequence[Any],
        timeout_s: float | None,
        caller: Caller | None,
    ) -> Submission:
        name = spec.key
        if self._draining:  # before admission: a draining server refuses, never rate-limits
            raise ShuttingDownError("the server is shutting down: no new requests")
        if not items:
            raise InvalidInputError("input must not be empty")
        if len(items) > spec.max_inputs:
            raise PayloadTooLargeError(
                f"{len(items)} inputs in one request;"
                f" model {name!r} takes at most {spec.max_inputs}"
            )
        self._residency.raise_if_failed(name)
        items = cut_to_window(items, spec.inputs)
        units = request_units(items, spec.inputs, self._token_counter(spec))
        chunks = self._parts(spec, items)
        shapes = []  # each chunk's units, and those of its items run apart
        for chunk in chunks:
            chunk_units = units if len(chunks) == 1 else work_units_of(chunk, spec)
            apart, alone = self._alone_units(spec, chunk)
            self._residency.raise_if_never_fits(spec, items_peak_units(chunk_units, alone, apart))
            shapes.append((chunk_units, (apart, alone)))
        admission = self._admission.admit(caller.limits, units) if caller is not None else None
        parts: list[QueuedRequest] = []
        try:
            if len(chunks) == 1:
                ((_, apart_alone),) = shapes
                request = self._request(spec, list(items), units, apart_alone, timeout_s, caller)
                self._enqueue(spec, request)
            else:
                request = self._request(spec, list(items), units, (0.0, ()), timeout_s, caller)
                for chunk, (chunk_units, apart_alone) in zip(chunks, shapes, strict=True):
                    part = self._request(
                        spec, chunk, chunk_units, apart_alone, timeout_s, caller, whole=request
                    )
                    self._enqueue(spec, part, counted=not parts)
                    parts.append(part)
                _joined(request, parts)
        except BaseException:
            for part in parts:  # queued already: dropped before they run
                part.future.cancel()
            if admission is not None:  # refused after admission (503): it costs nothing
                self._admission.settle(admission, 0.0)
                self._admission.release(admission)
            raise
        counters = self._counters[name]
        counters.num_requests += 1
        counters.num_items += len(items)
        return Submission(name, request, admission, spec.version_label, tuple(parts))

    def _parts(self, spec: ModelSpec, items: Sequence[Any]) -> list[list[Any]]:
        """``items`` in the parts they are queued as: at most a batch's worth
        of items each (``max_batch_size``) and, with ``fair_parts``, about a
        quantum of work each (``_part_units``), at least one item each."""
        size = max(1, spec.batching.max_batch_size)
        most = self._part_units(spec) if len(items) > 1 else None
        if most is None:
            return [list(items[i : i + size]) for i in range(0, len(items), size)]
        parts: list[list[Any]] = [[]]
        units = 0.0
        for item in items:
            item_units = work_units(item, spec.inputs)
            if parts[-1] and (len(parts[-1]) >= size or units + item_units > most):
                parts.append([])
                units = 0.0
            parts[-1].append(item)
            units += item_units
        return parts

    def _part_units(self, spec: ModelSpec) -> float | None:
        """The work units of one part for ``spec``'s model, from its measured
        run time (fixed seconds a batch, and seconds a unit): what runs in one
        fair quantum, or, where a batch's fixed cost is larger, enough that it
        is at most ``PART_FIXED_SHARE`` of a part's run (a part of less would
        spend more on its batch than on its work: a CPU's small encoder
        batches cost tens of milliseconds whatever their size). None: no
        bound (fair parts off, no quantum, or no line fitted yet: sizes too
        close together hide the fixed cost, and parts sized without it stay
        too small for a batch to show it)."""
        quantum_s = self.config.fair_quantum_s
        if not self.config.fair_parts or quantum_s is None:
            return None
        predictor = self._predictors.get(spec.key)
        coefficients = predictor.line() if predictor is not None else None
        if coefficients is None or coefficients[1] <= 0:
            return None
        fixed_s, unit_s = coefficients
        work_s = max(quantum_s, fixed_s * (1 - PART_FIXED_SHARE) / PART_FIXED_SHARE)
        return work_s / unit_s

    def _alone_units(
        self, spec: ModelSpec, items: Sequence[Any]
    ) -> tuple[float, tuple[float, ...]]:
        """Of ``items``, those ``spec``'s runtime runs apart, each alone: their
        work units in all, and each one's peak units (``ItemsApart``)."""
        loader = self._host.items_apart(spec)
        if loader is None:
            return 0.0, ()
        apart, alone = 0.0, []
        for item in items:
            peak = loader.alone_units(spec, item)
            if peak is not None:
                apart += work_units(item, spec.inputs)
                alone.append(peak)
        return apart, tuple(alone)

    def _token_counter(self, spec: ModelSpec) -> TokenCounter | None:
        """The model's token count, for a card that refuses over-window texts."""
        if spec.inputs.truncate or spec.inputs.text_window is None:
            return None
        key = (spec.key, spec.folder)
        if key not in self._token_counters:
            self._token_counters[key] = token_counter(spec)
        return self._token_counters[key]

    async def wait(self, submission: Submission, trace: RequestTrace | None = None) -> list[Any]:
        """The outputs of a submitted request, within its deadline. If it ends
        without them (the caller gone, the deadline passed, a failure), its work
        is told to stop at its next step, and costs nothing if it never began."""
        request = submission.request
        if submission.admission is not None:
            settle = functools.partial(self._admission.settle, submission.admission)
            request.charge.when_settled(settle)
        timeout = request.deadline - request.arrival if request.deadline else None
        result: RequestResult | None = None
        # One timer a request, no task or future of its own (``asyncio.wait_for``
        # made both: about a tenth of the engine process's time at saturation).
        expired = False

        def expire() -> None:
            nonlocal expired
            if not request.future.done():
                expired = True
                request.future.cancel()

        timer = self.clock.call_later(timeout, expire) if timeout is not None else None
        try:
            result = await request.future
            return result.outputs
        except asyncio.CancelledError:
            if not expired:
                raise
            raise DeadlineExceededError(
                f"no answer from model {submission.model!r} within {timeout:.3g}s"
            ) from None
        finally:
            if timer is not None:
                timer.cancel()
            if result is None:
                request.stop.set()
                if not submission.started:
                    request.charge.settle(0.0)
            if submission.admission is not None:
                self._admission.release(submission.admission)
            if trace is not None:
                trace.record(request, result)

    def _request(
        self,
        spec: ModelSpec,
        items: list[Any],
        units: float,
        apart: tuple[float, tuple[float, ...]],
        timeout_s: float | None,
        caller: Caller | None,
        *,
        whole: QueuedRequest | None = None,
    ) -> QueuedRequest:
        """A request for ``spec``'s queue; a part of ``whole`` shares its
        arrival, deadline and stop flag (the caller's, which it sets as it goes),
        and is bulk work (``QueuedRequest.bulk``)."""
        if self._draining:
            raise ShuttingDownError("the server is shutting down: no new requests")
        who: dict[str, Any]  # whose it is, as the queue sees it
        if whole is not None:
            arrival, deadline = whole.arrival, whole.deadline
            who = {
                "tenant": whole.tenant,
                "tier": whole.tier,
                "weight": whole.weight,
                "latency_target_s": whole.latency_target_s,
                "stop": whole.stop,
                "request_id": whole.request_id,
                "bulk": True,
            }
        else:
            arrival = self.clock.now()
            timeout = timeout_s if timeout_s is not None else self.config.default_timeout_s
            deadline = arrival + min(timeout, MAX_TIMEOUT_S)
            # Submitted while serving the request: the log's context has its id.
            who = {"request_id": request_id_var.get()}
            if caller is not None:
                who |= {
                    "tenant": caller.tenant,
                    "tier": caller.tier,
                    "weight": caller.weight,
                    "latency_target_s": caller.latency_target_s,
                }
        future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        apart_units, alone_units = apart
        return QueuedRequest(
            items,
            units,
            arrival,
            future,
            deadline=deadline,
            apart_units=apart_units,
            alone_units=alone_units,
            **who,
        )

    def _enqueue(self, spec: ModelSpec, request: QueuedRequest, *, counted: bool = True) -> None:
        """Queue ``request``; a request's parts after its first are not held to
        the queue's count (``max_queue`` bounds requests, whatever their parts)."""
        self._batcher(spec).submit(request, counted=counted)
        self._pending.add(request)
        self._pending_by_key.setdefault(spec.key, set()).add(request)
        request.future.add_done_callback(functools.partial(self._forget, spec.key, request))

    async def _execute(self, spec: ModelSpec, batch: Batch) -> None:
        """Plan a batch (residency: whole, or parts that fit), run each part, report."""
        gate = self._gates.get(spec.key)
        if gate is not None:  # a new version: its predecessor's requests are answered first
            await gate.wait()
        try:
            parts = self._residency.plan_batch(spec, batch.requests)
        except Exception as e:  # answered, not left to wait for their deadlines
            log.error("no plan for a batch of model %s: %s: %s", spec.key, type(e).__name__, e)
            whole = BatchPart(tuple(batch.requests), 0.0, 0, 0.0)
            self._report_failure(spec, whole, InferenceError(f"model {spec.key!r} failed"))
            return
        for i, part in enumerate(parts):
            following = parts[i + 1] if i + 1 < len(parts) else None
            await self._run(spec, batch.formed_at, part, following=following)

    def _next_batch_s(self, spec: ModelSpec, following: BatchPart | None) -> float | None:
        """The predicted seconds of ``spec``'s next batch: ``following`` (the
        next part of this batch), else the batch its queue would form now;
        None where there is none, or its batch times are not known yet."""
        if following is not None:
            units: float | None = following.units
        else:
            batcher = self._batchers.get(spec.key)
            units = batcher.next_batch_units() if batcher is not None else None
        return None if units is None else self._predictor(spec.key).predict(units)

    async def _run(
        self,
        spec: ModelSpec,
        formed_at: float,
        part: BatchPart,
        *,
        following: BatchPart | None = None,
    ) -> None:
        """Run a part; if the model raised on it, find whose input it was.

        A failed part is retried in halves (an out-of-memory error too: a
        half needs half the bytes), and a half that fails while its sibling
        succeeds is halved again, so one poisoned input fails only its own
        request and its neighbours, other tenants' included, are answered.
        When both halves fail the fault is the model's, not one input's:
        both fail without more retries, so a broken model costs three runs
        per batch, not one per request."""
        error = await self._attempt(spec, formed_at, part, following=following)
        if error is None:
            return
        if len(part.requests) > 1 and _input_may_be_at_fault(error):
            log.warning(
                "batch of model %s (%d requests) failed, retried in halves: %s",
                spec.key,
                len(part.requests),
                _cause(error),
            )
            await self._bisect(spec, formed_at, part)
        else:
            self._fail_part(spec, part, error)

    async def _bisect(self, spec: ModelSpec, formed_at: float, part: BatchPart) -> None:
        for request in part.requests:
            if request.gone:  # its caller left: not retried, and its failed run costs nothing
                request.charge.settle(0.0)
        halves = [h for h in _halves(part) if h.requests]
        failed = []
        for half in halves:
            error = await self._attempt(spec, formed_at, half)
            if error is not None:
                failed.append((half, error))
        for half, error in failed:
            if len(failed) == 1 and len(half.requests) > 1 and _input_may_be_at_fault(error):
                await self._bisect(spec, formed_at, half)
            else:
                self._fail_part(spec, half, error)

    async def _attempt(
        self,
        spec: ModelSpec,
        formed_at: float,
        part: BatchPart,
        *,
        following: BatchPart | None = None,
    ) -> BaseException | None:
        """Lease the model and run ``part`` on it; report a success and return
        None, or return what failed (nothing is answered then). ``following``:
        the next part of its batch. When there is one, or requests are
        queued, the lease may keep its room for that next batch
        (``ResidencyManager.release``), for as long as it is predicted to take
        (``_next_batch_s``; it had been taken as this part's time: a short
        part before a long one said the room was wanted briefly)."""
        items = [item for request in part.requests for item in request.items]
        try:
            expected_s = self._predictor(spec.key).predict(part.units)
            async with self._residency.lease(
                spec,
                part.activation_bytes,
                functools.partial(self._next_batch_s, spec, following),
                expected_s,
            ) as lease:
                run_items = finite_run(spec.key, with_stops(lease.model.run, part.requests))
                run = await self._executor.run(
                    run_items,
                    items,
                    expected_s,
                    lease.reservation.num_bytes,
                    across_models=stacks(lease.model),
                    bulk=all(r.bulk for r in part.requests),
                )
        except TesseraError as e:
            if isinstance(e, ModelUnavailableError | OverloadedError):
                return e  # no room, or no model: not the input's fault
            return _RunFailed(e)
        except Exception as e:
            return _RunFailed(e)
        if len(run.outputs) != len(items):
            return InferenceError(
                f"model {spec.key!r} returned {len(run.outputs)} outputs for {len(items)} inputs"
            )
        self._report(spec, formed_at, part, run)
        return None

    def _fail_part(self, spec: ModelSpec, part: BatchPart, error: BaseException) -> None:
        """Answer a part's requests with ``error``, as callers may see it (a
        runtime's own exception is logged, with the request ids, not shown)."""
        if isinstance(error, _RunFailed):
            cause = error.cause
            ids = ", ".join(r.request_id or "-" for r in part.requests)
            log.error("model %s failed on request(s) %s: %s", spec.key, ids, _cause(cause))
            log.debug("the failure's traceback", exc_info=cause)
            if isinstance(cause, TesseraError):
                error = cause  # raised on purpose, worded for the caller
            elif _out_of_memory(cause):
                error = ModelUnavailableError(
                    spec.key, "out of memory running this request", retry_after_s=1.0
                )
            else:
                error = InferenceError(
                    f"model {spec.key!r} failed on this request ({type(cause).__name__});"
                    " the cause is in the server log"
                )
        self._report_failure(spec, part, error)

    def _report(self, spec: ModelSpec, formed_at: float, part: BatchPart, run: BatchRun) -> None:
        """Hand a batch's outcome to the policies that learn from it, the
        counters and the sinks, and answer its callers."""
        num_items = len(run.outputs)
        if run.peak_bytes is not None and spec.runtime not in UNMEASURED_RUNTIMES:
            self._residency.observe_batch(spec.key, run.peak_bytes, part.peak_units)
        self._predictor(spec.key).observe(part.units, run.run_s)
        counters = self._counters[spec.key]
        counters.batch_ran(num_items, run.run_s)
        self._stats.on_batch(spec.key, num_items, run.run_s)
        start = 0
        for request in part.requests:
            end = start + len(request.items)
            request.charge.settle(_units_run(request, run.outputs[start:end]))
            if not request.future.done():
                queued_s = formed_at - request.arrival
                result = RequestResult(run.outputs[start:end], queued_s, run.run_s, num_items)
                request.future.set_result(result)
                counters.request_answered(queued_s, run.run_s)
            start = end

    def _report_failure(self, spec: ModelSpec, part: BatchPart, error: BaseException) -> None:
        counters = self._counters[spec.key]
        counters.num_failures += 1
        now = self.clock.now()
        for request in part.requests:
            request.charge.settle(0.0)  # a failed batch costs its callers nothing
            if not request.future.done():
                request.future.set_exception(error)
                counters.request_failed(now - request.arrival)


class _RunFailed(Exception):
    """The model raised ``cause`` while running a part (not the lease)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _input_may_be_at_fault(error: BaseException) -> bool:
    return isinstance(error, _RunFailed)


def _out_of_memory(error: BaseException) -> bool:
    # torch.cuda.OutOfMemoryError, named so that the engine imports no torch.
    return isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError"


def _cause(error: BaseException) -> str:
    error = error.cause if isinstance(error, _RunFailed) else error
    return f"{type(error).__name__}: {error}"


def _halves(part: BatchPart) -> list[BatchPart]:
    """``part``'s requests still awaited, in two parts of about equal count,
    each reserving its share of the part's activation bytes (by peak units)."""
    requests = [r for r in part.requests if not r.gone]
    middle = len(requests) // 2
    parts = []
    for group in (requests[:middle], requests[middle:]):
        peak = peak_units(group)
        share = peak / part.peak_units if part.peak_units else 0.0
        parts.append(
            BatchPart(
                tuple(group),
                sum(r.units for r in group),
                math.ceil(part.activation_bytes * share),
                peak,
            )
        )
    return parts


def _units_run(request: QueuedRequest, outputs: list[Any]) -> float:
    """What a request that ran is charged: a chat's prompt and generated tokens
    as its model counted them (fewer than admitted when it stopped early), any
    other request its work units."""
    if outputs and all(isinstance(o, ChatOutput) for o in outputs):
        return float(sum(o.prompt_tokens + o.completion_tokens for o in outputs))
    return request.units


def work_units_of(items: Sequence[Any], spec: ModelSpec) -> float:
    """The work units of items already checked against ``spec``'s limits."""
    return sum(work_units(item, spec.inputs) for item in items)


def _joined(whole: QueuedRequest, parts: list[QueuedRequest]) -> None:
    """Answer ``whole`` from its ``parts``: their outputs in order once every
    one is answered, the first failure as soon as one fails (the rest are
    then dropped, or stop at their next step: they share its stop flag); its
    charge is theirs, settled once every one's is. The caller cancelling
    ``whole`` drops the parts not yet run."""
    answered: list[RequestResult | None] = [None] * len(parts)
    charged: list[float | None] = [None] * len(parts)

    def part_done(index: int, future: asyncio.Future[RequestResult]) -> None:
        if whole.future.done():
            return
        if future.cancelled():
            whole.future.cancel()
        elif (error := future.exception()) is not None:
            whole.future.set_exception(error)
        else:
            answered[index] = future.result()
            if all(result is not None for result in answered):
                results = [r for r in answered if r is not None]
                began = min(r.queued_s for r in results)  # its first batch formed
                whole.future.set_result(
                    RequestResult(
                        [output for r in results for output in r.outputs],
                        began,
                        max(r.queued_s + r.run_s for r in results) - began,  # to its last's end
                        max(r.batch_size for r in results),
                    )
                )

    def part_charged(index: int, units: float) -> None:
        charged[index] = units
        if all(units is not None for units in charged):
            whole.charge.settle(sum(u for u in charged if u is not None))

    def whole_done(future: asyncio.Future[RequestResult]) -> None:
        for part in parts:
            if not part.future.done():
                part.future.cancel()  # dropped before it runs; one running stops at its step
            if not part.charge.started:
                part.charge.settle(0.0)  # never ran: costs nothing (as ``wait`` settles a whole)

    for index, part in enumerate(parts):
        part.future.add_done_callback(functools.partial(part_done, index))
        part.charge.when_settled(functools.partial(part_charged, index))
    whole.future.add_done_callback(whole_done)
