"""Around every request: a request id, authentication, and one audit row.

- ``x-request-id`` is taken from the request or made, and returned;
  ``x-device-seconds``, on an answer whose work ran, is its share of the
  device time of the batches it ran in (``tessera.costs``), as audited.
- When the app has a tenant store, every route but the health probes needs
  an API key (``Authorization: Bearer KEY``, DeepL's ``DeepL-Auth-Key KEY``,
  or ``x-api-key``): none, unknown or revoked → 401; ``/admin``, Triton's
  repository loads and unloads and ``/metrics`` need an admin key → 403
  (``/metrics`` is public where ``app.state.metrics_public`` is set). Keys
  are checked against the store on each request, so revocations apply at
  once. Without a store (``--no-auth``) admin changes are refused (403) where
  ``app.state.admin_changes`` is false: nobody is known to make them.
- Failed authentication is throttled per client address (``AuthThrottle``):
  past its threshold a failing address gets 429 with ``Retry-After``; a right
  key still passes (see ``tenants/throttle.py`` for why).
- One audit row per API request, refused ones included, one per admin change
  (``admin_change``: its action, its model where the route names one), and
  one per request refused by authentication or permission on any route,
  written off the hot path by ``AuditLog``; routes add the model, task and
  trace in ``request.state``. Nothing of the key but its public prefix is
  ever logged or audited.
- A WebSocket passes through with the throttle in its scope's state: it
  authenticates itself, at the handshake or by its first message, and audits
  each of its messages with ``audit_request`` (``gateway/websocket.py``).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.clock import Clock, MonotonicClock
from tessera.engine import RequestTrace
from tessera.gateway.errors import api_of, error_body_for, metered
from tessera.logs import request_id as request_id_var
from tessera.metrics import RequestEvent, StatsSink
from tessera.tenants import AuditRecord, Principal
from tessera.tenants.throttle import AuthThrottle

PUBLIC_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/v2", "/openapi.json", "/docs"})
# The live page and its assets hold no data (the page asks /admin/* with a key).
DASHBOARD_PATH = "/dashboard"
METRICS_PATH = "/metrics"


def public_paths(app_state: Any) -> frozenset[str]:
    """The routes open without a key: ``/metrics`` too where ``metrics_public`` is
    set, else it needs an admin key like ``/admin``."""
    if getattr(app_state, "metrics_public", False):
        return PUBLIC_PATHS | {METRICS_PATH}
    return PUBLIC_PATHS


# Triton's repository loads and unloads: the admin API's, in KServe's form.
_TRITON_REPOSITORY = re.compile(r"/v2/repository/models/[^/]+/(load|unload)")


def admin_only(path: str) -> bool:
    """Whether ``path`` needs an admin key."""
    return (
        path.startswith("/admin")
        or path == METRICS_PATH
        or bool(_TRITON_REPOSITORY.fullmatch(path))
    )


def admin_change(method: str, path: str) -> bool:
    """Whether a request changes what the server serves or who may use it (an
    admin route's POST, PUT, PATCH or DELETE): each is audited, with its action."""
    return method not in ("GET", "HEAD", "OPTIONS") and admin_only(path) and path != METRICS_PATH


# Under --no-auth nobody is known: nobody may change models, tenants or keys.
NO_AUTH_REFUSAL = (
    "admin changes are refused: this server runs without API keys (--no-auth);"
    " start it with keys to register, load, unload or retire models, or change tenants or keys"
)
_MODEL_ROUTES = ("/admin/models/", "/v2/repository/models/")


def is_dashboard(path: str) -> bool:
    return path == DASHBOARD_PATH or path.startswith(DASHBOARD_PATH + "/")


@dataclass
class AuditInfo:
    """What a route knows about its request, for the audit row."""

    model: str | None = None
    task: str | None = None
    trace: RequestTrace = field(default_factory=RequestTrace)
    reason: str | None = None
    action: str | None = None  # an admin change's method and route


def api_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            # DeepL's clients send their key under a scheme of their own.
            if scheme.lower() in ("bearer", "deepl-auth-key") and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            return value.decode("latin-1").strip()
    return None


@dataclass(frozen=True)
class _Refusal:
    status: int
    message: str
    reason: str
    retry_after_s: float | None = None
    kind: str | None = None  # the error type (else by status)


# New work while the server drains: 503 at once with a second's Retry-After.
DRAINING_REFUSAL = _Refusal(
    503,
    "the server is shutting down: no new requests",
    "shutting_down",
    retry_after_s=1.0,
    kind="shutting_down",
)


def _draining(app_state: Any) -> bool:
    engine = getattr(app_state, "engine", None)
    return engine is not None and engine.phase == "draining"


def _draining_refusal(app_state: Any, path: str) -> _Refusal | None:
    """A model's request while the server drains is refused before its key is
    checked and before any limit: a rate limit's 429 would tell its client to
    retry here, where a 503 sends it to another server."""
    if not _draining(app_state) or not metered(path):
        return None
    return DRAINING_REFUSAL


class RequestContextMiddleware:
    def __init__(
        self, app: ASGIApp, *, clock: Clock | None = None, throttle: AuthThrottle | None = None
    ) -> None:
        self.app = app
        self.throttle = throttle or AuthThrottle(clock or MonotonicClock())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            # The socket authenticates itself (a key at the handshake or in its
            # first message: gateway/websocket.py), under the same throttle.
            scope.setdefault("state", {})["auth_throttle"] = self.throttle
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        app_state = scope["app"].state
        state: dict[str, Any] = scope.setdefault("state", {})
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        request_id = next(
            (v.decode("latin-1") for k, v in headers if k == b"x-request-id"), uuid.uuid4().hex
        )[:128]
        state["request_id"] = request_id
        token = request_id_var.set(request_id)
        info = state["audit"] = AuditInfo()
        method: str = scope.get("method", "GET")
        if admin_change(method, scope["path"]):
            info.action = f"{method} {scope['path']}"
        started = time.monotonic()
        status, answered = 500, False
        # A client that hangs up before the response's last part (an SSE stream
        # it left) never had its answer: audited 499, not the 200 sent first.
        complete, gone = False, False

        async def receive_watched() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal status, answered, complete
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            if message["type"] == "http.response.start":
                status, answered = message["status"], True
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode("latin-1")),
                ]
                if "model_version" in state:  # the version that answered
                    version = state["model_version"].encode("latin-1")
                    message["headers"].append((b"x-model-version", version))
                charge = info.trace.charge
                if charge is not None and charge.settled:  # what it cost (``tessera.costs``)
                    device_s = f"{charge.device_s:.6f}".encode()
                    message["headers"].append((b"x-device-seconds", device_s))
                if _draining(app_state):
                    # Its connection closes after this answer (uvicorn honours
                    # the header): a client that kept it alive would otherwise
                    # send its next request as the server stops (a ReadError).
                    message["headers"].append((b"connection", b"close"))
            await send(message)

        try:
            refusal = _draining_refusal(app_state, scope["path"]) or self._authenticate(
                scope, app_state, state, headers
            )
            if refusal is not None:
                info.reason = refusal.reason
                await _respond(send_with_id, refusal, scope["path"])
                return
            await self.app(scope, receive_watched, send_with_id)
        except asyncio.CancelledError:
            if not answered:  # cancelled by its server (a gRPC call's client left): 499
                status = 499
            raise
        finally:
            if answered and gone and not complete:
                status = 499
            if info.action is not None and info.model is None:
                info.model = _model_of(scope)
            audit_request(app_state, state, info, status, started, scope["path"])
            request_id_var.reset(token)

    def _authenticate(
        self,
        scope: Scope,
        app_state: Any,
        state: dict[str, Any],
        headers: list[tuple[bytes, bytes]],
    ) -> _Refusal | None:
        store = getattr(app_state, "tenant_store", None)
        path: str = scope["path"]
        no_changes = store is None and not getattr(app_state, "admin_changes", True)
        if no_changes and admin_change(scope.get("method", "GET"), path):
            return _Refusal(403, NO_AUTH_REFUSAL, "no_auth")
        if store is None or path in public_paths(app_state) or is_dashboard(path):
            return None
        key = api_key(headers)
        principal: Principal | None = store.authenticate(key) if key is not None else None
        if principal is None:
            client = scope.get("client")
            wait_s = self.throttle.failed(client[0] if client else "")
            if wait_s is not None:
                return _Refusal(
                    429,
                    "too many failed authentications from this address;"
                    f" retry after {math.ceil(wait_s)} s",
                    "auth_throttled",
                    wait_s,
                )
            if key is None:
                return _Refusal(
                    401, "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key'", "auth"
                )
            return _Refusal(401, "invalid or revoked API key", "auth")
        state["principal"] = principal
        if admin_only(path) and not principal.admin:
            return _Refusal(403, "this route needs an admin key", "auth")
        return None


