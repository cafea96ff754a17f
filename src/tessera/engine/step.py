"""The engine's loop: one per served version, plan, execute, report.

One batch, from queue to answer, in the order ``ModelLoop`` runs it:

1. plan: the batcher (batching, over the fair queue of scheduling) forms the
   next batch once a slot is free (``ModelBatcher.next_batch``); the step
   asks residency whether it runs whole or in parts that each fit the budget
   (``ResidencyManager.plan_batch``).
2. execute: each part leases the model and room for its activations
   (``ResidencyManager.lease``) and runs on the compute executor, with a
   share of its tightest latency target as its wait limit for a compute slot
   (``slot_wait_limit_s``); the outcome is data (``PartOutcome``: the run, or
   what failed), nothing answered yet.
3. report: a run goes to the policies that learn from it (residency's
   activation peaks, the run-time predictor), the counters and the sinks,
   and answers its callers; a failure that may be one input's is retried in
   halves (``_recover``), any other answers the part's callers with it.
4. the batch gives its slot back (``ModelBatcher.finished``).

Invariants: every request of a batch is answered or failed by its step (none
waits for its deadline because its batch failed); a version whose
predecessor still has requests (``ModelLoops.hold``) starts no batch until
they are answered; the loop runs in a context of its own, not that of the
request that started it (whose id would mark every later batch's log lines).

An encoder group's loop (``groups.py``) runs batches of several head models'
requests the same way, and hands each model's rows to that model's loop:
``answer`` (its counters, sinks, costs and callers), or ``run`` and
``recover`` for the rows that could not run with the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tessera.batching import ModelBatcher
from tessera.clock import Clock
from tessera.costs import CostLedger
from tessera.errors import InferenceError, ModelUnavailableError, OverloadedError, TesseraError
from tessera.metrics import StatsSink
from tessera.repository.spec import ModelSpec
from tessera.request import Batch, QueuedRequest, RequestResult, with_stops
from tessera.residency import BatchPart, ResidencyManager, peak_units
from tessera.runtimes.base import LoadedModel, runs_remotely, stacks
from tessera.scheduling import BatchTimePredictor
from tessera.tasks.finiteness import finite_run
from tessera.tasks.types import ChatOutput

from .counters import ModelCounters
from .executor import BatchRun, ComputeExecutor
from .host import UNMEASURED_RUNTIMES

log = logging.getLogger(__name__)

# A short batch waits for a compute slot behind owed long work at most this
# share of the tightest latency target among its requests, then takes one
# beyond it (``scheduling/slot.py``: overdue). A quarter, as the fair queue
# caps batches while a latency tier is active (LATENCY_SHARE_WHILE_ACTIVE):
# the rest of the target is the request's wait for its batch, the batch's
# own run and the round trip. With two slots and owed OCR on one, a MiniLM
# batch with a 200 ms target otherwise waited 150 ms and more behind one
# speech or chat batch.
SLOT_WAIT_SHARE = 0.25


@dataclass(frozen=True)
class StepPolicies:
    """What every step asks and reports to, whatever its model."""

    residency: ResidencyManager
    executor: ComputeExecutor
    stats: StatsSink
    clock: Clock
    device_kind: str
    costs: CostLedger


@dataclass(frozen=True)
class PartOutcome:
    """A part's execution: its ``run``, or the ``error`` it ended with."""

    run: BatchRun | None = None
    error: BaseException | None = None


