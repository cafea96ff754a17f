"""Around every request: a request id, authentication, and one audit row.

- ``x-request-id`` is taken from the request or made, and returned.
- When the app has a tenant store, every route but the health probes needs
  an API key (``Authorization: Bearer KEY`` or ``x-api-key``): none, unknown
  or revoked → 401; ``/admin`` and ``/metrics`` need an admin key → 403
  (``/metrics`` is public where ``app.state.metrics_public`` is set). Keys are checked
  against the store on each request, so revocations apply at once.
- One audit row per request, refused ones included, written off the hot path
  by ``AuditLog``; routes add the model, task and trace in ``request.state``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.engine import RequestTrace
from tessera.gateway.errors import error_body
from tessera.logs import request_id as request_id_var
from tessera.metrics import RequestEvent, StatsSink
from tessera.tenants import AuditRecord, Principal

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


def is_dashboard(path: str) -> bool:
    return path == DASHBOARD_PATH or path.startswith(DASHBOARD_PATH + "/")


@dataclass
class AuditInfo:
    """What a route knows about its request, for the audit row."""

    model: str | None = None
    task: str | None = None
    trace: RequestTrace = field(default_factory=RequestTrace)
    reason: str | None = None


def api_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            return value.decode("latin-1").strip()
    return None


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        started = time.monotonic()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode("latin-1")),
                ]
            await send(message)

        try:
            refusal = self._authenticate(scope, app_state, state, headers)
            if refusal is not None:
                info.reason = "auth"
                await _respond(send_with_id, *refusal, scope["path"])
                return
            await self.app(scope, receive, send_with_id)
        finally:
            self._audit(app_state, state, info, status, started, scope["path"])
            request_id_var.reset(token)

    def _authenticate(
        self,
        scope: Scope,
        app_state: Any,
        state: dict[str, Any],
        headers: list[tuple[bytes, bytes]],
    ) -> tuple[int, str] | None:
        store = getattr(app_state, "tenant_store", None)
        path: str = scope["path"]
        if store is None or path in public_paths(app_state) or is_dashboard(path):
            return None
        key = api_key(headers)
        if key is None:
            return 401, "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key'"
        principal: Principal | None = store.authenticate(key)
        if principal is None:
            return 401, "invalid or revoked API key"
        state["principal"] = principal
        if (path.startswith("/admin") or path == METRICS_PATH) and not principal.admin:
            return 403, "this route needs an admin key"
        return None

    def _audit(
        self,
        app_state: Any,
        state: dict[str, Any],
        info: AuditInfo,
        status: int,
        started: float,
        path: str,
    ) -> None:
        if not (path.startswith("/v1/") or path.startswith("/v2/models")) or path == "/v1/models":
            return
        principal: Principal | None = state.get("principal")
        tenant = principal.tenant.name if principal else None
        total_s = time.monotonic() - started
        stats: StatsSink | None = getattr(app_state, "stats", None)
        if stats is not None:
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
        audit_log.record(
            AuditRecord(
                ts=time.time(),
                tenant=tenant,
                key_prefix=principal.key_prefix if principal else None,
                model=info.model,
                task=info.task,
                units=info.trace.units,
                status=status,
                queue_s=info.trace.queued_s,
                total_s=total_s,
                batch_size=info.trace.batch_size or None,
                request_id=state.get("request_id"),
                reason=info.reason,
            )
        )


async def _respond(send: Send, status: int, message: str, path: str) -> None:
    kind = "authentication_error" if status == 401 else "permission_denied"
    payload: dict[str, Any] = (
        {"error": message} if path.startswith("/v2") else error_body(status, message, kind)
    )
    headers = [(b"content-type", b"application/json")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})
