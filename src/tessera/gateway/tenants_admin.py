"""Admin API for tenants, API keys and usage, over the app's ``TenantStore``
(``app.state.tenant_store``) and ``AuditLog`` (``app.state.audit_log``).

Admin-only access is enforced by the app for the whole ``/admin`` prefix, not
here. Handlers are plain functions: FastAPI runs them in its thread pool, so
the SQLite calls never block the event loop.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from tessera.errors import InvalidInputError, InvalidTenantError, TenantError
from tessera.tenants.audit import AuditLog, parse_time, start_of_day_utc
from tessera.tenants.store import DEFAULT_TIER, ApiKey, Tenant, TenantStore

router = APIRouter(prefix="/admin", tags=["admin"])


class TenantCreate(BaseModel):
    """POST /admin/tenants. Unset limits mean unlimited; ``models`` null = all."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    tier: str = DEFAULT_TIER
    qps: float | None = None
    burst: int | None = None
    max_concurrency: int | None = None
    daily_units: float | None = None
    models: list[str] | None = None


class TenantPatch(BaseModel):
    """PATCH /admin/tenants/{name}: only the fields present change; null lifts a limit."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tier: str | None = None
    qps: float | None = None
    burst: int | None = None
    max_concurrency: int | None = None
    daily_units: float | None = None
    models: list[str] | None = None


class KeyCreate(BaseModel):
    """POST /admin/keys."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tenant: str
    admin: bool = False


def _store(request: Request) -> TenantStore:
    store = getattr(request.app.state, "tenant_store", None)
    if not isinstance(store, TenantStore):
        raise TenantError("the tenant store is not configured")
    return store


MAX_STEPS = 10_000


def _audit_log(request: Request) -> AuditLog:
    audit = getattr(request.app.state, "audit_log", None)
    if not isinstance(audit, AuditLog):
        raise TenantError("the audit log is not configured")
    return audit


def tenant_json(tenant: Tenant) -> dict[str, Any]:
    body = dataclasses.asdict(tenant)
    body["models"] = None if tenant.models is None else list(tenant.models)
    return body


def key_json(key: ApiKey) -> dict[str, Any]:
    return dataclasses.asdict(key)


@router.get("/tenants")
def list_tenants(request: Request) -> JSONResponse:
    tenants = _store(request).list_tenants()
    return JSONResponse({"tenants": [tenant_json(t) for t in tenants]})


def _check_tier(request: Request, tier: str | None) -> None:
    """A tier this server knows (its config's ``tiers``): any other would be
    served quietly at weight 1 with no latency target."""
    known = getattr(request.app.state, "tiers", None)
    if tier is not None and known is not None and tier not in known:
        raise InvalidTenantError(f"unknown tier {tier!r}: this server's are {', '.join(known)}")


@router.post("/tenants", status_code=201)
def create_tenant(body: TenantCreate, request: Request) -> JSONResponse:
    _check_tier(request, body.tier)
    tenant = _store(request).add_tenant(**body.model_dump())
    return JSONResponse(tenant_json(tenant), status_code=201)


@router.get("/tenants/{name}")
def get_tenant(name: str, request: Request) -> JSONResponse:
    return JSONResponse(tenant_json(_store(request).get_tenant(name)))


@router.patch("/tenants/{name}")
def update_tenant(name: str, body: TenantPatch, request: Request) -> JSONResponse:
    _check_tier(request, body.tier)
    tenant = _store(request).update_tenant(name, **body.model_dump(exclude_unset=True))
    return JSONResponse(tenant_json(tenant))


@router.delete("/tenants/{name}")
def remove_tenant(name: str, request: Request) -> JSONResponse:
    """Remove the tenant and its keys; the body is the tenant as it was."""
    return JSONResponse(tenant_json(_store(request).remove_tenant(name)))


@router.get("/keys")
def list_keys(request: Request, tenant: str | None = None) -> JSONResponse:
    keys = _store(request).list_keys(tenant)
    return JSONResponse({"keys": [key_json(k) for k in keys]})


@router.post("/keys", status_code=201)
def create_key(body: KeyCreate, request: Request) -> JSONResponse:
    """A new key; ``key`` is its plaintext, in this response only."""
    key, info = _store(request).create_key(body.tenant, admin=body.admin)
    return JSONResponse({"key": key, **key_json(info)}, status_code=201)


@router.delete("/keys/{prefix}")
def revoke_key(prefix: str, request: Request) -> JSONResponse:
    return JSONResponse(key_json(_store(request).revoke_key(prefix)))


@router.get("/usage")
def usage(
    request: Request,
    since: str | None = None,
    until: str | None = None,
    step: float | None = None,
) -> JSONResponse:
    """Per tenant and model, from the audit log: requests, units, errors,
    device-seconds and byte-seconds of memory (tenant '': held with no use).
    ``since`` and ``until`` take ISO 8601, ``today`` or ``-1h``-style;
    ``since`` defaults to 00:00 UTC today. With ``step`` (seconds), also the
    cost per tenant over time: device-seconds and byte-seconds per step."""
    now = time.time()
    start = parse_time(since, now) if since is not None else start_of_day_utc(now)
    end = parse_time(until, now) if until is not None else None
    log = _audit_log(request)
    body: dict[str, Any] = {"since": start, "until": end, "usage": log.usage(start, end)}
    if step is not None:
        if not step > 0 or ((end if end is not None else now) - start) / step > MAX_STEPS:
            raise InvalidInputError(f"step must be positive, at most {MAX_STEPS} steps a query")
        body["step"] = step
        body["series"] = log.cost_series(start, step, end)
    return JSONResponse(body)