class BatchLoop:
    """Drives a batcher: each batch it forms runs as a step of its own
    (``_step``), in a context of its own, until closed."""

    def __init__(self, batcher: ModelBatcher, task_name: str) -> None:
        self.batcher = batcher
        self._task_name = task_name
        self._task: asyncio.Task[None] | None = None
        self._steps: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Serve the batcher's batches from now on (once; a context of its own)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._serve(), name=self._task_name, context=contextvars.Context()
            )

    async def close(self) -> None:
        """Stop forming batches, fail what waits, and wait for the running steps."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.batcher.close()
        if self._steps:
            await asyncio.gather(*self._steps, return_exceptions=True)

    async def _serve(self) -> None:
        """Until closed: each batch the batcher forms runs as a step of its own."""
        while True:
            batch = await self.batcher.next_batch()
            step = asyncio.get_running_loop().create_task(self._step(batch))
            self._steps.add(step)
            step.add_done_callback(self._steps.discard)

    async def _step(self, batch: Batch) -> None:
        raise NotImplementedError


class ModelLoop(BatchLoop):
    """One served version's batcher, run-time predictor, counters and loop."""

    def __init__(
        self,
        spec: ModelSpec,
        batcher: ModelBatcher,
        predictor: BatchTimePredictor,
        policies: StepPolicies,
    ) -> None:
        super().__init__(batcher, f"model-loop:{spec.key}")
        self.spec = spec
        self.predictor = predictor
        self.counters = ModelCounters()
        self.policies = policies
        # Requests queued on this version and not answered yet.
        self.pending: set[QueuedRequest] = set()
        # Set while the version this one replaces still answers its requests.
        self.gate: asyncio.Event | None = None

    async def _step(self, batch: Batch) -> None:
        """Run ``batch`` (``run``), then give its slot back."""
        try:
            if self.gate is not None:  # a new version: its predecessor answers first
                await self.gate.wait()
            await self.run(batch.formed_at, batch.requests)
        finally:
            self.batcher.finished(batch)

    async def run(self, formed_at: float, requests: list[QueuedRequest]) -> None:
        """Plan ``requests`` (a batch formed at ``formed_at``) into parts,
        execute each and report its outcome: each request answered or failed."""
        try:
            plan = self.policies.residency.plan_batch(self.spec, requests)
        except Exception as e:  # answered, not left to wait for their deadlines
            log.error("no plan for a batch of model %s: %s: %s", self.spec.key, type(e).__name__, e)
            whole = BatchPart(tuple(requests), 0.0, 0, 0.0)
            self._fail(whole, InferenceError(f"model {self.spec.key!r} failed"))
            return
        for part, following in _with_following(plan):
            outcome = await self._execute(part, following)
            if outcome.run is not None:
                self._report(formed_at, part, outcome.run)
            elif outcome.error is not None:
                await self._recover(formed_at, part, outcome.error)

    async def recover(
        self, formed_at: float, requests: list[QueuedRequest], cause: BaseException
    ) -> None:
        """Answer ``requests``, whose run on this model raised ``cause``, as a
        failed part of its own batch is (``_recover``): retried in halves."""
        for part in self.policies.residency.plan_batch(self.spec, requests):
            await self._recover(formed_at, part, _RunFailed(cause))

    async def _execute(self, part: BatchPart, following: BatchPart | None = None) -> PartOutcome:
        """Lease the model and run ``part`` on it. ``following``: the next part
        of its batch. When there is one, or requests are queued, the lease may
        keep its room for that next batch (``ResidencyManager.release``) for as
        long as that batch is predicted to take (``_next_batch_s``), not this
        part's time."""
        items = [item for request in part.requests for item in request.items]
        key = self.spec.key
        try:
            expected_s = self.predictor.predict(part.units)
            async with self.policies.residency.lease(
                self.spec,
                part.activation_bytes,
                functools.partial(self._next_batch_s, following),
                expected_s,
            ) as lease:
                reported: list[float] = []
                runner = _runner(lease.model, reported)
                run_items = finite_run(key, with_stops(runner, part.requests))
                run = await self.policies.executor.run(
                    run_items,
                    items,
                    expected_s,
                    lease.reservation.num_bytes,
                    across_models=stacks(lease.model),
                    bulk=all(r.bulk for r in part.requests),
                    wait_limit_s=slot_wait_limit_s([self.spec], part.requests),
                )
        except TesseraError as e:
            if isinstance(e, ModelUnavailableError | OverloadedError):
                return PartOutcome(error=e)  # no room, or no model: not the input's fault
            return PartOutcome(error=_RunFailed(e))
        except Exception as e:
            return PartOutcome(error=_RunFailed(e))
        if len(run.outputs) != len(items):
            return PartOutcome(
                error=InferenceError(
                    f"model {key!r} returned {len(run.outputs)} outputs for {len(items)} inputs"
                )
            )
        if reported:  # run elsewhere: the device time is that engine's
            run = dataclasses.replace(run, reported_s=sum(reported))
        return PartOutcome(run=run)

    def _next_batch_s(self, following: BatchPart | None) -> float | None:
        """The predicted seconds of the model's next batch: ``following`` (the
        next part of this batch), else the batch its queue would form now;
        None where there is none, or its batch times are not known yet."""
        units = following.units if following is not None else self.batcher.next_batch_units()
        return None if units is None else self.predictor.predict(units)

    async def _recover(self, formed_at: float, part: BatchPart, error: BaseException) -> None:
        """Answer a failed part: retried in halves while the fault may be one
        input's (an out-of-memory error too: a half needs half the bytes), a
        half that fails while its sibling succeeds halved again, so one
        poisoned input fails only its own request and its neighbours, other
        tenants' included, are answered. When both halves fail the fault is
        the model's: both fail without more retries, so a broken model costs
        three runs per batch, not one per request."""
        if len(part.requests) <= 1 or not isinstance(error, _RunFailed):
            self._fail(part, _caller_error(self.spec, part, error))
            return
        log.warning(
            "batch of model %s (%d requests) failed, retried in halves: %s",
            self.spec.key,
            len(part.requests),
            _cause(error),
        )
        await self._bisect(formed_at, part)

    async def _bisect(self, formed_at: float, part: BatchPart) -> None:
        for request in part.requests:
            if request.gone:  # its caller left: not retried, and its failed run costs nothing
                request.charge.settle(0.0)
        failed = []
        for half in _halves(part):
            outcome = await self._execute(half)
            if outcome.run is not None:
                self._report(formed_at, half, outcome.run)
            elif outcome.error is not None:
                failed.append((half, outcome.error))
        for half, half_error in failed:
            if len(failed) == 1 and len(half.requests) > 1 and isinstance(half_error, _RunFailed):
                await self._bisect(formed_at, half)
            else:
                self._fail(half, _caller_error(self.spec, half, half_error))

    def _report(self, formed_at: float, part: BatchPart, run: BatchRun) -> None:
        """Hand a part's run to the policies that learn from it, then count
        it and answer its callers (``answer``)."""
        if run.peak_bytes is not None and self.spec.runtime not in UNMEASURED_RUNTIMES:
            self.policies.residency.observe_batch(self.spec.key, run.peak_bytes, part.peak_units)
        self.predictor.observe(part.units, run.run_s)
        self.answer(formed_at, list(part.requests), run.outputs, run.device_s, run)

    def answer(
        self,
        formed_at: float,
        requests: list[QueuedRequest],
        outputs: list[Any],
        device_s: float,
        run: BatchRun,
    ) -> None:
        """Count ``requests``' share of a batch that ran (``run``: this
        model's, or an encoder group's, ``engine/groups.py``) in the counters
        and the sinks, split ``device_s`` of its time among them by their units
        (the cost ledger), settle each one's charge, and answer each with its
        ``outputs`` (theirs, in order)."""
        key = self.spec.key
        num_items = len(outputs)
        self.counters.batch_ran(num_items, run.run_s)
        self.policies.stats.on_batch(key, num_items, run.run_s)
        units, start = [], 0
        for request in requests:
            units.append(_units_run(request, outputs[start : start + len(request.items)]))
            start += len(request.items)
        shares = self.policies.costs.batch_ran(
            key,
            device_s,
            [(r.tenant, u) for r, u in zip(requests, units, strict=True)],
            self.policies.clock.now(),
        )
        start, batch_size = 0, len(run.outputs)
        for request, charged, share_s in zip(requests, units, shares, strict=True):
            end = start + len(request.items)
            request.charge.device_s += share_s
            request.charge.settle(charged)
            if not request.future.done():
                queued_s = formed_at - request.arrival
                result = RequestResult(outputs[start:end], queued_s, run.run_s, batch_size)
                request.future.set_result(result)
                self.counters.request_answered(queued_s, run.run_s)
            start = end

    def fail(self, requests: list[QueuedRequest], error: BaseException) -> None:
        """Answer ``requests`` with ``error``: a failed part of their batch."""
        self._fail(BatchPart(tuple(requests), 0.0, 0, 0.0), error)

    def _fail(self, part: BatchPart, error: BaseException) -> None:
        """Answer a part's callers with ``error``; a failed part costs them nothing."""
        self.counters.num_failures += 1
        now = self.policies.clock.now()
        for request in part.requests:
            request.charge.settle(0.0)
            if not request.future.done():
                request.future.set_exception(error)
                self.counters.request_failed(now - request.arrival)


