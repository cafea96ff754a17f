"""A gateway process's engine: ``ServingEngine`` over the engine process's
socket (``engine/messages.py`` says what travels).

The routes use it as they use ``Engine``: ``asubmit`` hands the request to
the engine process and returns once it is queued there, or raises what the
engine refused it with (the same error, so the same status); ``wait``
awaits its answer. Models, versions, the snapshot and the phase are the
engine's as of its last ``State`` message (every 0.25 s, and before each
admin call's answer). If the engine process goes, every waiting request
gets 503 and ``lost`` is set: the gateway stops (the server is going).

``RemoteEngine`` orchestrates; each concern keeps its own state: the state
mirror (``_StateMirror``), the requests in flight (``_Requests``), the admin
calls (``_Calls``), the request events on their way (``_EventBatch``) and
the tokenizers of models that take texts tokenised ahead (``_Tokenizers``).
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
from .ipc import FrameWriter, read_frame
from .lifecycle import ServedModel, served_spec, served_versions, spec_for_task
from .messages import (
    Call,
    Cancel,
    Done,
    Events,
    Failed,
    Logprobs,
    Payload,
    Piece,
    Queued,
    Reply,
    Settled,
    State,
    Submit,
    ToEngine,
    ToGateway,
    to_gateway,
)
from .types import Caller, PreloadProgress, RequestTrace, Submission

log = logging.getLogger(__name__)

# Past a request's deadline, how long the gateway waits for the engine's own
# answer (a DeadlineExceededError) before giving its caller one itself.
DEADLINE_SLACK_S = 5.0
# Request events are sent to the engine process in groups, this often.
EVENTS_INTERVAL_S = 0.1

# What the engine process sends about one request.
_AboutRequest = Queued | Failed | Done | Settled | Piece | Logprobs


class _BatchWindows:
    """Each model's recent batches, kept here from the engine process's states
    (``engine/messages.py``): a whole state sets them, the interval's add the
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


class _StateMirror:
    """The engine's phase, served models and snapshot as of its last ``State``."""

    def __init__(self) -> None:
        self.phase = "starting"
        self.served: dict[str, ServedModel] = {}
        self.seen = asyncio.Event()
        self._state: EngineStats | None = None  # the last state's, as it came
        self._windows = _BatchWindows()
        self._snapshot: EngineStats | None = None  # with the windows, made when read

    def take(self, message: State) -> None:
        self.phase = message.phase
        state = message.snapshot.value if message.snapshot is not None else None
        if state is not None:
            self._windows.add(state, message.whole)
        self._state, self._snapshot = state, None
        if message.served is not None:  # None: the same as last time
            self.served = message.served.value
        self.seen.set()

    def snapshot(self) -> EngineStats:
        if self._snapshot is None:
            if self._state is None:
                raise ModelUnavailableError("engine", "no state from the engine process yet")
            self._snapshot = self._windows.applied(self._state)
        return self._snapshot


class _Outbox:
    """Messages to the engine process, once connected (none are sent before)."""

    def __init__(self) -> None:
        self.writer: FrameWriter | None = None

    def send(self, message: ToEngine) -> None:
        if self.writer is not None:
            self.writer.send(message)


@dataclass
class _InFlight:
    call_id: int
    queued: asyncio.Future[Queued | Failed]
    streams: dict[int, Callable[[str], None]]
    logprobs: dict[int, Callable[[Any], None]]  # each streamed piece's tokens', before it
    request: QueuedRequest | None = None
    early: list[_AboutRequest] = field(default_factory=list)  # before ``request`` was set


