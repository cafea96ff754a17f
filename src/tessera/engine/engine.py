"""The engine: a loop of plan, execute, report over the policies below it.

Its face is a handful of calls: ``submit``/``wait`` (or ``infer``), ``load``,
``unload``, ``add_model``/``remove_model`` (the model lifecycle: versions
rolled out while serving, ``lifecycle.py``), ``snapshot()`` (one immutable
``EngineStats`` that every reader uses) and ``subscribe`` (stats sinks).
Nothing outside ``engine/`` reaches into its parts.

``Engine`` builds its parts and hands each call to the one that owns it:

- ``RequestIntake`` (``intake.py``): a request checked, priced and queued on
  its version's loop, or refused before it costs anything; the wait for its
  answer; the drain.
- ``ModelLoop`` (``step.py``), one per served version: the loop, per batch,
  of plan (the batcher's batch, residency's parts), execute (a lease and the
  compute executor) and report (the policies that learn, the counters, the
  callers' futures). One request's path from queue to answer is there.
- ``ModelLifecycle`` (``lifecycle.py``): the served versions, and rollouts
  and retirements while serving.
- ``startup.py`` (preload and fill) and ``snapshot.py`` (the stats).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tessera.admission import AdmissionControl, AdmissionController
from tessera.clock import Clock, MonotonicClock
from tessera.costs import CostLedger
from tessera.device import Device, default_host_budget_bytes, make_device
from tessera.metrics import (
    EngineStats,
    FanoutSink,
    ModelStats,
    RolloutStats,
    StatsSink,
    TenantCost,
)
from tessera.repository import ModelRepository, ModelSpec
from tessera.repository.watch import RepositoryWatcher
from tessera.residency import (
    MAX_HOST_LOADS,
    ActivationBook,
    ResidencyManager,
    make_eviction_policy,
)
from tessera.runtimes.base import ModelLoader
from tessera.tasks.types import Task

from .executor import ComputeExecutor, default_workers
from .host import EngineHost, runtime_totals, stage_key
from .intake import RequestIntake
from .lifecycle import (
    ModelLifecycle,
    ServedModel,
    served_spec,
    served_versions,
    spec_for_task,
)
from .loops import ModelLoops
from .snapshot import device_stats, model_stats
from .startup import start_models
from .step import StepPolicies
from .types import Caller, EngineConfig, PreloadProgress, RequestTrace, Submission


class Engine:
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
            max_host_loads=_max_host_loads(config, self._device),
            patience_share=config.eviction_patience,
        )
        # What each tenant costs (``tessera.costs``): read by the snapshot's
        # counters, drained by the audit log's writer of memory rows.
        self.costs = CostLedger()
        policies = StepPolicies(
            self._residency, self._executor, self._stats, self.clock, self._device.kind, self.costs
        )
        self._loops = ModelLoops(config, policies, functools.partial(stage_key, self._host))
        served: dict[str, ServedModel] = {}
        for name in repository.names():
            versions = repository.versions(name)
            served[name] = ServedModel({s.key: s for s in versions}, versions[-1].key)
            self._residency.register(versions)
            for spec in versions:
                self._loops.add(spec)
        # This process's counters, unless the gateways share theirs (in Redis).
        self._admission = admission if admission is not None else AdmissionController(self.clock)
        self._intake = RequestIntake(
            config, self.clock, self._residency, self._host, self._admission, self._loops
        )
        self._lifecycle = ModelLifecycle(
            served,
            clock=self.clock,
            residency=self._residency,
            host=self._host,
            loops=self._loops,
            requests=self._intake,
            engine_commands=config.engine_commands,
            drain_wait_s=config.default_timeout_s,
        )
        self._preload_done = False
        self._demand: dict[str, int] = {}  # ``seed_demand``

    # -- start and stop -----------------------------------------------------

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

    async def preload(self, progress: PreloadProgress | None = None) -> None:
        """Load and warm the preload models (``startup.py``); ``ready`` once each
        has loaded or failed (a failed one is that model's state, retried on demand)."""
        await start_models(
            self.config,
            self._residency,
            self._lifecycle.served,
            self.clock,
            self._demand,
            progress,
        )
        self._preload_done = True

    @property
    def phase(self) -> str:
        """``starting`` (preloading), ``ready``, or ``draining`` (stopping)."""
        if self._intake.draining:
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
        return await self._intake.drain(grace_s)

    async def close(self) -> None:
        """Fail what still waits, wait for running batches, unload every model
        and stop the workers (a load still running unloads itself at its end)."""
        await self._loops.close()
        self._host.begin_close()
        await self._residency.close()
        self._executor.shutdown()
        self._host.shutdown()
        if self._switch_interval_before is not None:
            sys.setswitchinterval(self._switch_interval_before)

    # -- models ---------------------------------------------------------------

    async def load(self, name: str) -> ModelStats:
        """Load model ``name`` now (if it is not resident) and return its stats."""
        spec = self.spec(name)
        await self._residency.ensure_loaded(spec)
        held = {m.name: m for m in self._residency.stats().models}
        return model_stats(
            spec,
            self._loops[spec.key],
            self._residency,
            held,
            self._host,
            self._loops.queue_depths()[spec.key],
            current=_is_current(self._lifecycle.served, spec),
        )

    async def unload(self, name: str) -> bool:
        """Unload model ``name`` once idle; False if it was not loaded."""
        return await self._residency.unload(self.spec(name).key)

    async def add_model(self, folder: Path, via_api: bool = False) -> list[RolloutStats]:
        """Register the model in ``folder`` or roll out its new versions
        (``ModelLifecycle.add_model``)."""
        return await self._lifecycle.add_model(folder, via_api)

    async def remove_model(self, name: str) -> int:
        """Retire model ``name``; the bytes of the budget freed."""
        return await self._lifecycle.remove_model(name)

    async def watch_repository(self, watcher: RepositoryWatcher, interval_s: float) -> None:
        """Until cancelled: roll out what ``watcher`` finds changed, every ``interval_s``."""
        await self._lifecycle.watch_repository(watcher, interval_s)

    # -- what every reader sees -------------------------------------------

    @property
    def device_kind(self) -> str:
        """``cpu`` or ``cuda``."""
        return self._device.kind

    def snapshot(
        self, batches_since: Mapping[str, int] | None = None, *, with_costs: bool = True
    ) -> EngineStats:
        """The engine at this instant, as one immutable object.

        ``batches_since`` (model version -> its ``num_batches`` in an earlier
        snapshot): each model's ``recent_batches`` holds only the batches run
        after that count (the engine process's pushes to its gateways, which
        keep the windows themselves and need only what is new).
        ``with_costs``: each tenant's costs too (left out of those pushes: a
        gateway forwards ``/metrics`` and ``/admin`` to the engine process)."""
        residency = self._residency.stats()
        held = {m.name: m for m in residency.models}
        self.costs.held({m.name: m.bytes for m in residency.models}, self.clock.now())
        runtimes = runtime_totals()
        since = batches_since or {}
        queues = self._loops.queue_depths()
        versions = self._lifecycle.staged_versions()
        for served in self._lifecycle.served.values():
            versions.update(served.specs)
        return EngineStats(
            device_name=self._device.name,
            device=device_stats(self._device),
            budget_bytes=residency.budget_bytes,
            used_bytes=residency.used_bytes,
            peak_used_bytes=residency.peak_used_bytes,
            loads_total=residency.loads_total,
            evictions_total=residency.evictions_total,
            host_budget_bytes=residency.host_budget_bytes,
            host_used_bytes=residency.host_used_bytes,
            host_loads_total=residency.host_loads_total,
            host_drops_total=residency.host_drops_total,
            host_copies_out_total=runtimes.host_copies_out,
            host_copies_kept_total=runtimes.host_copies_kept,
            num_workers=self._executor.num_workers,
            threads_per_worker=self._executor.threads_per_worker,
            ready=self.ready,
            models=tuple(
                model_stats(
                    spec,
                    self._loops[key],
                    self._residency,
                    held,
                    self._host,
                    queues[key],
                    current=_is_current(self._lifecycle.served, spec),
                    batches_since=since.get(key, 0),
                )
                for key, spec in sorted(versions.items())
            ),
            rollouts=self._lifecycle.recent_rollouts(),
            rollouts_total=self._lifecycle.rollout_counts(),
            stacked_rounds_total=runtimes.stacked_rounds,
            stacked_batches_total=runtimes.stacked_batches,
            encoder_batches_total=sum(g.num_batches for g in self._loops.groups()),
            encoder_rows_total=sum(g.num_rows for g in self._loops.groups()),
            admission_degraded=self._admission.degraded,
            tenant_costs=tuple(
                TenantCost(tenant, model, cost.device_s, cost.byte_s)
                for (tenant, model), cost in sorted(self.costs.totals().items())
            )
            if with_costs
            else (),
        )

    def model_names(self) -> list[str]:
        """The models served now, by name."""
        return sorted(self._lifecycle.served)

    def served_models(self) -> dict[str, ServedModel]:
        """Each model's served versions, as of now (a copy)."""
        return {
            name: ServedModel(dict(s.specs), s.current)
            for name, s in self._lifecycle.served.items()
        }

    def versions(self, name: str) -> list[ModelSpec]:
        """The versions of model ``name`` served now, oldest first."""
        return served_versions(self._lifecycle.served, name)

    def spec(self, name: str) -> ModelSpec:
        """The version ``name`` names: ``model`` (its current version) or
        ``model@version`` (that version, while it is served)."""
        return served_spec(self._lifecycle.served, name)

    def spec_for(self, name: str, task: Task) -> ModelSpec:
        return spec_for_task(self.spec(name), name, task)

    # -- the request path ---------------------------------------------------

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
        return self._intake.submit(self.spec_for(name, task), items, timeout_s, caller)

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

    async def wait(self, submission: Submission, trace: RequestTrace | None = None) -> list[Any]:
        """The outputs of a submitted request, within its deadline. If it ends
        without them (the caller gone, the deadline passed, a failure), its work
        is told to stop at its next step, and costs nothing if it never began."""
        return await self._intake.wait(submission, trace)


def _max_host_loads(config: EngineConfig, device: Device) -> int:
    """Loads from the host tier in flight at once: the config's, else
    ``MAX_HOST_LOADS`` on CUDA (copies back one at a time on a copy stream)
    and no bound (0) on the CPU."""
    if config.max_host_loads is not None:
        return config.max_host_loads
    return MAX_HOST_LOADS if device.kind == "cuda" else 0


def _is_current(served: Mapping[str, ServedModel], spec: ModelSpec) -> bool:
    """Whether ``spec`` is the version its model's requests naming none get."""
    model = served.get(spec.name)
    return model is not None and model.current == spec.key