def _runner(model: LoadedModel, reported: list[float]) -> Callable[[Sequence[Any]], list[Any]]:
    """``model``'s run as the executor calls it; a model whose batches run
    elsewhere (``RemoteModel``) runs them with ``run_remote``, and the
    device-seconds its engine reports for each call go to ``reported``."""
    if not runs_remotely(model):
        return model.run
    remote = model

    def run(items: Sequence[Any]) -> list[Any]:
        answer = remote.run_remote(items)
        reported.append(answer.device_s)
        return answer.outputs

    return run


def slot_wait_limit_s(
    specs: Iterable[ModelSpec], requests: Iterable[QueuedRequest]
) -> float | None:
    """How long a batch of ``requests`` for the models ``specs`` waits for a
    compute slot before it is overdue: ``SLOT_WAIT_SHARE`` of the tightest
    latency target among the models' (``latency_target_ms``) and the requests'
    tiers' (``latency_target_s``); None where none has a target."""
    targets = [s.latency_target_ms / 1000 for s in specs if s.latency_target_ms is not None]
    targets += [r.latency_target_s for r in requests if r.latency_target_s is not None]
    return min(targets) * SLOT_WAIT_SHARE if targets else None


def _with_following(plan: list[BatchPart]) -> Iterator[tuple[BatchPart, BatchPart | None]]:
    """Each part of a plan, with the part after it (None for the last)."""
    for i, part in enumerate(plan):
        yield part, plan[i + 1] if i + 1 < len(plan) else None