def audit_request(
    app_state: Any,
    state: dict[str, Any],
    info: AuditInfo,
    status: int,
    started: float,
    path: str,
) -> None:
    """One audit row and one ``RequestEvent`` for a request (a WebSocket
    message too), refused ones included; ``state`` holds its principal and id."""
    api = metered(path)
    if not api and info.reason not in ("auth", "auth_throttled") and info.action is None:
        return
    principal: Principal | None = state.get("principal")
    tenant = principal.tenant.name if principal else None
    total_s = time.monotonic() - started
    stats: StatsSink | None = getattr(app_state, "stats", None)
    if stats is not None and api:
        stats.on_request(
            RequestEvent(
                model=info.model,
                task=info.task,
                tier=principal.tenant.tier if principal else None,
                tenant=tenant,
                status=status,
                total_s=total_s,
                queue_s=info.trace.queued_s,
                reason=info.reason,
            )
        )
    audit_log = getattr(app_state, "audit_log", None)
    if audit_log is None:
        return
    trace = info.trace
    request_id = state.get("request_id")

    def record(units: float) -> None:
        audit_log.record(
            AuditRecord(
                ts=time.time(),
                tenant=tenant,
                key_prefix=principal.key_prefix if principal else None,
                model=info.model,
                task=info.task,
                units=units,
                status=status,
                queue_s=trace.queued_s,
                total_s=total_s,
                batch_size=trace.batch_size or None,
                request_id=request_id,
                reason=info.reason,
                action=info.action,
                device_s=trace.charge.device_s if trace.charge is not None else None,
            )
        )

    if trace.charge is None:
        record(0.0)  # refused before it was queued: nothing charged
    else:
        # Written once the charge is settled: at once for an answered request,
        # when the work stops for one whose caller left (the units that ran).
        trace.charge.when_settled(record)


def _model_of(scope: Scope) -> str | None:
    """The model an admin change names in its route, if it names one."""
    path: str = scope["path"]
    if not path.startswith(_MODEL_ROUTES):
        return None
    name = scope.get("path_params", {}).get("name")
    return name if isinstance(name, str) else None


async def _respond(send: Send, refusal: _Refusal, path: str) -> None:
    status = api_of(path).status(refusal.status, None)
    kind = refusal.kind or {401: "authentication_error", 403: "permission_denied"}.get(
        refusal.status, "rate_limited"
    )
    payload = error_body_for(path, status, refusal.message, kind)
    headers = [(b"content-type", b"application/json")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if refusal.retry_after_s is not None:
        retry_after = max(1, math.ceil(refusal.retry_after_s))
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})
