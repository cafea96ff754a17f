"""The engine's side of the process split: an ``Engine`` served to gateway
processes over a Unix socket (``RemoteEngine`` is the other side; the
messages and what each means are in ``engine/messages.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessera.errors import TesseraError
from tessera.logs import request_id as request_id_var
from tessera.metrics import RequestEvent

from .engine import Engine
from .ipc import FrameWriter, encode, read_frame
from .lifecycle import ServedModel
from .messages import (
    Call,
    Cancel,
    Done,
    ErrorInfo,
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
    to_engine,
)
from .types import RequestTrace

log = logging.getLogger(__name__)

# The admin calls a gateway may make.
CALLS = frozenset({"load", "unload", "add_model", "remove_model"})
DEFAULT_STATE_INTERVAL_S = 0.25


class _Gateway(FrameWriter):
    """One gateway's connection: its frames and its requests in flight."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        super().__init__(writer)
        self.tasks: dict[int, asyncio.Task[None]] = {}


class EngineCore:
    """Serves ``engine`` on a Unix socket (see the module notes).

    ``on_events`` takes the gateways' request events (the engine process's
    metrics and live page count them with its own)."""

    def __init__(
        self,
        engine: Engine,
        *,
        on_events: Callable[[RequestEvent], None] | None = None,
        state_interval_s: float = DEFAULT_STATE_INTERVAL_S,
    ) -> None:
        self.engine = engine
        self.on_events = on_events
        self._state_interval_s = state_interval_s
        self._gateways: set[_Gateway] = set()
        self._server: asyncio.Server | None = None
        self._pusher: asyncio.Task[None] | None = None
        self._calls: set[asyncio.Task[None]] = set()
        # The served models of the last state every gateway was sent, and
        # each model's batches run by then.
        self._served_pushed: dict[str, ServedModel] | None = None
        self._batches_pushed: dict[str, int] = {}

    async def start(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket left by a process that was killed
        self._server = await asyncio.start_unix_server(self._serve, path=str(path))
        self._pusher = asyncio.create_task(self._push_state(), name="engine-core-state")

    async def close(self) -> None:
        if self._pusher is not None:
            self._pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pusher
        if self._server is not None:
            self._server.close()
        for gateway in list(self._gateways):
            for task in gateway.tasks.values():
                task.cancel()
            gateway.close()
        if self._server is not None:
            await self._server.wait_closed()

    def _state(self, *, changed_only: bool = False) -> State:
        """A state message; ``changed_only`` (the interval's, to every
        gateway): the served models only if they changed since the last such
        one, else None, and each model's batches run since it."""
        engine = self.engine
        served = engine.served_models()
        if not changed_only:
            whole = engine.snapshot(with_costs=False)
            return State(engine.phase, Payload(served), Payload(whole), whole=True)
        # Equal at the cost of identities: the specs are the same objects
        # until a model is added, versioned or removed.
        changed = served != self._served_pushed
        if changed:
            self._served_pushed = served
        snapshot = engine.snapshot(batches_since=self._batches_pushed, with_costs=False)
        self._batches_pushed = {model.name: model.num_batches for model in snapshot.models}
        return State(
            engine.phase, Payload(served) if changed else None, Payload(snapshot), whole=False
        )

    async def _push_state(self) -> None:
        while True:
            await asyncio.sleep(self._state_interval_s)
            if self._gateways:
                state = encode(self._state(changed_only=True))
                for gateway in self._gateways:  # after a new gateway's first, whole state
                    gateway.send_frame(state)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        gateway = _Gateway(writer)
        self._gateways.add(gateway)
        gateway.send(self._state())
        try:
            while (message := await read_frame(reader, to_engine)) is not None:
                self._dispatch(gateway, message)
        except (ConnectionError, ValueError) as e:
            log.warning("a gateway's connection failed: %s", e)
        finally:
            self._gateways.discard(gateway)
            for task in gateway.tasks.values():
                task.cancel()  # its callers are gone with it
            gateway.close()

    def _dispatch(self, gateway: _Gateway, message: ToEngine) -> None:
        if isinstance(message, Submit):
            call_id = message.call_id
            task = asyncio.create_task(self._request(gateway, message))
            gateway.tasks[call_id] = task
            task.add_done_callback(lambda _: gateway.tasks.pop(call_id, None))
        elif isinstance(message, Cancel):
            running = gateway.tasks.get(message.call_id)
            if running is not None:
                running.cancel()
        elif isinstance(message, Call):
            call = asyncio.create_task(self._call(gateway, message))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)
        elif isinstance(message, Events) and self.on_events is not None:
            for event in message.events:
                self.on_events(event)

    async def _request(self, gateway: _Gateway, message: Submit) -> None:
        request_id_var.set(message.request_id)  # this task's own context: its log lines
        call_id = message.call_id
        items = message.items.value
        loop = asyncio.get_running_loop()
        for index in message.streamed:
            piece = functools.partial(_send_piece, loop, gateway, call_id, index)
            items[index] = dataclasses.replace(items[index], on_text=piece)
            if getattr(items[index], "logprobs", None) is not None:
                tokens = functools.partial(_send_logprobs, loop, gateway, call_id, index)
                items[index] = dataclasses.replace(items[index], on_logprobs=tokens)
        try:
            submission = self.engine.submit(
                message.model,
                message.task,
                items,
                timeout_s=message.timeout_s,
                caller=message.caller,
            )
        except TesseraError as e:
            gateway.send(Failed(call_id, ErrorInfo.of(e)))
            return
        request = submission.request
        timeout = request.deadline - request.arrival if request.deadline is not None else 0.0
        gateway.send(Queued(call_id, submission.model, submission.version, request.units, timeout))

        def settled(units: float) -> None:
            gateway.send(Settled(call_id, units, request.charge.device_s))

        trace = RequestTrace()
        try:
            outputs = await self.engine.wait(submission, trace)
        except BaseException as e:
            request.charge.when_settled(settled)
            if not isinstance(e, Exception):
                raise  # cancelled: its caller left
            gateway.send(Failed(call_id, ErrorInfo.of(e)))
            return
        # The charge is settled with the answer, but for a generation that
        # stops at its next step: then it follows as its own message.
        units = request.charge.units
        done = Done(
            call_id,
            Payload(outputs),
            trace.queued_s,
            trace.run_s,
            trace.batch_size,
            units,
            request.charge.device_s,
        )
        gateway.send(done)
        if units is None:
            request.charge.when_settled(settled)

    async def _call(self, gateway: _Gateway, message: Call) -> None:
        call_id = message.call_id
        if message.method not in CALLS:
            gateway.send(Reply(call_id, None, ErrorInfo.of(ValueError(message.method))))
            return
        try:
            value = await getattr(self.engine, message.method)(*message.args.value)
        except Exception as e:
            reply = Reply(call_id, None, ErrorInfo.of(e))
        else:
            reply = Reply(call_id, Payload(value), None)
        gateway.send(self._state())  # what the call changed, read before its reply
        gateway.send(reply)


# A streamed piece of item ``index`` (or its tokens), from the worker thread
# that generates it: queued on the event loop's thread.


def _send_piece(
    loop: asyncio.AbstractEventLoop, gateway: _Gateway, call_id: int, index: int, text: str
) -> None:
    loop.call_soon_threadsafe(gateway.send, Piece(call_id, index, text))


def _send_logprobs(
    loop: asyncio.AbstractEventLoop, gateway: _Gateway, call_id: int, index: int, tokens: Any
) -> None:
    loop.call_soon_threadsafe(gateway.send, Logprobs(call_id, index, Payload(tokens)))