class _RunFailed(Exception):
    """The model raised ``cause`` while running a part (not the lease): the
    fault may be one input's."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _caller_error(spec: ModelSpec, part: BatchPart, error: BaseException) -> BaseException:
    """``error`` as the part's callers may see it: a runtime's own exception
    is logged, with the request ids, not shown."""
    if not isinstance(error, _RunFailed):
        return error
    cause = error.cause
    ids = ", ".join(r.request_id or "-" for r in part.requests)
    log.error("model %s failed on request(s) %s: %s", spec.key, ids, _cause(cause))
    log.debug("the failure's traceback", exc_info=cause)
    if isinstance(cause, TesseraError):
        return cause  # raised on purpose, worded for the caller
    if _out_of_memory(cause):
        return ModelUnavailableError(
            spec.key, "out of memory running this request", retry_after_s=1.0
        )
    return InferenceError(
        f"model {spec.key!r} failed on this request ({type(cause).__name__});"
        " the cause is in the server log"
    )


def _out_of_memory(error: BaseException) -> bool:
    # torch.cuda.OutOfMemoryError, named so that the engine imports no torch.
    return isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError"


def _cause(error: BaseException) -> str:
    error = error.cause if isinstance(error, _RunFailed) else error
    return f"{type(error).__name__}: {error}"


def _halves(part: BatchPart) -> list[BatchPart]:
    """``part``'s requests still awaited, in two parts of about equal count
    (empty ones left out), each reserving its share of the part's activation
    bytes (by peak units)."""
    requests = [r for r in part.requests if not r.gone]
    middle = len(requests) // 2
    parts = []
    for group in (requests[:middle], requests[middle:]):
        if not group:
            continue
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
