"""One WebSocket, ``/v1/ws``, for every task.

Each client message is a JSON object with an ``id`` of the client's choosing,
a ``type`` (``embeddings``, ``chat``, ``ocr``, ``rerank``, ``classify``,
``translate``, ``speech``), a ``model`` and the task's fields as in its HTTP
API (an optional ``timeout``, seconds, as ``x-request-timeout``; OCR takes
``image`` or a list of ``images``, pages of one request). Every answer
carries the id it answers:

- ``{"id", "type": "result", "data"}``: the HTTP API's body (speech: the
  audio base64 in ``data.audio``; OCR: ``data.pages``, one body a page);
- ``{"id", "type": "delta", "content"}``: a chat's text as it is generated
  (with ``"stream": true``; ``logprobs``: its tokens', where asked for);
- ``{"id", "type": "page", "index", "data"}``: an OCR page's body as soon
  as that page is read (pages run as requests of their own);
- ``{"id", "type": "error", "error": {"message", "type", "code"}}``: the
  HTTP API's error and status code (and ``retry_after`` seconds where HTTP
  sends ``Retry-After``); the socket stays open.

Several messages may be in flight on one socket; each is answered as it
finishes, through the engine's ``submit``/``wait`` under the tenant's caller
(admission, fair scheduling, deadlines), with one audit row and one request
event per engine request, as HTTP's. Authentication: the same API keys, in
the handshake's ``Authorization``/``x-api-key`` header, or in a first message
``{"type": "auth", "key"}`` (answered ``{"type": "auth", "tenant"}``) within
the server's ``header_timeout_s`` of the handshake (as an HTTP request's head
must come), under the HTTP throttle of failed keys; a later
``auth`` message (no ``id``) changes the socket's key; the key is checked again at every message,
as HTTP checks it at every request, so a revoked key closes its sockets (1008)
at their next message and a changed tenant's limits apply at once.
Backpressure: at most ``MAX_IN_FLIGHT`` messages in flight on a socket; one
more is answered with an error 429 ``too_many_in_flight`` for its id
(reading goes on, so the client learns at once), and answers are written one
at a time, awaiting the socket, so a client that does not read holds only
its own requests' answers.

The socket is closed, with an error message first where one can be sent,
with 1008 (policy) for a missing, wrong or revoked key, or anything before
authentication; 1003 for a binary message; 1007 for a message that is not a
JSON object with a string ``id``; 1009 for a message over the server's
``max_body_bytes``. A client that goes away cancels its requests in flight:
queued ones never run and a generation stops at its next step (the
request's stop flag), charged what ran.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import orjson
from fastapi import APIRouter, WebSocket
from pydantic import BaseModel, Field
from starlette.websockets import WebSocketDisconnect

from tessera.config import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from tessera.engine import ServingEngine
from tessera.errors import InvalidInputError, RequestCancelledError, TesseraError
from tessera.gateway.common import caller_of, image_limits_of
from tessera.gateway.context import AuditInfo, api_key, audit_request
from tessera.gateway.errors import (
    api_of,
    error_body,
    error_headers,
    log_unhandled,
    reject_reason,
    status_of,
)
from tessera.gateway.openai_audio import SpeechRequest
from tessera.gateway.openai_chat import ChatRequest, chat_inputs, chat_task, completion_body
from tessera.gateway.openai_completions import (
    CompletionRequest,
    completion_inputs,
    text_completion_body,
)
from tessera.gateway.openai_embeddings import EmbeddingRequest, embeddings_body, texts_of
from tessera.gateway.openai_stream import Pieces, pieces_of
from tessera.gateway.tasks_api import (
    ClassifyRequest,
    OcrOptions,
    RerankRequest,
    TranslateRequest,
    classify_body,
    ocr_body,
    ocr_item,
    rerank_body,
    rerank_items,
    translate_body,
)
from tessera.logs import request_id as request_id_var
from tessera.tasks.audio import encoded
from tessera.tasks.image import check_request_images, decode_base64, read_image
from tessera.tasks.types import SpeechInput, Task, TextInput, TranslateInput, item_images
from tessera.tenants import Principal
from tessera.tenants.throttle import AuthThrottle

router = APIRouter()

PATH = "/v1/ws"
# Its API (tessera's own, under /v1): its errors' statuses, as over HTTP.
API = api_of(PATH)
# Routes and exception types whose traceback was logged (errors.log_unhandled).
_TRACEBACKS_LOGGED: set[tuple[str, str]] = set()
MAX_IN_FLIGHT = 32
# Close codes (RFC 6455).
UNSUPPORTED_DATA = 1003
INVALID_PAYLOAD = 1007
POLICY_VIOLATION = 1008
MESSAGE_TOO_BIG = 1009

M = TypeVar("M", bound=BaseModel)


@router.websocket(PATH)
async def websocket_endpoint(websocket: WebSocket) -> None:
    await websocket.accept()
    await _Session(websocket).serve()


class _Close(Exception):
    """Close the socket with ``code``, telling the client why first."""

    def __init__(self, code: int, message: str, status: int, kind: str) -> None:
        super().__init__(message)
        self.code, self.status, self.kind = code, status, kind


@dataclass
class _Message:
    """One client message being answered."""

    id: str
    request_id: str
    audited: bool = False
    started: float = field(default_factory=time.monotonic)


class OcrMessage(OcrOptions):
    model: str
    image: str | None = Field(default=None, min_length=1)
    images: list[str] | None = Field(default=None, min_length=1)
    mode: Literal["page", "line"] = "page"


class _Session:
    """One socket: its principal, its messages in flight, one writer at a time."""

    def __init__(self, websocket: WebSocket) -> None:
        self.ws = websocket
        self.app_state = websocket.app.state
        self.engine: ServingEngine = self.app_state.engine
        self.store = getattr(self.app_state, "tenant_store", None)
        self.max_bytes: int = getattr(self.app_state, "max_body_bytes", DEFAULT_MAX_BODY_BYTES)
        self.principal: Principal | None = None
        self._key: str | None = None  # checked again at each message: a revoked key ends it
        self.in_flight: dict[str, asyncio.Task[None]] = {}
        self._send_lock = asyncio.Lock()
        headers = websocket.scope.get("headers", [])
        given = next((v.decode("latin-1") for k, v in headers if k == b"x-request-id"), "")
        self.connection_id = (given or uuid.uuid4().hex[:16])[:64]

    async def serve(self) -> None:
        try:
            if self.store is not None and api_key(self.ws.scope.get("headers", [])) is not None:
                self._authenticate(api_key(self.ws.scope.get("headers", [])))
            await self._read()
        except _Close as close:
            await self.send({"type": "error", **error_body(close.status, str(close), close.kind)})
            await self._close(close.code, str(close))
        finally:
            tasks = list(self.in_flight.values())
            for task in tasks:
                task.cancel()  # the client is gone: stop its work
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "websocket.disconnect":
                return
            payload = self._payload(message)
            anew = payload.get("type") == "auth" and "id" not in payload
            if self.store is not None and (self.principal is None or anew):
                self._first_message(payload)
                await self.send({"type": "auth", "tenant": self._tenant()})
                continue
            if self.store is not None:
                self._authenticate(self._key)  # as HTTP does at each request
            self._dispatch(payload)

    async def _receive(self) -> MutableMapping[str, Any]:
        """The next message; before a key, within the server's ``header_timeout_s``
        (else a 1008 close)."""
        if self.store is None or self.principal is not None:
            return await self.ws.receive()
        wait_s = getattr(self.app_state, "header_timeout_s", DEFAULT_HEADER_TIMEOUT_S)
        try:
            async with asyncio.timeout(wait_s):
                return await self.ws.receive()
        except TimeoutError:
            raise _Close(
                POLICY_VIOLATION,
                f'no key within {wait_s:g} s: send {{"type": "auth", "key": KEY}} first',
                408,
                "request_timeout",
            ) from None

    def _payload(self, message: MutableMapping[str, Any]) -> dict[str, Any]:
        text = message.get("text")
        if text is None:
            raise _Close(
                UNSUPPORTED_DATA,
                "messages are JSON text, not binary",
                415,
                "unsupported_media_type",
            )
        if len(text) > self.max_bytes or len(text.encode()) > self.max_bytes:
            raise _Close(
                MESSAGE_TOO_BIG,
                f"message over {self.max_bytes} bytes",
                413,
                "payload_too_large",
            )
        try:
            payload = json.loads(text)
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise _Close(
                INVALID_PAYLOAD, f"message is not JSON: {e}", API.invalid, "invalid_request_error"
            ) from e
        if not isinstance(payload, dict):
            raise _Close(
                INVALID_PAYLOAD, "a message is a JSON object", API.invalid, "invalid_request_error"
            )
        return payload

    def _first_message(self, payload: dict[str, Any]) -> None:
        if payload.get("type") != "auth":
            raise _Close(
                POLICY_VIOLATION,
                'authenticate first: an Authorization header, or {"type": "auth", "key": KEY}',
                401,
                "authentication_error",
            )
        key = payload.get("key")
        self._authenticate(key if isinstance(key, str) and key else None)

    def _authenticate(self, key: str | None) -> None:
        """The key's principal, or a 1008 close (audited, throttled as HTTP's)."""
        principal = self.store.authenticate(key) if key is not None and self.store else None
        if principal is not None:
            self.principal, self._key = principal, key
            self.ws.state.principal = principal
            return
        throttle: AuthThrottle | None = self.ws.scope.get("state", {}).get("auth_throttle")
        client = self.ws.scope.get("client")
        wait_s = throttle.failed(client[0] if client else "") if throttle is not None else None
        info = AuditInfo(reason="auth_throttled" if wait_s is not None else "auth")
        state = {"request_id": self.connection_id}
        status = 429 if wait_s is not None else 401
        audit_request(self.app_state, state, info, status, time.monotonic(), PATH)
        if wait_s is not None:
            raise _Close(
                POLICY_VIOLATION,
                f"too many failed authentications; retry after {math.ceil(wait_s)} s",
                429,
                "rate_limited",
            )
        raise _Close(
            POLICY_VIOLATION, "missing, invalid or revoked API key", 401, "authentication_error"
        )

    def _tenant(self) -> str | None:
        return self.principal.tenant.name if self.principal is not None else None

    def _dispatch(self, payload: dict[str, Any]) -> None:
        message_id = payload.get("id")
        if not isinstance(message_id, str) or not message_id or len(message_id) > 128:
            raise _Close(
                INVALID_PAYLOAD,
                "every message needs an id: a string of 1 to 128 characters",
                API.invalid,
                "invalid_request_error",
            )
        message = _Message(message_id, f"{self.connection_id}/{message_id}")
        if message_id in self.in_flight:  # refused untracked: the first keeps its id
            error = InvalidInputError(f"a message of id {message_id!r} is in flight already")
            self._spawn(message, self._refuse(message, error), track=False)
            return
        if len(self.in_flight) >= MAX_IN_FLIGHT:
            self._spawn(message, self._too_many(message), track=False)
            return
        self._spawn(message, self._handle(message, payload))

    def _spawn(self, message: _Message, work: Awaitable[None], *, track: bool = True) -> None:
        task = asyncio.ensure_future(work)
        if track:
            self.in_flight[message.id] = task
            task.add_done_callback(lambda _: self.in_flight.pop(message.id, None))

    async def _too_many(self, message: _Message) -> None:
        body = error_body(
            429,
            f"more than {MAX_IN_FLIGHT} messages in flight on this socket",
            "too_many_in_flight",
        )
        info = AuditInfo(reason="too_many_in_flight")
        audit_request(self.app_state, self._state(message), info, 429, message.started, PATH)
        await self.send({"id": message.id, "type": "error", **body})

    async def _refuse(self, message: _Message, error: TesseraError) -> None:
        status, _ = status_of(error, API)
        info = AuditInfo(reason=reject_reason(error))
        audit_request(self.app_state, self._state(message), info, status, message.started, PATH)
        await self._send_error(message, error)

    def _state(self, message: _Message) -> dict[str, Any]:
        return {"principal": self.principal, "request_id": message.request_id}

    async def _handle(self, message: _Message, payload: dict[str, Any]) -> None:
        token = request_id_var.set(message.request_id)
        try:
            kind = payload.get("type")
            handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise InvalidInputError(f"unknown type {kind!r}; one of {sorted(_HANDLERS)}")
            await handler(self, message, payload)
        except TesseraError as e:
            if isinstance(e, RequestCancelledError):
                return
            await self._answer_error(message, e)
        except Exception as e:  # a bug, not the caller's: one log line, an answer for its id
            log_unhandled(f"WS {PATH} {payload.get('type')!s:.40}", e, _TRACEBACKS_LOGGED)
            body = error_body(500, f"internal error: {type(e).__name__}", "internal_error")
            if not message.audited:
                state, info = self._state(message), AuditInfo(reason="internal_error")
                audit_request(self.app_state, state, info, 500, message.started, PATH)
            await self.send({"id": message.id, "type": "error", **body})
        finally:
            request_id_var.reset(token)

    async def _answer_error(self, message: _Message, error: TesseraError) -> None:
        if not message.audited:
            await self._refuse(message, error)
        else:
            await self._send_error(message, error)

    async def _send_error(self, message: _Message, error: TesseraError) -> None:
        status, kind = status_of(error, API)
        answer: dict[str, Any] = {
            "id": message.id,
            "type": "error",
            **error_body(status, str(error), kind),
        }
        retry_after = error_headers(error).get("Retry-After")
        if retry_after is not None:
            answer["retry_after"] = float(retry_after)
        await self.send(answer)

    async def run(
        self,
        message: _Message,
        model: str,
        task: Task,
        items: list[Any],
        timeout_s: float | None,
        request_id: str | None = None,
    ) -> list[Any]:
        """One engine request under the tenant's caller: submitted, awaited, audited."""
        info = AuditInfo(model=model, task=task.value)
        state = {"principal": self.principal, "request_id": request_id or message.request_id}
        started, status = time.monotonic(), 500
        message.audited = True
        try:
            caller = caller_of(self.ws, model)
            check_request_images(item_images(items), image_limits_of(self.ws))
            submission = await self.engine.asubmit(
                model, task, items, timeout_s=timeout_s, caller=caller
            )
            info.model = submission.model
            outputs = await self.engine.wait(submission, info.trace)
            status = 200
            return outputs
        except TesseraError as e:
            status = status_of(e, API)[0]
            info.reason = reject_reason(e)
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            audit_request(self.app_state, state, info, status, started, PATH)

    async def result(self, message: _Message, data: dict[str, Any]) -> None:
        await self.send({"id": message.id, "type": "result", "data": data})

    async def send(self, answer: dict[str, Any]) -> None:
        text = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY).decode()
        async with self._send_lock:
            # Gone: the reader sees the disconnect and cancels the rest.
            with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                await self.ws.send_text(text)

    async def _close(self, code: int, reason: str) -> None:
        async with self._send_lock:
            with contextlib.suppress(RuntimeError, OSError):
                await self.ws.close(code, reason[:120])