class _Requests:
    """The requests this gateway sent, by call id. One stays until its wait
    is over and its charge settled (a generation's charge may follow its
    answer); ``idle`` is set while there are none (a drain waits for it)."""

    def __init__(self, outbox: _Outbox) -> None:
        self._outbox = outbox
        self._ids = itertools.count(1)
        self._in_flight: dict[int, _InFlight] = {}
        self._by_request: dict[QueuedRequest, int] = {}
        self.idle = asyncio.Event()
        self.idle.set()

    async def submit(
        self,
        name: str,
        task: Task,
        items: list[Any],
        timeout_s: float | None,
        caller: Caller | None,
    ) -> tuple[_InFlight, Queued]:
        """Send a request for ``items`` (a list of its own: each item's
        callbacks stay here) and await its ``Queued``; raise what the engine
        refused it with."""
        streams: dict[int, Callable[[str], None]] = {}
        logprobs: dict[int, Callable[[Any], None]] = {}
        for index, item in enumerate(items):
            on_text = getattr(item, "on_text", None)
            if on_text is not None:
                streams[index] = on_text
                items[index] = replace(item, on_text=None)
            on_logprobs = getattr(item, "on_logprobs", None)
            if on_logprobs is not None:
                logprobs[index] = on_logprobs
                items[index] = replace(items[index], on_logprobs=None)
        call_id = next(self._ids)
        flight = _InFlight(call_id, asyncio.get_running_loop().create_future(), streams, logprobs)
        self._in_flight[call_id] = flight
        self.idle.clear()
        request_id = request_id_var.get()
        streamed = tuple(streams)
        message = Submit(
            call_id, name, task, Payload(items), timeout_s, caller, request_id, streamed
        )
        self._outbox.send(message)
        try:
            reply = await flight.queued
        except BaseException:
            self.finish(call_id)
            raise
        if isinstance(reply, Failed):
            self.finish(call_id)
            raise reply.error.exception()
        return flight, reply

    def start(self, flight: _InFlight, request: QueuedRequest) -> None:
        """``flight``'s request is waited for now: what came for it so far is its."""
        flight.request = request
        self._by_request[request] = flight.call_id
        for early in flight.early:
            self._deliver(flight, early)
        flight.early.clear()

    def end_wait(self, request: QueuedRequest, answered: bool) -> None:
        """``request``'s wait is over: the engine is told if its caller left
        before the answer; it is forgotten once charged."""
        call_id = self._by_request.pop(request, None)
        if call_id is None:
            return
        if not answered and call_id in self._in_flight:
            self._outbox.send(Cancel(call_id))  # the engine settles its charge
        if request.charge.settled:
            self.finish(call_id)

    def finish(self, call_id: int) -> None:
        """Forget a request: answered (or given up) and charged."""
        self._in_flight.pop(call_id, None)
        if not self._in_flight:
            self.idle.set()

    def waiting(self) -> list[QueuedRequest]:
        return [f.request for f in self._in_flight.values() if f.request is not None]

    def take(self, message: _AboutRequest) -> None:
        flight = self._in_flight.get(message.call_id)
        if flight is None:
            return
        if isinstance(message, Queued | Failed) and not flight.queued.done():
            flight.queued.set_result(message)
        elif flight.request is None:
            flight.early.append(message)  # submit has not resumed yet
        else:
            self._deliver(flight, message)

    def _deliver(self, flight: _InFlight, message: _AboutRequest) -> None:
        request = flight.request
        assert request is not None
        if isinstance(message, Piece):
            on_text = flight.streams.get(message.item)
            if on_text is not None:
                on_text(message.text)
        elif isinstance(message, Logprobs):
            on_logprobs = flight.logprobs.get(message.item)
            if on_logprobs is not None:
                on_logprobs(message.tokens.value)
        elif isinstance(message, Done):
            if message.units is not None:
                request.charge.device_s = message.device_s
                request.charge.settle(message.units)
            if not request.future.done():
                outputs = message.outputs.value
                result = RequestResult(outputs, message.queued_s, message.run_s, message.batch_size)
                request.future.set_result(result)
        elif isinstance(message, Failed):
            if not request.future.done():
                request.future.set_exception(message.error.exception())
        elif isinstance(message, Settled):
            request.charge.device_s = message.device_s
            request.charge.settle(message.units)
            if request not in self._by_request:  # its wait is over
                self.finish(message.call_id)

    def lose(self, gone: TesseraError) -> None:
        """The engine process is gone: every request gets ``gone``, uncharged."""
        for flight in self._in_flight.values():
            if not flight.queued.done():
                flight.queued.set_exception(gone)
            elif flight.request is not None:
                if not flight.request.future.done():
                    flight.request.future.set_exception(gone)
                flight.request.charge.settle(0.0)
        self._in_flight.clear()
        self.idle.set()


