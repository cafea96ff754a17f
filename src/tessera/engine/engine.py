"""The engine: the repository, residency, one batcher per model, and the executor.

``Engine.infer`` is the whole core request path below the gateway: validate,
queue to the model's batcher, and await the result within the deadline.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tessera.admission import Admission, AdmissionController, TenantLimits
from tessera.batching import ModelBatcher, PendingRequest, make_queue
from tessera.clock import Clock, MonotonicClock
from tessera.device import Device, make_device
from tessera.errors import (
    DeadlineExceededError,
    InferenceError,
    InvalidInputError,
    PayloadTooLargeError,
    TaskMismatchError,
    TesseraError,
)
from tessera.metrics import NullSink, StatsSink
from tessera.repository import ModelRepository, ModelSpec
from tessera.residency import ResidencyManager, make_eviction_policy
from tessera.scheduling import BatchTimePredictor
from tessera.tasks.types import Task, work_units

from .executor import ComputeExecutor
from .host import EngineHost

log = logging.getLogger(__name__)

RECENT_BATCHES = 1024


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings, parsed once at start and passed down."""

    memory_budget_bytes: int | None = None  # None: the device's default share
    device: str = "auto"
    num_threads: int | None = None  # None: every core
    num_workers: int | None = None  # None: one per thread
    eviction_policy: str = "lru"
    max_queue: int = 100
    default_timeout_s: float = 60.0
    residency_wait_s: float = 30.0
    preload: tuple[str, ...] | None = None  # None: the models marked preload
    scheduling: str = "fair"  # fair | fifo
    # While two or more tenants use a model, cap a batch's predicted run time
    # here (the fair queue's quantum); None: full batches whatever the mix.
    fair_quantum_s: float | None = 0.025
    # Batches predicted to run this long (a page of OCR, a chat generation) run in
    # a lane of their own, so that they cannot hold every worker; None: one lane.
    long_batch_s: float | None = 0.5
    # Where loaders keep converted weights (a GGUF model's) between loads and
    # restarts; None: no cache.
    cache_dir: Path | None = None


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


@dataclass(frozen=True)
class Submission:
    """A queued request, and the admission to release once it is answered."""

    model: str
    request: PendingRequest
    admission: Admission | None


@dataclass
class ModelCounters:
    num_requests: int = 0
    num_items: int = 0
    num_batches: int = 0
    num_failures: int = 0
    # The most recent batches: (items, run seconds), for /admin/batches.
    recent_batches: deque[tuple[int, float]] = field(
        default_factory=lambda: deque(maxlen=RECENT_BATCHES)
    )


