"""A gateway process's engine: ``ServingEngine`` over the engine process's
socket (``engine/core.py`` says what travels).

The routes use it as they use ``Engine``: ``asubmit`` hands the request to
the engine process and returns once it is queued there, or raises what the
engine refused it with (the same error, so the same status); ``wait``
awaits its answer. Models, versions, the snapshot and the phase are the
engine's as of its last ``state`` message (every 0.25 s, and before each
admin call's answer). If the engine process goes, every waiting request
gets 503 and ``lost`` is set: the gateway stops (the server is going).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tessera.clock import Clock, MonotonicClock
from tessera.errors import (
    DeadlineExceededError,
    ModelUnavailableError,
    ShuttingDownError,
    TesseraError,
)
from tessera.logs import request_id as request_id_var
from tessera.metrics import EngineStats, ModelStats, RequestEvent, RolloutStats, StatsSink
from tessera.repository.spec import ModelSpec
from tessera.repository.watch import RepositoryWatcher
from tessera.request import QueuedRequest, RequestResult
from tessera.runtimes.tokens import TextTokenizer, text_tokenizer, token_plan
from tessera.tasks.types import Task

from .counters import RECENT_BATCHES
from .ipc import FrameWriter, decode_error, read_frame
from .lifecycle import ServedModel, served_spec, served_versions, spec_for_task
from .types import Caller, PreloadProgress, RequestTrace, Submission

log = logging.getLogger(__name__)

# Past a request's deadline, how long the gateway waits for the engine's own
# answer (a DeadlineExceededError) before giving its caller one itself.
DEADLINE_SLACK_S = 5.0
# Request events are sent to the engine process in groups, this often.
EVENTS_INTERVAL_S = 0.1


class _BatchWindows:
    """Each model's recent batches, kept here from the engine process's states
    (``engine/core.py``): a whole state sets them, the interval's add the
    batches run since the last."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, deque[tuple[int, float]]]] = {}

    def add(self, snapshot: EngineStats, whole: bool) -> None:
        held: dict[str, tuple[int, deque[tuple[int, float]]]] = {}
        for model in snapshot.models:
            count, recent = model.num_batches, model.recent_batches
            mine = self._held.get(model.name)
            if whole or mine is None or count < mine[0]:  # < : the model was made anew
                window = deque(recent, maxlen=RECENT_BATCHES)
            else:
                window = mine[1]
                new = count - mine[0]
                if new:
                    window.extend(recent[-new:])
            held[model.name] = (count, window)
        self._held = held

    def applied(self, snapshot: EngineStats) -> EngineStats:
        """``snapshot`` with each model's whole window."""
        models = tuple(
            replace(model, recent_batches=tuple(self._held[model.name][1]))
            for model in snapshot.models
        )
        return replace(snapshot, models=models)


@dataclass
class _InFlight:
    queued: asyncio.Future[tuple[Any, ...]]
    streams: dict[int, Callable[[str], None]]
    logprobs: dict[int, Callable[[Any], None]]  # each streamed piece's tokens', before it
    request: QueuedRequest | None = None
    results: list[Any] = field(default_factory=list)