class _Calls:
    """Admin calls sent, by call id, until each is answered."""

    def __init__(self, outbox: _Outbox, lost: asyncio.Event) -> None:
        self._outbox = outbox
        self._lost = lost
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Reply]] = {}

    async def call(self, method: str, *args: Any) -> Any:
        """The engine's ``method(*args)``, or what it raised."""
        if self._lost.is_set():
            raise ModelUnavailableError("engine", "the engine process is gone")
        call_id = next(self._ids)
        waiting: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = waiting
        self._outbox.send(Call(call_id, method, Payload(args)))
        reply = await waiting
        if reply.error is not None:
            raise reply.error.exception()
        return reply.value.value if reply.value is not None else None

    def take(self, reply: Reply) -> None:
        waiting = self._waiting.pop(reply.call_id, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(reply)

    def lose(self, gone: TesseraError) -> None:
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(gone)
        self._waiting.clear()


class _EventBatch:
    """Request events this gateway answered, sent to the engine process's
    metrics in groups every ``EVENTS_INTERVAL_S``."""

    def __init__(self, outbox: _Outbox, clock: Clock) -> None:
        self._outbox = outbox
        self._clock = clock
        self._events: list[RequestEvent] = []
        self._task: asyncio.Task[None] | None = None

    def add(self, event: RequestEvent) -> None:
        self._events.append(event)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        await self._clock.sleep(EVENTS_INTERVAL_S)
        events, self._events = self._events, []
        if events:
            self._outbox.send(Events(events))

    async def close(self) -> None:
        """After the last group is sent."""
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class _Tokenizers:
    """Per model version, how its texts are tokenised here, where the model
    takes texts tokenised ahead (``runtimes/tokens.py``)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, Path, Any], TextTokenizer | None] = {}

    def tokenized(self, spec: ModelSpec, items: list[Any]) -> list[Any]:
        key = (spec.key, spec.folder, spec.options.get("max_length"))
        if key not in self._by_key:
            plan = token_plan(spec)
            self._by_key[key] = text_tokenizer(plan) if plan is not None else None
        tokenizer = self._by_key[key]
        return tokenizer(items) if tokenizer is not None else items


class RemoteEngine:
    """The engine process, as a gateway process serves it (module notes)."""

    def __init__(self, socket_path: Path, clock: Clock | None = None) -> None:
        self.socket_path = socket_path
        self.clock = clock or MonotonicClock()
        self.lost = asyncio.Event()
        self._outbox = _Outbox()
        self._mirror = _StateMirror()
        self._requests = _Requests(self._outbox)
        self._calls = _Calls(self._outbox, self.lost)
        self._events = _EventBatch(self._outbox, self.clock)
        self._tokenizers = _Tokenizers()
        self._reader_task: asyncio.Task[None] | None = None
        self._draining = False

    async def connect(self, timeout_s: float = 60.0) -> None:
        """Connect (the engine process may still be starting) and read its first state."""
        deadline = self.clock.now() + timeout_s
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(self.socket_path))
                self._outbox.writer = FrameWriter(writer)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if self.clock.now() >= deadline:
                    raise
                await self.clock.sleep(0.05)
        self._reader_task = asyncio.create_task(self._read(reader), name="remote-engine")
        await self.clock.wait_for(self._mirror.seen.wait(), timeout_s)

    # -- what every reader sees ---------------------------------------------

    def model_names(self) -> list[str]:
        return sorted(self._mirror.served)

    def versions(self, name: str) -> list[ModelSpec]:
        return served_versions(self._mirror.served, name)

    def spec(self, name: str) -> ModelSpec:
        return served_spec(self._mirror.served, name)

    def spec_for(self, name: str, task: Task) -> ModelSpec:
        return spec_for_task(self.spec(name), name, task)

    def snapshot(self) -> EngineStats:
        return self._mirror.snapshot()

    @property
    def phase(self) -> str:
        return "draining" if self._draining or self.lost.is_set() else self._mirror.phase

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    def subscribe(self, sink: StatsSink) -> None:
        """Batches and loads are the engine process's: its metrics count them."""
        return

    def on_request(self, event: RequestEvent) -> None:
        """A request this gateway answered, for the engine process's metrics."""
        self._events.add(event)

    def on_batch(self, model: str, size: int, run_s: float) -> None:
        return

    def on_load(self, model: str, seconds: float, ok: bool) -> None:
        return

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
        sent = list(items)
        try:
            spec = self.spec_for(name, task)
        except TesseraError:
            pass  # a name the engine does not serve, or not for this task: it says so
        else:
            sent = self._tokenizers.tokenized(spec, sent)
        flight, queued = await self._requests.submit(name, task, sent, timeout_s, caller)
        now = self.clock.now()
        request = QueuedRequest(
            list(items),
            queued.units,
            now,
            asyncio.get_running_loop().create_future(),
            deadline=now + queued.timeout_s,
            request_id=request_id_var.get(),
        )
        self._requests.start(flight, request)
        return Submission(queued.model, request, None, queued.version)

    async def wait(self, submission: Submission, trace: RequestTrace | None = None) -> list[Any]:
        request = submission.request
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
            self._requests.end_wait(request, answered=result is not None)
            if trace is not None:
                trace.record(request, result)

    # -- the socket -------------------------------------------------------------

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while (message := await read_frame(reader, to_gateway)) is not None:
                self._on_message(message)
        except (ConnectionError, ValueError) as e:
            log.error("the engine process's connection failed: %s", e)
        finally:
            if not self.lost.is_set():
                self.lost.set()
                gone = ModelUnavailableError(
                    "engine", "the engine process is gone", retry_after_s=1.0
                )
                self._requests.lose(gone)
                self._calls.lose(gone)

    def _on_message(self, message: ToGateway) -> None:
        if isinstance(message, State):
            self._mirror.take(message)
        elif isinstance(message, Reply):
            self._calls.take(message)
        else:
            self._requests.take(message)

    # -- lifecycle ------------------------------------------------------------

    async def preload(self, progress: PreloadProgress | None = None) -> None:
        """The engine process preloads; this gateway is ready when it is."""
        return

    async def watch_repository(self, watcher: RepositoryWatcher, interval_s: float) -> None:
        """The engine process watches the repository."""
        return

    async def load(self, name: str) -> ModelStats:
        stats: ModelStats = await self._calls.call("load", name)
        return stats

    async def unload(self, name: str) -> bool:
        return bool(await self._calls.call("unload", name))

    async def add_model(self, folder: Path, via_api: bool = False) -> list[RolloutStats]:
        rollouts: list[RolloutStats] = await self._calls.call("add_model", folder, via_api)
        return rollouts

    async def remove_model(self, name: str) -> int:
        return int(await self._calls.call("remove_model", name))

    async def drain(self, grace_s: float) -> int:
        """New requests get 503 at once; those in flight here have ``grace_s``
        to be answered (the engine process drains its own on its signal)."""
        self._draining = True
        with contextlib.suppress(TimeoutError):
            await self.clock.wait_for(self._requests.idle.wait(), grace_s)
        cut = ShuttingDownError(f"the server stopped before this request finished ({grace_s:g}s)")
        num_cut = 0
        for request in self._requests.waiting():
            if not request.future.done():
                request.future.set_exception(cut)
                num_cut += 1
        return num_cut

    async def close(self) -> None:
        await self._events.close()
        if self._outbox.writer is not None:
            self._outbox.writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
