"""The hot API routes served without FastAPI's request machinery.

A request to ``/v1/embeddings`` spent about 40% of the gateway's CPU in
FastAPI and Starlette before and around its endpoint: matching it against
every route, solving its dependencies, parsing and validating its body, and
the exception wrappers of each layer (py-spy found the same on the H200).
``FastRoutes`` sits inside tessera's own middleware (request id,
authentication, audit, body limit) and serves the routes
``install_fast_routes`` is given itself: it matches them by their own path
pattern, validates a JSON body with its pydantic model straight from the
bytes, calls the same endpoint function with the same ``Request``, and turns
an exception into a response with the app's own exception handlers. So an
answer, an error and a refusal read exactly as through FastAPI.

Whatever it is not sure of goes to FastAPI as before, with the body it read
replayed: another method or path, a body that is not ``application/json``,
one that does not validate (FastAPI then raises the ``RequestValidationError``
it always raised, answered with its API's status for an invalid request), a
client gone while the body was read. The routes stay registered with FastAPI,
so the OpenAPI schema still shows them.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.convertors import Convertor
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

Endpoint = Callable[..., Awaitable[Response]]


@dataclass(frozen=True)
class FastRoute:
    """One route FastAPI also serves: its methods, path pattern and endpoint;
    ``body`` is the pydantic model of its ``body`` argument, if it has one."""

    methods: frozenset[str]
    pattern: re.Pattern[str]
    convertors: dict[str, Convertor[Any]]
    endpoint: Endpoint
    body: type[BaseModel] | None
    route: APIRoute

    @classmethod
    def of(cls, route: APIRoute) -> FastRoute:
        hints = typing.get_type_hints(route.endpoint)
        body = hints.get("body")
        if body is not None and not (isinstance(body, type) and issubclass(body, BaseModel)):
            raise TypeError(f"{route.path}: a fast route's body is a pydantic model")
        if "request" not in inspect.signature(route.endpoint).parameters:
            raise TypeError(f"{route.path}: a fast route's endpoint takes the request")
        return cls(
            frozenset(route.methods or ()),
            route.path_regex,
            route.param_convertors,
            route.endpoint,
            body,
            route,
        )


def install_fast_routes(
    app: FastAPI, routers: Iterable[APIRouter], endpoints: Iterable[Endpoint]
) -> None:
    """Serve the routes of ``endpoints`` in ``routers`` (included in ``app``
    without a prefix) with ``FastRoutes``; call it before tessera's other
    middleware is added, so that the fast routes run inside it."""
    wanted = set(endpoints)
    routes = [
        FastRoute.of(route)
        for router in routers
        for route in router.routes
        if isinstance(route, APIRoute) and route.endpoint in wanted
    ]
    missing = wanted - {route.endpoint for route in routes}
    if missing:
        raise ValueError(f"not routes of these routers: {sorted(e.__name__ for e in missing)}")
    app.add_middleware(FastRoutes, routes=routes)


class FastRoutes:
    def __init__(self, app: ASGIApp, routes: list[FastRoute]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            method, path = scope["method"], scope["path"]
            for route in self.routes:
                if method in route.methods:
                    match = route.pattern.match(path)
                    if match is not None:
                        await self._serve(route, match, scope, receive, send)
                        return
        await self.app(scope, receive, send)

    async def _serve(
        self, route: FastRoute, match: re.Match[str], scope: Scope, receive: Receive, send: Send
    ) -> None:
        params = {k: route.convertors[k].convert(v) for k, v in match.groupdict().items()}
        arguments: dict[str, Any] = dict(params)
        if route.body is not None:
            if not _is_json(scope):
                await self.app(scope, receive, send)
                return
            messages, body, whole = await _read_body(receive)
            parsed = _validate(route.body, body) if whole else None
            if parsed is None:
                await self.app(scope, _replay(messages, receive), send)
                return
            arguments["body"] = parsed
        scope["path_params"] = params
        scope["route"] = route.route
        request = Request(scope, receive)
        try:
            response = await route.endpoint(request=request, **arguments)
        except Exception as exc:
            handler = _handler_of(scope["app"], exc)
            if handler is None:
                raise
            answer = handler(request, exc)
            response = await answer if inspect.isawaitable(answer) else answer
        await response(scope, receive, send)


def _is_json(scope: Scope) -> bool:
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for name, value in headers:
        if name == b"content-type":
            media = value.partition(b";")[0].strip().lower()
            return media == b"application/json"
    return False


async def _read_body(receive: Receive) -> tuple[list[Message], bytes, bool]:
    """The messages read, the body they carry, and whether it is whole (false
    if the client went away first)."""
    messages: list[Message] = []
    chunks: list[bytes] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, b"", False
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return messages, b"".join(chunks), True


def _validate(model: type[BaseModel], body: bytes) -> BaseModel | None:
    try:
        return model.model_validate_json(body)
    except ValidationError:
        return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that gives ``messages`` again before reading on."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def _handler_of(app: Any, exc: Exception) -> Callable[[Request, Exception], Any] | None:
    """The app's exception handler for ``exc`` (the nearest class up its MRO),
    as Starlette's exception middleware finds it."""
    handlers: dict[Any, Callable[[Request, Exception], Any]] = app.exception_handlers
    for cls in type(exc).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None