class RemoteEngine:
    """The engine process, as a gateway process serves it (module notes)."""

    def __init__(self, socket_path: Path, clock: Clock | None = None) -> None:
        self.socket_path = socket_path
        self.clock = clock or MonotonicClock()
        self._writer: FrameWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._in_flight: dict[int, _InFlight] = {}
        self._by_request: dict[QueuedRequest, int] = {}
        self._calls: dict[int, asyncio.Future[tuple[bool, Any]]] = {}
        self._phase = "starting"
        self._served: dict[str, ServedModel] = {}
        self._state: EngineStats | None = None  # the last state's, as it came
        self._windows = _BatchWindows()
        self._snapshot: EngineStats | None = None  # with the windows, made when read
        self._state_seen = asyncio.Event()
        self._draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._events: list[RequestEvent] = []
        self._events_task: asyncio.Task[None] | None = None
        self.lost = asyncio.Event()
        # Per model version: how its texts are tokenised here (None: not here).
        self._tokenizers: dict[tuple[str, Path, Any], TextTokenizer | None] = {}

    async def connect(self, timeout_s: float = 60.0) -> None:
        """Connect (the engine process may still be starting) and read its first state."""
        deadline = self.clock.now() + timeout_s
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(self.socket_path))
                self._writer = FrameWriter(writer)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if self.clock.now() >= deadline:
                    raise
                await self.clock.sleep(0.05)
        self._reader_task = asyncio.create_task(self._read(reader), name="remote-engine")
        await self.clock.wait_for(self._state_seen.wait(), timeout_s)

    # -- what every reader sees ---------------------------------------------

    def model_names(self) -> list[str]:
        return sorted(self._served)

    def versions(self, name: str) -> list[ModelSpec]:
        return served_versions(self._served, name)

    def spec(self, name: str) -> ModelSpec:
        return served_spec(self._served, name)

    def spec_for(self, name: str, task: Task) -> ModelSpec:
        return spec_for_task(self.spec(name), name, task)

    def snapshot(self) -> EngineStats:
        if self._snapshot is None:
            if self._state is None:
                raise ModelUnavailableError("engine", "no state from the engine process yet")
            self._snapshot = self._windows.applied(self._state)
        return self._snapshot

    @property
    def phase(self) -> str:
        return "draining" if self._draining or self.lost.is_set() else self._phase

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    def subscribe(self, sink: StatsSink) -> None:
        """Batches and loads are the engine process's: its metrics count them."""
        return

    def on_request(self, event: RequestEvent) -> None:
        """A request this gateway answered, for the engine process's metrics."""
        self._events.append(event)
        if self._events_task is None or self._events_task.done():
            self._events_task = asyncio.get_running_loop().create_task(self._send_events())

    def on_batch(self, model: str, size: int, run_s: float) -> None:
        return

    def on_load(self, model: str, seconds: float, ok: bool) -> None:
        return

    async def _send_events(self) -> None:
        await self.clock.sleep(EVENTS_INTERVAL_S)
        events, self._events = self._events, []
        if events:
            self._send(("events", events))

    # -- the request path -----------------------------------------------------

    async def asubmit(
        self,
        name: str,
        task: Task,
        items: Sequence[Any],
        *,
        timeout_s: float | None = None,
        caller: Caller | None = None,
    ) -> Submission:
        if self._draining or self.lost.is_set():
            raise ShuttingDownError("the server is shutting down: no new requests")
        call_id = next(self._ids)
        sent = self._tokenized(name, task, list(items))
        streams: dict[int, Callable[[str], None]] = {}
        logprobs: dict[int, Callable[[Any], None]] = {}
        for index, item in enumerate(sent):
            on_text = getattr(item, "on_text", None)
            if on_text is not None:
                streams[index] = on_text
                sent[index] = replace(item, on_text=None)
            on_logprobs = getattr(item, "on_logprobs", None)
            if on_logprobs is not None:
                logprobs[index] = on_logprobs
                sent[index] = replace(sent[index], on_logprobs=None)
        loop = asyncio.get_running_loop()
        flight = _InFlight(loop.create_future(), streams, logprobs)
        self._in_flight[call_id] = flight
        self._idle.clear()
        message = ("submit", call_id, name, task, sent, timeout_s, caller)
        self._send((*message, request_id_var.get(), tuple(streams)))
        try:
            reply = await flight.queued
        except BaseException:
            self._finish(call_id)
            raise
        if reply[0] == "error":
            self._finish(call_id)
            raise decode_error(reply[2])
        _, _, model, version, units, timeout = reply
        now = self.clock.now()
        request = QueuedRequest(
            list(items),
            units,
            now,
            loop.create_future(),
            deadline=now + timeout,
            request_id=request_id_var.get(),
        )
        flight.request = request
        self._by_request[request] = call_id
        for early in flight.results:  # what came before this task resumed
            self._deliver(flight, early)
        flight.results.clear()
        return Submission(model, request, None, version)

    def _tokenized(self, name: str, task: Task, items: list[Any]) -> list[Any]:
        """``items`` with their texts tokenised here, where the model takes
        texts tokenised ahead (``runtimes/tokens.py``); else as they are (a
        name the engine does not serve: it says so)."""
        try:
            spec = self.spec_for(name, task)
        except TesseraError:
            return items
        key = (spec.key, spec.folder, spec.options.get("max_length"))
        if key not in self._tokenizers:
            plan = token_plan(spec)
            self._tokenizers[key] = text_tokenizer(plan) if plan is not None else None
        tokenizer = self._tokenizers[key]
        return tokenizer(items) if tokenizer is not None else items

    async def wait(self, submission: Submission, trace: RequestTrace | None = None) -> list[Any]:
        request = submission.request
        call_id = self._by_request.get(request)
        # The engine answers a request past its deadline itself; the slack
        # covers a lost answer, never the usual path.
        limit = request.deadline - request.arrival if request.deadline is not None else 0.0
        result: RequestResult | None = None

        def expire() -> None:
            if not request.future.done():
                request.future.set_exception(
                    DeadlineExceededError(
                        f"no answer from model {submission.model!r} within {limit:.3g}s"
                    )
                )

        # One timer on the clock, no task or future of its own (as ``Engine.wait``).
        timer = self.clock.call_later(limit + DEADLINE_SLACK_S, expire)
        try:
            result = await request.future
            return result.outputs
        finally:
            timer.cancel()
            self._by_request.pop(request, None)
            if call_id is not None:
                if result is None and call_id in self._in_flight:
                    self._send(("cancel", call_id))  # the engine settles its charge
                if request.charge.settled:
                    self._finish(call_id)
            if trace is not None:
                trace.record(request, result)

    def _finish(self, call_id: int) -> None:
        """Forget a request: answered (or given up) and charged."""
        self._in_flight.pop(call_id, None)
        if not self._in_flight:
            self._idle.set()

    # -- the socket -------------------------------------------------------------

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._writer is not None:
            self._writer.send(message)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while (message := await read_frame(reader)) is not None:
                self._on_message(message)
        except (ConnectionError, ValueError) as e:
            log.error("the engine process's connection failed: %s", e)
        finally:
            self._lose()

    def _on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "state":
            _, self._phase, served, state, whole = message
            if state is not None:
                self._windows.add(state, whole)
            self._state, self._snapshot = state, None
            if served is not None:  # None: the same as last time
                self._served = served
            self._state_seen.set()
            return
        if kind == "reply":
            call = self._calls.pop(message[1], None)
            if call is not None and not call.done():
                call.set_result((message[2], message[3]))
            return
        flight = self._in_flight.get(message[1])
        if flight is None:
            return
        if not flight.queued.done():
            flight.queued.set_result(message)
        elif flight.request is None:
            flight.results.append(message)  # asubmit has not resumed yet
        else:
            self._deliver(flight, message)

    def _deliver(self, flight: _InFlight, message: tuple[Any, ...]) -> None:
        kind, call_id = message[0], message[1]
        request = flight.request
        assert request is not None
        if kind == "piece":
            on_text = flight.streams.get(message[2])
            if on_text is not None:
                on_text(message[3])
        elif kind == "logprobs":
            on_logprobs = flight.logprobs.get(message[2])
            if on_logprobs is not None:
                on_logprobs(message[3])
        elif kind == "done":
            _, _, outputs, queued_s, run_s, batch_size, units = message
            if units is not None:
                request.charge.settle(units)
            if not request.future.done():
                request.future.set_result(RequestResult(outputs, queued_s, run_s, batch_size))
        elif kind == "error":
            if not request.future.done():
                request.future.set_exception(decode_error(message[2]))
        elif kind == "settled":
            request.charge.settle(message[2])
            if request not in self._by_request:  # its wait is over
                self._finish(call_id)

    def _lose(self) -> None:
        if self.lost.is_set():
            return
        self.lost.set()
        gone = ModelUnavailableError("engine", "the engine process is gone", retry_after_s=1.0)
        for flight in self._in_flight.values():
            if not flight.queued.done():
                flight.queued.set_exception(gone)
            elif flight.request is not None:
                if not flight.request.future.done():
                    flight.request.future.set_exception(gone)
                flight.request.charge.settle(0.0)
        self._in_flight.clear()
        self._idle.set()
        for call in self._calls.values():
            if not call.done():
                call.set_exception(gone)
        self._calls.clear()

    async def _call(self, method: str, *args: Any) -> Any:
        if self.lost.is_set():
            raise ModelUnavailableError("engine", "the engine process is gone")
        call_id = next(self._ids)
        call: asyncio.Future[tuple[bool, Any]] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = call
        self._send(("call", call_id, method, args))
        ok, value = await call
        if not ok:
            raise decode_error(value)
        return value

    # -- lifecycle ------------------------------------------------------------

    async def preload(self, progress: PreloadProgress | None = None) -> None:
        """The engine process preloads; this gateway is ready when it is."""
        return

    async def watch_repository(self, watcher: RepositoryWatcher, interval_s: float) -> None:
        """The engine process watches the repository."""
        return

    async def load(self, name: str) -> ModelStats:
        stats: ModelStats = await self._call("load", name)
        return stats

    async def unload(self, name: str) -> bool:
        return bool(await self._call("unload", name))

    async def add_model(self, folder: Path, via_api: bool = False) -> list[RolloutStats]:
        rollouts: list[RolloutStats] = await self._call("add_model", folder, via_api)
        return rollouts

    async def remove_model(self, name: str) -> int:
        return int(await self._call("remove_model", name))

    async def drain(self, grace_s: float) -> int:
        """New requests get 503 at once; those in flight here have ``grace_s``
        to be answered (the engine process drains its own on its signal)."""
        self._draining = True
        with contextlib.suppress(TimeoutError):
            await self.clock.wait_for(self._idle.wait(), grace_s)
        left = [f.request for f in self._in_flight.values() if f.request is not None]
        cut = ShuttingDownError(f"the server stopped before this request finished ({grace_s:g}s)")
        num_cut = 0
        for request in left:
            if not request.future.done():
                request.future.set_exception(cut)
                num_cut += 1
        return num_cut

    async def close(self) -> None:
        if self._events_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._events_task
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
