"""Helpers shared by the API modules: the engine from the app, disconnect-aware
awaiting, and the body size limit."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.admission import TenantLimits
from tessera.engine import Caller, ServingEngine, Submission
from tessera.errors import InvalidInputError, ModelHiddenError, RequestCancelledError
from tessera.gateway.errors import error_body_for
from tessera.metrics.stats import ModelStats
from tessera.scheduling import DEFAULT_TIERS, TierSpec
from tessera.tasks.image import RequestImageLimits, check_request_images
from tessera.tasks.types import Task, item_images
from tessera.tenants import Principal

T = TypeVar("T")
B = TypeVar("B", bound=BaseModel)


def engine_of(request: HTTPConnection) -> ServingEngine:
    engine: ServingEngine = request.app.state.engine
    return engine


def principal_of(request: HTTPConnection) -> Principal | None:
    principal: Principal | None = getattr(request.state, "principal", None)
    return principal


def parsed(schema: type[B], raw: bytes | dict[str, Any]) -> B:
    """A body read by the route itself (JSON bytes whatever its content type,
    or a form's fields) as ``schema``; where it does not validate, the
    ``RequestValidationError`` FastAPI raises for a body it reads (answered
    with the API's status for an invalid request, ``gateway/errors.py``)."""
    try:
        if isinstance(raw, bytes):
            return schema.model_validate_json(raw)
        return schema.model_validate(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e


def visible_models(request: Request) -> list[str]:
    """The models the caller may use (all of them when auth is off)."""
    names = engine_of(request).model_names()
    principal = principal_of(request)
    return [n for n in names if principal is None or principal.tenant.allows(n)]


def visible_current(request: Request) -> list[ModelStats]:
    """The current version of each model the caller may use, by its name:
    a model of version folders is listed once, by the name requests give
    (``model``, not ``model@version``), as one without them."""
    allowed = set(visible_models(request))
    current = [m for m in engine_of(request).snapshot().models if m.current and m.model in allowed]
    return sorted(current, key=lambda m: m.model)


def caller_of(request: HTTPConnection, model: str) -> Caller | None:
    """The caller's tenant limits and tier; 404 if it may not use ``model``
    (any version of it: ``model@2`` is ``model``'s), the same answer as for a
    model that does not exist, so that a tenant cannot learn other tenants'
    model names by probing."""
    model = model.partition("@")[0]
    principal = principal_of(request)
    if principal is None:
        return None
    tenant = principal.tenant
    if not tenant.allows(model):
        raise ModelHiddenError(model)
    tiers: dict[str, TierSpec] = getattr(request.app.state, "tiers", DEFAULT_TIERS)
    tier = tiers.get(tenant.tier, TierSpec(tenant.tier, 1.0))
    limits = TenantLimits(
        tenant.name, tenant.qps, tenant.burst, tenant.max_concurrency, tenant.daily_units
    )
    return Caller(limits, tier.name, tier.weight, tier.latency_target_s)


async def submit_task(request: Request, model: str, task: Task, items: list[Any]) -> Submission:
    """Admit and queue a request for ``model`` (``model@version`` for that
    version; refusals raise here). The response names the version that
    answers (``x-model-version``), as the audit row does (``model@version``
    for a model with version folders). Its images, read from their headers and
    not decoded yet, are bounded first (``check_request_images``, 413)."""
    info = request.state.audit
    info.model, info.task = model, task.value
    check_request_images(item_images(items), image_limits_of(request))
    caller = caller_of(request, model)
    submission = await engine_of(request).asubmit(
        model, task, items, timeout_s=timeout_of(request), caller=caller
    )
    info.model = submission.model
    request.state.model_version = submission.version
    info.trace.charge = submission.request.charge  # the audit row waits for it
    return submission


async def run_task(request: Request, model: str, task: Task, items: list[Any]) -> list[Any]:
    """Submit a request and await its outputs, unless the client goes away first."""
    submission = await submit_task(request, model, task, items)
    engine = engine_of(request)
    return await unless_disconnected(request, engine.wait(submission, request.state.audit.trace))


async def started_task(
    request: Request, model: str, task: Task, items: list[Any]
) -> asyncio.Future[list[Any]]:
    """Submit a request (a refusal raises here, to be an HTTP status) and
    wait for its outputs in a task of its own, which runs on whether or not
    its stream is read, so that its admission is released."""
    submission = await submit_task(request, model, task, items)
    engine = engine_of(request)
    return asyncio.ensure_future(engine.wait(submission, request.state.audit.trace))


def image_limits_of(request: HTTPConnection) -> RequestImageLimits:
    """The app's bounds on a request's images (``create_app``'s ``image_limits``)."""
    limits: RequestImageLimits | None = getattr(request.app.state, "image_limits", None)
    return limits or RequestImageLimits()


def timeout_of(request: Request) -> float | None:
    """The caller's deadline from ``x-request-timeout`` (seconds), if any; a
    value that is not a positive, finite number is the request's error (its
    caller meant a deadline: ignoring it would run the request without one)."""
    raw = request.headers.get("x-request-timeout")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise InvalidInputError(
            f"x-request-timeout must be a positive number of seconds, not {raw[:40]!r}"
        )
    return value


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it (its queued
    request is then dropped before it runs). ``work`` runs in the caller's task
    (one task a request fewer than running it in its own): the watcher cancels
    that task, and the cancellation it caused becomes ``RequestCancelledError``."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _disconnected(request)
        gone = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        raise RequestCancelledError("client disconnected") from None
    finally:
        watcher.cancel()


class JsonBodyRoute(APIRoute):
    """A route whose pydantic ``body`` is read as JSON whatever its content
    type: none, ``text/plain``, or a form's (``curl -d`` sends one), as
    Ollama's routes read theirs; FastAPI reads JSON only under a JSON type,
    and answered such a body "Input should be a valid dictionary". A route
    that reads its body itself (a form's upload) is left as it is."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def read_as_json(request: Request) -> Response:
            # Before FastAPI reads the headers (a Request reads them once, lazily).
            headers = request.scope["headers"]
            if not any(k == b"content-type" and _is_json(v) for k, v in headers):
                kept = [(k, v) for k, v in headers if k != b"content-type"]
                request.scope["headers"] = [*kept, (b"content-type", b"application/json")]
            return await handler(request)

        return read_as_json


def _is_json(content_type: bytes) -> bool:
    """``application/json``, or a ``+json`` type (with parameters or not)."""
    kind = content_type.partition(b";")[0].strip().lower()
    return kind == b"application/json" or (
        kind.startswith(b"application/") and kind.endswith(b"+json")
    )


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_body_bytes`` with 413, before parsing,
    and compressed ones (a ``Content-Encoding`` other than identity) with 415:
    no route decompresses a body, so none can be a decompression bomb."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                await self._refuse(scope, send)
                return
            if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
                message = f"Content-Encoding {value.decode('latin-1')[:40]!r} is not accepted"
                await self._refuse(scope, send, 415, message, "unsupported_media_type")
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._refuse(scope, send)

    async def _refuse(
        self,
        scope: Scope,
        send: Send,
        status: int = 413,
        message: str = "",
        kind: str = "payload_too_large",
    ) -> None:
        import json

        message = message or f"request body over {self.max_body_bytes} bytes"
        body = json.dumps(error_body_for(scope.get("path", ""), status, message, kind)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass
