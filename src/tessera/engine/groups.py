"""Encoder batching: one batch through a shared encoder for the requests of
many models, each row then through its own model's head.

Many small fine-tuned heads over one base encoder (a classifier a tenant, a
product) is the common many-model case; with traffic spread over a thousand
of them, each model's own batches hold one request. Models whose first stage
is the same (a head model's ``stage_key``: the encoder's weights, tokenizer,
precision, window and readout; ``runtimes/heads.py``) form an *encoder
group*: one ``ModelBatcher`` over one queue (the fair queue: per tenant) for
the requests of all of them, one run-time predictor (their members' loops
share it), and a loop that runs each batch as a model's own loop does
(``step.py``), in three steps with data between them:

1. plan (``_plan``): the batch's requests in order of their models (each
   model's rows together), in parts that fit the budget
   (``ResidencyManager.plan_batch``, by the activations of one member: every
   member's are the shared encoder's), each with its *lead*: a model of the
   part ready on the device where one is.
2. execute (``_execute``): the part's models not on the device are loaded
   first, together, holding no pin (``_warm``). Then the lead's lease
   reserves the part's activation bytes; it may wait, load or evict, and
   holds no other pin meanwhile.
   Every other model of the part that is ready is then pinned, with no
   activation bytes, which never waits (``ResidencyManager._reserve``). One
   compute call runs the first stage over all the pinned models' rows and
   each model's head over its own (``run_heads``); a head that raises or
   answers numbers that are not finite marks only its rows (``HeadFailed``).
   The outcome is a ``GroupOutcome``; every pin is released before the step
   goes on.
3. report (``_report``): the run goes to the group's predictor and to each
   model's activation peaks; each model's rows are counted and answered by
   its own loop (``ModelLoop.answer``: its counters, sinks and cost-ledger
   rows), the batch's device time split among all rows by their units. What
   did not run together is handed back as data: the rows of a model that was
   not ready (or not a head of this stage once loaded) and every row of a
   shared run that raised run on their model's own path (``ModelLoop.run``,
   which retries in halves, so a poisoned input fails only its own
   request); the rows of a failed head are retried in halves on it
   (``ModelLoop.recover``).

Invariants: every request of a batch is answered or failed by its step; a
step never waits for room or a load while it holds a pin, so two steps never
hold each other's models (no deadlock), and no model whose rows a run holds
is evicted before the run ends (each is pinned); fairness is the fair
queue's, across the tenants of the group's requests (a tenant's use of the
shared encoder counts whichever of its models it asks); deadlines and
cancellation are the batcher's, per request; each model's counters, metrics,
audit rows and costs stay its own, through its loop. A request's model is
``QueuedRequest.model``; a request whose model left the group before its
batch ran is failed, as its model is gone.

Which requests queue here: a member's, while the group has two members or
more and the member is not held behind the version it replaces
(``ModelLoops.hold``); else its model's own queue, as without groups
(``loops.ModelLoops.submit``). The engine's ``encoder_batching: false``
makes no group.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tessera.batching import ModelBatcher
from tessera.errors import InferenceError, ModelUnavailableError, OverloadedError
from tessera.repository.spec import BatchingSpec
from tessera.request import Batch, QueuedRequest, with_stops
from tessera.residency import BatchPart, Lease, ModelState, peak_units
from tessera.runtimes.base import EncoderHead, is_encoder_head
from tessera.scheduling import BatchTimePredictor
from tessera.tasks.finiteness import check_finite

from .executor import BatchRun
from .step import BatchLoop, ModelLoop, StepPolicies, slot_wait_limit_s

log = logging.getLogger(__name__)

READY = ModelState.READY


@dataclass(frozen=True, slots=True)
class Rows:
    """One model's requests in a part of a group's batch."""

    loop: ModelLoop
    requests: tuple[QueuedRequest, ...]

    @property
    def num_items(self) -> int:
        return sum(len(r.items) for r in self.requests)


@dataclass(frozen=True, slots=True)
class GroupPart:
    """A part of a group's batch: its requests and reservation (``part``),
    the same requests by model (``rows``), and the model whose lease holds
    the reservation (``lead``)."""

    part: BatchPart
    rows: tuple[Rows, ...]
    lead: ModelLoop


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    """A part's execution: the rows that ran together (``ran``) and their
    ``run`` (one output per item, a failed head's rows ``HeadFailed``), the
    rows to run on their own model's path (``alone``), or an ``error`` that
    fails every row (no room)."""

    ran: tuple[Rows, ...] = ()
    run: BatchRun | None = None
    alone: tuple[Rows, ...] = ()
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class HeadFailed:
    """The output of each row whose model's head raised ``error`` (or
    answered numbers that are not finite)."""

    error: BaseException


def run_heads(
    first: EncoderHead, heads: Sequence[tuple[str, EncoderHead, int]], items: Sequence[Any]
) -> list[Any]:
    """The first stage over ``items`` (``first``'s: any model of the stage),
    then each of ``heads`` (model key, model, its rows' count, in the
    items' order) over its rows' vectors: one output per item, a failed
    head's rows ``HeadFailed``. Runs on a compute worker."""
    vectors = first.vectors(items)
    outputs: list[Any] = []
    start = 0
    for key, model, count in heads:
        rows = vectors[start : start + count]
        start += count
        try:
            answered = model.head(rows)
            if len(answered) != count:
                raise InferenceError(
                    f"model {key!r} returned {len(answered)} outputs for {count} inputs"
                )
            check_finite(key, answered)
        except Exception as e:  # its rows only: the other heads' answers stand
            answered = [HeadFailed(e)] * count
        outputs.extend(answered)
    return outputs


def merged_batching(limits: Iterable[BatchingSpec]) -> BatchingSpec:
    """A batch of several models' requests within every one's card: the
    smallest of each bound, and the fewest batches at once any card fixes
    (None where none does)."""
    specs = list(limits)
    fixed = [b.max_concurrent_batches for b in specs if b.max_concurrent_batches is not None]
    return BatchingSpec(
        max_batch_size=min(b.max_batch_size for b in specs),
        max_batch_units=min(b.max_batch_units for b in specs),
        max_wait_ms=min(b.max_wait_ms for b in specs),
        max_concurrent_batches=min(fixed) if fixed else None,
    )


def by_model(requests: Iterable[QueuedRequest]) -> dict[str, list[QueuedRequest]]:
    """``requests`` by model, models in the order of their first request,
    each model's in their order."""
    out: dict[str, list[QueuedRequest]] = {}
    for request in requests:
        out.setdefault(request.model, []).append(request)
    return out


class EncoderGroup(BatchLoop):
    """The models of one stage key: their shared queue, predictor and loop
    (module notes)."""

    def __init__(
        self,
        key: str,
        batcher: ModelBatcher,
        predictor: BatchTimePredictor,
        policies: StepPolicies,
        max_queue: int,
    ) -> None:
        super().__init__(batcher, f"encoder-group:{key}")
        self.key = key
        self.predictor = predictor
        self.policies = policies
        self.max_queue = max_queue  # each member's bound, as its own queue's
        self.members: dict[str, ModelLoop] = {}
        self.num_batches = 0  # batches run through the shared stage
        self.num_rows = 0  # their items

    # -- members and requests ----------------------------------------------------

    def join(self, loop: ModelLoop) -> None:
        self.members[loop.spec.key] = loop
        self._limits()

    def leave(self, key: str) -> None:
        if self.members.pop(key, None) is not None and self.members:
            self._limits()

    def _limits(self) -> None:
        """The batcher's limits as its members' cards allow together."""
        self.batcher.batching = merged_batching(m.spec.batching for m in self.members.values())
        self.batcher.max_queue = self.max_queue * len(self.members)

    def takes(self, loop: ModelLoop) -> bool:
        """Whether ``loop``'s requests queue here now (module notes)."""
        return len(self.members) > 1 and loop.gate is None and loop.spec.key in self.members

    def submit(self, loop: ModelLoop, request: QueuedRequest, *, counted: bool = True) -> None:
        """Queue ``loop``'s ``request``; ``OverloadedError`` where its model
        has ``max_queue`` requests waiting or running already, or the group's
        batcher refuses it (its predicted wait passes its deadline)."""
        if counted and len(loop.pending) >= self.max_queue:
            raise OverloadedError(
                f"queue of model {loop.spec.key!r} is full ({self.max_queue} requests)",
                retry_after_s=1.0,
            )
        self.batcher.submit(request, counted=counted)
        self.start()

    # -- the loop ----------------------------------------------------------------

    async def _step(self, batch: Batch) -> None:
        """Plan ``batch`` into parts, execute each, report its outcome, and
        run on their own models what did not run together."""
        formed_at = batch.formed_at
        try:
            for part in self._plan(batch.requests):
                outcome = await self._execute(part)
                for rows, cause in self._report(formed_at, part, outcome):
                    requests = list(rows.requests)
                    if cause is None:
                        await rows.loop.run(formed_at, requests)
                    else:
                        await rows.loop.recover(formed_at, requests, cause)
        finally:
            self.batcher.finished(batch)

    def _plan(self, requests: list[QueuedRequest]) -> list[GroupPart]:
        """The batch's parts (module notes); a request of a model no longer
        in the group is failed here, as is every request of a batch that
        cannot be planned."""
        models = by_model(r for r in requests if not r.gone)
        for key in [k for k in models if k not in self.members]:
            for request in models.pop(key):
                _gone_model(request)
        if not models:
            return []
        ordered = [request for queued in models.values() for request in queued]
        planner = self._lead(list(models))
        try:
            plan = self.policies.residency.plan_batch(planner.spec, ordered)
        except Exception as e:  # answered, not left to wait for their deadlines
            log.error("no plan for a batch of encoder group %s: %s", self.key, e)
            for key, queued in models.items():
                self.members[key].fail(queued, InferenceError(f"model {key!r} failed"))
            return []
        parts = []
        for part in plan:
            rows = tuple(
                Rows(self.members[key], tuple(queued))
                for key, queued in by_model(part.requests).items()
            )
            parts.append(GroupPart(part, rows, self._lead([r.loop.spec.key for r in rows])))
        return parts

    def _lead(self, keys: list[str]) -> ModelLoop:
        """Of the models ``keys`` names, the first ready on the device, else the first."""
        state = self.policies.residency.state
        ready = (k for k in keys if state(k) is READY)
        return self.members[next(ready, keys[0])]

    async def _execute(self, part: GroupPart) -> GroupOutcome:
        """Lease the part's models and run their rows together (module notes)."""
        residency = self.policies.residency
        await self._warm(part)
        expected_s = self.predictor.predict(part.part.units)
        try:
            lead = await residency.acquire(part.lead.spec, part.part.activation_bytes, expected_s)
        except OverloadedError as e:  # no room: as a model's own batch, failed
            return GroupOutcome(error=e)
        except Exception:  # not loaded (its load failed...): each model's own path says why
            return GroupOutcome(alone=part.rows)
        leases = [lead]
        try:
            ran: list[Rows] = []
            alone: list[Rows] = []
            heads: list[tuple[str, EncoderHead, int]] = []
            for rows in part.rows:
                lease = lead if rows.loop is part.lead else await self._pin(rows.loop)
                model = lease.model if lease is not None else None
                if lease is not None and lease is not lead:
                    leases.append(lease)
                if model is None or not is_encoder_head(model) or model.stage_key != self.key:
                    alone.append(rows)
                    continue
                ran.append(rows)
                heads.append((rows.loop.spec.key, model, rows.num_items))
            if not ran:
                return GroupOutcome(alone=tuple(alone))
            requests = [r for rows in ran for r in rows.requests]
            items = [item for r in requests for item in r.items]
            run_fn = with_stops(functools.partial(run_heads, heads[0][1], heads), requests)
            try:
                run = await self.policies.executor.run(
                    run_fn,
                    items,
                    expected_s,
                    lead.reservation.num_bytes,
                    bulk=all(r.bulk for r in requests),
                    wait_limit_s=slot_wait_limit_s([r.loop.spec for r in ran], requests),
                )
            except Exception as e:  # each model's own path finds the input at fault
                log.warning(
                    "a batch of encoder group %s (%d models) failed; each model's rows"
                    " run on their own: %s: %s",
                    self.key,
                    len(ran),
                    type(e).__name__,
                    e,
                )
                return GroupOutcome(alone=(*alone, *ran))
            return GroupOutcome(tuple(ran), run, tuple(alone))
        finally:
            for lease in leases:
                residency.release(lease)

    async def _warm(self, part: GroupPart) -> None:
        """Load the part's models not on the device, together, holding no pin:
        a model whose load fails, or that is evicted again before its pin,
        runs its rows on its own path, which says why."""
        residency = self.policies.residency
        cold = [r.loop.spec for r in part.rows if residency.state(r.loop.spec.key) is not READY]
        if cold:
            await asyncio.gather(*map(residency.ensure_loaded, cold), return_exceptions=True)

    async def _pin(self, loop: ModelLoop) -> Lease | None:
        """``loop``'s model pinned with no activation bytes where it is ready
        on the device (which never waits: the module's invariant), else None."""
        residency = self.policies.residency
        if residency.state(loop.spec.key) is not READY:
            return None
        return await residency.acquire(loop.spec)

    def _report(
        self, formed_at: float, part: GroupPart, outcome: GroupOutcome
    ) -> list[tuple[Rows, BaseException | None]]:
        """Learn from the run and answer the rows it answered; the rows to run
        on their own model's path, each with the failure of its head (None:
        they did not run together)."""
        if outcome.error is not None:
            for rows in part.rows:
                rows.loop.fail(list(rows.requests), outcome.error)
            return []
        alone: list[tuple[Rows, BaseException | None]] = [(r, None) for r in outcome.alone]
        run = outcome.run
        if run is None:
            return alone
        requests = [r for rows in outcome.ran for r in rows.requests]
        units = sum(r.units for r in requests)
        if run.peak_bytes is not None:
            peak = peak_units(requests)
            for rows in outcome.ran:
                self.policies.residency.observe_batch(rows.loop.spec.key, run.peak_bytes, peak)
        self.predictor.observe(units, run.run_s)
        self.num_batches += 1
        self.num_rows += len(run.outputs)
        start = 0
        for rows in outcome.ran:
            count = rows.num_items
            outputs = run.outputs[start : start + count]
            start += count
            failed = next((o for o in outputs if isinstance(o, HeadFailed)), None)
            if failed is not None:
                alone.append((rows, failed.error))
                continue
            share = (
                sum(r.units for r in rows.requests) / units if units else count / len(run.outputs)
            )
            rows.loop.answer(formed_at, list(rows.requests), outputs, run.run_s * share, run)
        return alone


def _gone_model(request: QueuedRequest) -> None:
    """Fail ``request``, whose model left its group (retired) before it ran."""
    request.charge.settle(0.0)
    if not request.future.done():
        request.future.set_exception(
            ModelUnavailableError(request.model, "the model was removed before this request ran")
        )