def _parse(model: type[M], payload: dict[str, Any]) -> M:
    try:
        return model.model_validate(payload)
    except ValueError as e:
        raise InvalidInputError(f"invalid request: {e}") from e


def _timeout(payload: dict[str, Any]) -> float | None:
    value = payload.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise InvalidInputError("timeout must be a positive number of seconds")
    return float(value)


async def _embeddings(session: _Session, message: _Message, payload: dict[str, Any]) -> None:
    body = _parse(EmbeddingRequest, payload)
    items = [TextInput(t) for t in texts_of(body.input)]
    vectors = await session.run(message, body.model, Task.EMBEDDING, items, _timeout(payload))
    limits = session.engine.spec(body.model).inputs
    await session.result(message, embeddings_body(body, items, vectors, limits))


async def _rerank(session: _Session, message: _Message, payload: dict[str, Any]) -> None:
    body = _parse(RerankRequest, payload)
    items = rerank_items(body)
    scores = await session.run(message, body.model, Task.RERANK, items, _timeout(payload))
    await session.result(message, rerank_body(body, scores))


async def _classify(session: _Session, message: _Message, payload: dict[str, Any]) -> None:
    body = _parse(ClassifyRequest, payload)
    items = [TextInput(t) for t in body.texts()]
    outputs = await session.run(message, body.model, Task.CLASSIFY, items, _timeout(payload))
    await session.result(message, classify_body(body, outputs))