class Engine:
    def __init__(
        self,
        repository: ModelRepository,
        config: EngineConfig,
        *,
        clock: Clock | None = None,
        device: Device | None = None,
        stats: StatsSink | None = None,
    ) -> None:
        self.repository = repository
        self.config = config
        self.clock: Clock = clock or MonotonicClock()
        self.device = device or make_device(config.device)
        num_threads = config.num_threads or os.cpu_count() or 1
        num_workers = config.num_workers or num_threads
        self.executor = ComputeExecutor(
            self.device, num_threads, num_workers, long_batch_s=config.long_batch_s
        )
        self.stats: StatsSink = stats or NullSink()
        self.host = EngineHost(self.device, self.executor, self.stats, cache_dir=config.cache_dir)
        budget = config.memory_budget_bytes or self.device.default_budget_bytes()
        self.residency = ResidencyManager(
            budget,
            self.host,
            make_eviction_policy(config.eviction_policy),
            self.clock,
            wait_s=config.residency_wait_s,
        )
        self.counters: dict[str, ModelCounters] = {
            name: ModelCounters() for name in repository.names()
        }
        self._batchers: dict[str, ModelBatcher] = {}
        self.predictors: dict[str, BatchTimePredictor] = {}
        self.admission = AdmissionController(self.clock)
        self._preload_done = False
        self._preload_ok = False

    # -- lifecycle --------------------------------------------------------

    def preload_names(self) -> list[str]:
        if self.config.preload is not None:
            return list(self.config.preload)
        return [spec.name for spec in self.repository if spec.preload]

    async def preload(self, progress: PreloadProgress | None = None) -> None:
        """Load and warm the preload models; ``ready`` once all have."""
        names = self.preload_names()
        if progress is not None:
            progress.start(names)

        async def load(name: str) -> None:
            error: BaseException | None = None
            try:
                await self.residency.ensure_loaded(self.repository.get(name))
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
        self._preload_ok = not failures
        self._preload_done = True

    @property
    def ready(self) -> bool:
        return self._preload_done and self._preload_ok

    async def close(self) -> None:
        for batcher in self._batchers.values():
            await batcher.close()
        await self.residency.close()
        self.executor.shutdown()
        self.host.shutdown()

    # -- the request path ---------------------------------------------------

    def spec_for(self, name: str, task: Task) -> ModelSpec:
        spec = self.repository.get(name)
        if spec.task is not task:
            raise TaskMismatchError(f"model {name!r} does {spec.task.value}, not {task.value}")
        return spec

    def batcher(self, spec: ModelSpec) -> ModelBatcher:
        batcher = self._batchers.get(spec.name)
        if batcher is None:
            predictor = self.predictors.setdefault(spec.name, BatchTimePredictor())
            batcher = self._batchers[spec.name] = ModelBatcher(
                spec.name,
                spec.batching,
                functools.partial(self._execute, spec),
                self.clock,
                max_queue=self.config.max_queue,
                queue=make_queue(self.config.scheduling, predictor, self.config.fair_quantum_s),
                max_concurrent_batches=self.executor.num_workers,
            )
        return batcher

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
        spec = self.spec_for(name, task)
        if not items:
            raise InvalidInputError("input must not be empty")
        if len(items) > spec.max_inputs:
            raise PayloadTooLargeError(
                f"{len(items)} inputs in one request;"
                f" model {name!r} takes at most {spec.max_inputs}"
            )
        self.residency.raise_if_failed(name)
        units = sum(work_units(item) for item in items)
        admission = self.admission.admit(caller.limits, units) if caller is not None else None
        try:
            request = self._submit(spec, list(items), units, timeout_s, caller)
        except BaseException:
            if admission is not None:
                self.admission.release(admission)
            raise
        counters = self.counters.setdefault(name, ModelCounters())
        counters.num_requests += 1
        counters.num_items += len(items)
        return Submission(name, request, admission)

    async def wait(self, submission: Submission, trace: RequestTrace | None = None) -> list[Any]:
        """The outputs of a submitted request, within its deadline."""
        request = submission.request
        timeout = request.deadline - request.arrival if request.deadline else None
        try:
            return await self.clock.wait_for(request.future, timeout)
        except TimeoutError as e:
            raise DeadlineExceededError(
                f"no answer from model {submission.model!r} within {timeout:.3g}s"
            ) from e
        finally:
            if submission.admission is not None:
                self.admission.release(submission.admission)
            if trace is not None:
                trace.units = request.units
                trace.queued_s = request.queued_s
                trace.run_s = request.run_s
                trace.batch_size = request.batch_size

    def _submit(
        self,
        spec: ModelSpec,
        items: list[Any],
        units: float,
        timeout_s: float | None,
        caller: Caller | None,
    ) -> PendingRequest:
        now = self.clock.now()
        timeout = timeout_s if timeout_s is not None else self.config.default_timeout_s
        request = PendingRequest(
            items=items,
            units=units,
            arrival=now,
            future=asyncio.get_running_loop().create_future(),
            deadline=now + timeout,
        )
        if caller is not None:
            request.tenant = caller.tenant
            request.tier = caller.tier
            request.weight = caller.weight
            request.latency_target_s = caller.latency_target_s
        self.batcher(spec).submit(request)
        return request

    async def _execute(self, spec: ModelSpec, batch: list[PendingRequest]) -> None:
        """Run a batch; one whose measured activation room cannot fit beside the
        model in the budget runs as smaller batches, one after the other."""
        units = sum(request.units for request in batch)
        need = self.host.activation(spec.name).reserve_bytes(units)
        if len(batch) > 1 and need > self.residency.activation_room(spec):
            half = len(batch) // 2
            await self._execute(spec, batch[:half])
            await self._execute(spec, batch[half:])
            return
        await self._run(spec, batch, units, need)

    async def _run(
        self, spec: ModelSpec, batch: list[PendingRequest], units: float, activation_bytes: int
    ) -> None:
        items = [item for request in batch for item in request.items]
        stats = self.host.activation(spec.name)
        counters = self.counters.setdefault(spec.name, ModelCounters())
        try:
            predictor = self.predictors.get(spec.name)
            expected_s = predictor.predict(units) if predictor is not None else None
            async with self.residency.lease(spec, activation_bytes) as lease:
                run = await self.executor.run(lease.model.run, items, expected_s)
            if len(run.outputs) != len(items):
                raise InferenceError(
                    f"model {spec.name!r} returned {len(run.outputs)} outputs"
                    f" for {len(items)} inputs"
                )
        except TesseraError as e:
            counters.num_failures += 1
            _fail(batch, e)
            return
        except Exception as e:
            counters.num_failures += 1
            log.exception("batch of model %s failed", spec.name)
            _fail(batch, InferenceError(f"model {spec.name!r} failed: {type(e).__name__}: {e}"))
            return
        if run.peak_bytes is not None:
            stats.observe(run.peak_bytes, units)
        self.predictors.setdefault(spec.name, BatchTimePredictor()).observe(units, run.run_s)
        counters.num_batches += 1
        counters.recent_batches.append((len(items), run.run_s))
        self.stats.on_batch(spec.name, len(items), run.run_s)
        start = 0
        for request in batch:
            request.batch_size, request.run_s = len(items), run.run_s
            end = start + len(request.items)
            if not request.future.done():
                request.future.set_result(run.outputs[start:end])
            start = end

    def num_dropped(self, name: str) -> int:
        """Requests dropped before running: their caller had gone or their deadline passed."""
        batcher = self._batchers.get(name)
        return batcher.num_dropped if batcher is not None else 0

    def queue_depth(self, name: str) -> int:
        batcher = self._batchers.get(name)
        return batcher.depth if batcher is not None else 0


def _fail(batch: list[PendingRequest], error: Exception) -> None:
    for request in batch:
        if not request.future.done():
            request.future.set_exception(error)
