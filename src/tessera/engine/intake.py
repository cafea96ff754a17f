"""The request path's way in: a request checked, priced and queued, or refused
before it costs anything; and the wait for its answer.

Invariants: a request is refused before admission when the server drains or
its input is invalid, and after admission (its units settled at 0) when its
model's queue refuses it; a request of more work than one part (``fair_parts``)
is queued as parts, the first counted against the queue's bound, answered as
one (``_joined``); every request queued is in ``_pending`` until answered, so
a drain knows what it waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tessera.admission import AdmissionControl
from tessera.clock import Clock
from tessera.errors import (
    DeadlineExceededError,
    InvalidInputError,
    PayloadTooLargeError,
    ShuttingDownError,
)
from tessera.logs import request_id as request_id_var
from tessera.repository.spec import ModelSpec
from tessera.request import QueuedRequest, RequestResult
from tessera.residency import ResidencyManager, items_peak_units
from tessera.runtimes.tokens import TokenCounter, token_counter
from tessera.tasks.types import cut_to_window, request_units, work_units

from .host import EngineHost
from .loops import ModelLoops
from .step import ModelLoop
from .types import Caller, EngineConfig, RequestTrace, Submission

# The most of a part's run its batch's fixed cost may be (``_part_units``).
PART_FIXED_SHARE = 0.2
# The longest a request may wait for its answer, whatever its caller asks
# (a longer one is cut to this: no clock or prediction holds an endless deadline).
MAX_TIMEOUT_S = 86400.0


class RequestIntake:
    """Submits requests to the served versions' loops and waits for their answers."""

    def __init__(
        self,
        config: EngineConfig,
        clock: Clock,
        residency: ResidencyManager,
        host: EngineHost,
        admission: AdmissionControl,
        loops: ModelLoops,
    ) -> None:
        self._config = config
        self._clock = clock
        self._residency = residency
        self._host = host
        self._admission = admission
        self._loops = loops
        # Tokenizers of ``truncate: false`` cards, by version and folder.
        self._token_counters: dict[tuple[str, Path], TokenCounter | None] = {}
        # Requests queued and not yet answered; while draining, set when none is.
        self._pending: set[QueuedRequest] = set()
        self.draining = False
        self._drained = asyncio.Event()

    def submit(
        self,
        spec: ModelSpec,
        items: Sequence[Any],
        timeout_s: float | None,
        caller: Caller | None,
    ) -> Submission:
        name = spec.key
        if self.draining:  # before admission: a draining server refuses, never rate-limits
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
        counters = self._loops[name].counters
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
        quantum_s = self._config.fair_quantum_s
        if not self._config.fair_parts or quantum_s is None:
            return None
        loop = self._loops.get(spec.key)
        coefficients = loop.predictor.line() if loop is not None else None
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
        # One timer a request, no task or future of its own: the deadline costs
        # a timer handle, not a task per request (as ``asyncio.wait_for`` makes).
        expired = False

        def expire() -> None:
            nonlocal expired
            if not request.future.done():
                expired = True
                request.future.cancel()

        timer = self._clock.call_later(timeout, expire) if timeout is not None else None
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
        if self.draining:
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
            arrival = self._clock.now()
            timeout = timeout_s if timeout_s is not None else self._config.default_timeout_s
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
            model=spec.key,
            **who,
        )

    def _enqueue(self, spec: ModelSpec, request: QueuedRequest, *, counted: bool = True) -> None:
        """Queue ``request``; a request's parts after its first are not held to
        the queue's count (``max_queue`` bounds requests, whatever their parts)."""
        loop = self._loops[spec.key]
        self._loops.submit(loop, request, counted=counted)
        self._pending.add(request)
        loop.pending.add(request)
        request.future.add_done_callback(functools.partial(self._forget, loop, request))

    async def drain(self, grace_s: float) -> int:
        """Stop taking work (``ready`` turns False; new requests get
        ``ShuttingDownError``), wait up to ``grace_s`` for the accepted ones,
        then answer those still pending with ``ShuttingDownError``. Returns how
        many were answered so."""
        self.draining = True
        if not self._pending:
            self._drained.set()
        with contextlib.suppress(TimeoutError):
            await self._clock.wait_for(self._drained.wait(), grace_s)
        left = [r for r in self._pending if not r.future.done()]
        grace = f"{grace_s:g}s grace" if grace_s > 0 else "its grace cut short"
        for request in left:
            request.future.set_exception(
                ShuttingDownError(f"the server stopped before this request finished ({grace})")
            )
        return len(left)

    def _forget(self, loop: ModelLoop, request: QueuedRequest, _: object) -> None:
        self._pending.discard(request)
        loop.pending.discard(request)
        if self.draining and not self._pending:
            self._drained.set()


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
            whole.charge.device_s = sum(part.charge.device_s for part in parts)
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