async def _translate(session: _Session, message: _Message, payload: dict[str, Any]) -> None:
    body = _parse(TranslateRequest, payload)
    items = [TranslateInput(t) for t in texts_of(body.input)]
    outputs = await session.run(message, body.model, Task.TRANSLATE, items, _timeout(payload))
    await session.result(message, translate_body(body, outputs))


async def _speech(session: _Session, message: _Message, payload: dict[str, Any]) -> None:
    body = _parse(SpeechRequest, payload)
    if not body.input.strip():
        raise InvalidInputError("input must not be blank")
    items = [SpeechInput(body.input, body.speed)]
    (output,) = await session.run(message, body.model, Task.TTS, items, _timeout(payload))
    audio = await asyncio.to_thread(encoded, output, body.response_format)
    data = {
        "model": body.model,
        "format": body.response_format,
        "sample_rate": audio.sample_rate,
        "audio": base64.b64encode(audio.data).decode(),
    }
    await session.result(message, data)


async def _deltas(
    session: _Session,
    message: _Message,
    work: asyncio.Future[list[Any]],
    pieces: Pieces,
) -> list[Any]:
    """Each streamed piece as a ``delta`` message, then ``work``'s outputs."""
    try:
        async for piece in pieces_of(work, pieces):
            delta = {"id": message.id, "type": "delta", "index": piece.index, "content": piece.text}
            if piece.logprobs:
                delta["logprobs"] = list(piece.logprobs)
            await session.send(delta)
        return work.result()
    finally:
        if not work.done():
            work.cancel()


