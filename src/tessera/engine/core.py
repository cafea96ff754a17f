"""The engine's side of the process split: an ``Engine`` served to gateway
processes over a Unix socket (``RemoteEngine`` is the other side).

One engine process per device owns the queues, the fair scheduler, admission
(rates, concurrency and quotas are counted here, so they are exact however
many gateways there are), residency and the device; the gateway processes do
HTTP, authentication, JSON and the audit, and hand each request here as it
came (``submit``). Per connection, the messages (``engine/ipc.py`` frames):

- gateway to engine: ``("submit", id, model, task, items, timeout_s, caller,
  request_id, streamed)`` queues a request (``streamed``: the items whose
  ``on_text`` and ``on_logprobs`` the gateway keeps; the pieces come back as
  ``piece`` messages, the logprobs of a piece that has them, where asked
  for, as a ``logprobs`` message just before it); ``("cancel", id)``: its
  caller left; ``("call", id, method, args)``: an admin call (load, unload,
  add_model, remove_model);
  ``("events", events)``: the gateway's answered requests, for the metrics
  the engine process serves.
- engine to gateway: ``("queued", id, model_key, version, units, timeout_s)`` or
  ``("error", id, error)`` at once; then ``("done", id, outputs, queued_s,
  run_s, batch_size, units)`` (``units``: its charge, or None when it is
  settled later, as ``("settled", id, units)``) or ``("error", id,
  error)`` (and ``settled``); ``("piece", id, item, text)`` (after
  ``("logprobs", id, item, tokens)``, where they are asked for) while a
  streamed chat generates; ``("reply", id, ok, value)`` for a call;
  ``("state", phase, served, snapshot, whole)`` every ``state_interval_s``
  and after each call: what the gateways read models, probes and ``/v2``
  from (``served`` None: as in the last state; the interval's states carry
  the served models only when they changed: a hundred models' specs were a
  quarter of each state's cost, every quarter of a second). ``whole``: each
  model's ``recent_batches`` is its whole window (a gateway's first state, a
  call's); else only the batches run since the last interval's state, which
  the gateway adds to the windows it keeps (a hundred models' whole windows
  were 1.4 MB and 21 ms of pickling, the engine's loop and the interpreter
  lock held, every quarter of a second).
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
from .ipc import FrameWriter, encode, encode_error, read_frame
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
        self._served_pushed: dict[str, Any] | None = None
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

    def _state(self, *, changed_only: bool = False) -> tuple[Any, ...]:
        """A state message; ``changed_only`` (the interval's, to every
        gateway): the served models only if they changed since the last such
        one, else None, and each model's batches run since it."""
        engine = self.engine
        served: dict[str, Any] | None = engine.served_models()
        if not changed_only:
            return ("state", engine.phase, served, engine.snapshot(), True)
        # Equal at the cost of identities: the specs are the same objects
        # until a model is added, versioned or removed.
        if served == self._served_pushed:
            served = None
        else:
            self._served_pushed = served
        snapshot = engine.snapshot(batches_since=self._batches_pushed)
        self._batches_pushed = {model.name: model.num_batches for model in snapshot.models}
        return ("state", engine.phase, served, snapshot, False)

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
            while (message := await read_frame(reader)) is not None:
                self._dispatch(gateway, message)
        except (ConnectionError, ValueError) as e:
            log.warning("a gateway's connection failed: %s", e)
        finally:
            self._gateways.discard(gateway)
            for task in gateway.tasks.values():
                task.cancel()  # its callers are gone with it
            gateway.close()

    def _dispatch(self, gateway: _Gateway, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "submit":
            call_id = message[1]
            task = asyncio.create_task(self._request(gateway, *message[1:]))
            gateway.tasks[call_id] = task
            task.add_done_callback(lambda _: gateway.tasks.pop(call_id, None))
        elif kind == "cancel":
            running = gateway.tasks.get(message[1])
            if running is not None:
                running.cancel()
        elif kind == "call":
            call = asyncio.create_task(self._call(gateway, *message[1:]))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)
        elif kind == "events":
            if self.on_events is not None:
                for event in message[1]:
                    self.on_events(event)
        else:
            log.warning("a gateway sent an unknown message %r", kind)

    async def _request(
        self,
        gateway: _Gateway,
        call_id: int,
        name: str,
        task: Any,
        items: list[Any],
        timeout_s: float | None,
        caller: Any,
        request_id: str | None,
        streamed: tuple[int, ...],
    ) -> None:
        request_id_var.set(request_id)  # this task's own context: its log lines
        loop = asyncio.get_running_loop()
        for index in streamed:
            piece = functools.partial(_send, loop, gateway, "piece", call_id, index)
            items[index] = dataclasses.replace(items[index], on_text=piece)
            if getattr(items[index], "logprobs", None) is not None:
                tokens = functools.partial(_send, loop, gateway, "logprobs", call_id, index)
                items[index] = dataclasses.replace(items[index], on_logprobs=tokens)
        try:
            submission = self.engine.submit(name, task, items, timeout_s=timeout_s, caller=caller)
        except TesseraError as e:
            gateway.send(("error", call_id, encode_error(e)))
            return
        request = submission.request
        timeout = request.deadline - request.arrival if request.deadline is not None else 0.0
        queued = ("queued", call_id, submission.model, submission.version, request.units, timeout)
        gateway.send(queued)

        def settled(units: float) -> None:
            gateway.send(("settled", call_id, units))

        trace = RequestTrace()
        try:
            outputs = await self.engine.wait(submission, trace)
        except BaseException as e:
            request.charge.when_settled(settled)
            if not isinstance(e, Exception):
                raise  # cancelled: its caller left
            gateway.send(("error", call_id, encode_error(e)))
            return
        # The charge is settled with the answer, but for a generation that
        # stops at its next step: then it follows as its own message.
        units = request.charge.units
        done = (trace.queued_s, trace.run_s, trace.batch_size, units)
        gateway.send(("done", call_id, outputs, *done))
        if units is None:
            request.charge.when_settled(settled)

    async def _call(self, gateway: _Gateway, call_id: int, method: str, args: tuple[Any]) -> None:
        if method not in CALLS:
            gateway.send(("reply", call_id, False, encode_error(ValueError(method))))
            return
        try:
            value = await getattr(self.engine, method)(*args)
        except Exception as e:
            reply: tuple[Any, ...] = ("reply", call_id, False, encode_error(e))
        else:
            reply = ("reply", call_id, True, value)
        gateway.send(self._state())  # what the call changed, read before its reply
        gateway.send(reply)


def _send(
    loop: asyncio.AbstractEventLoop,
    gateway: _Gateway,
    kind: str,
    call_id: int,
    index: int,
    what: object,
) -> None:
    """A streamed piece (or its logprobs) of item ``index``, from the worker
    thread that generates it."""
    loop.call_soon_threadsafe(gateway.send, (kind, call_id, index, what))