async def _chat(session: _Session, message: _Message, payload: dict[str, Any]) -> None:
    body = _parse(ChatRequest, payload)
    completion_id, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    pieces: Pieces = asyncio.Queue()
    task = chat_task(session.engine, body.model)
    items = chat_inputs(body, pieces if body.stream else None)
    work = asyncio.ensure_future(session.run(message, body.model, task, items, _timeout(payload)))
    outputs = await _deltas(session, message, work, pieces)
    await session.result(message, completion_body(body.model, outputs, completion_id, created))


async def _completion(session: _Session, message: _Message, payload: dict[str, Any]) -> None:
    """A legacy completion: the prompt continued as it is; deltas as a chat's."""
    body = _parse(CompletionRequest, payload)
    completion_id, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    pieces: Pieces = asyncio.Queue()
    items = completion_inputs(body, pieces if body.stream else None)
    work = asyncio.ensure_future(
        session.run(message, body.model, Task.GENERATE, items, _timeout(payload))
    )
    outputs = await _deltas(session, message, work, pieces)
    await session.result(message, text_completion_body(body, outputs, completion_id, created))


async def _ocr(session: _Session, message: _Message, payload: dict[str, Any]) -> None:
    body = _parse(OcrMessage, payload)
    if (body.image is None) == (body.images is None):
        raise InvalidInputError("give 'image' or 'images' (a list of pages), one of them")
    spec = session.engine.spec_for(body.model, Task.OCR)
    pages = [body.image] if body.image is not None else list(body.images or ())
    items = [ocr_item(spec, read_image(decode_base64(p)), body.mode, body) for p in pages]
    # The message's pages, bounded together before any runs (each runs as a request).
    check_request_images(item_images(items), image_limits_of(session.ws))
    bodies: list[dict[str, Any] | None] = [None] * len(items)
    timeout = _timeout(payload)

    async def page(index: int) -> None:
        request_id = f"{message.request_id}/{index}" if len(items) > 1 else None
        (output,) = await session.run(
            message, body.model, Task.OCR, [items[index]], timeout, request_id
        )
        bodies[index] = ocr_body(body.model, output, body.task)
        await session.send(
            {"id": message.id, "type": "page", "index": index, "data": bodies[index]}
        )

    try:
        async with asyncio.TaskGroup() as group:
            for index in range(len(items)):
                group.create_task(page(index))
    except ExceptionGroup as failed:  # a page's failure is the message's, as it is
        raise _first_leaf(failed) from None
    await session.result(message, {"model": body.model, "pages": bodies})


def _first_leaf(group: BaseExceptionGroup[Exception]) -> Exception:
    """The first exception of ``group`` that is not a group itself."""
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


_Handler = Callable[[_Session, _Message, dict[str, Any]], Awaitable[None]]
_HANDLERS: dict[str, _Handler] = {
    "embeddings": _embeddings,
    "chat": _chat,
    "completion": _completion,
    "ocr": _ocr,
    "rerank": _rerank,
    "classify": _classify,
    "translate": _translate,
    "speech": _speech,
}
