"""The tenants admin API on a bare app (the router, error handlers, real SQLite)."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from tessera.gateway import tenants_admin
from tessera.gateway.errors import install_error_handlers
from tessera.scheduling.tiers import DEFAULT_TIERS
from tessera.tenants import AuditLog, AuditRecord, TenantStore
from tessera.tenants.audit import MemoryRecord


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[FastAPI]:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(tenants_admin.router)
    app.state.tenant_store = TenantStore(tmp_path)
    app.state.audit_log = AuditLog(tmp_path)
    app.state.tiers = dict(DEFAULT_TIERS)
    yield app
    await app.state.audit_log.close()
    app.state.tenant_store.close()


@pytest.fixture
async def admin(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
        yield client


async def test_tenant_crud(admin: httpx.AsyncClient) -> None:
    r = await admin.post(
        "/admin/tenants", json={"name": "acme", "tier": "vip", "qps": 2, "models": ["embed"]}
    )
    assert r.status_code == 201, r.text
    body = r.json()
    assert (body["name"], body["tier"], body["qps"], body["models"]) == (
        "acme",
        "vip",
        2.0,
        ["embed"],
    )
    assert body["burst"] is None
    assert (await admin.post("/admin/tenants", json={"name": "beta"})).status_code == 201

    r = await admin.get("/admin/tenants")
    assert [t["name"] for t in r.json()["tenants"]] == ["acme", "beta"]
    assert (await admin.get("/admin/tenants/acme")).json()["tier"] == "vip"

    r = await admin.patch("/admin/tenants/acme", json={"qps": None, "burst": 5, "models": None})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["tier"], body["qps"], body["burst"], body["models"]) == ("vip", None, 5, None)
    r = await admin.patch("/admin/tenants/acme", json={"tier": "batch"})
    assert (r.json()["tier"], r.json()["burst"]) == ("batch", 5)  # absent fields unchanged

    r = await admin.delete("/admin/tenants/acme")
    assert (r.status_code, r.json()["name"]) == (200, "acme")
    assert (await admin.get("/admin/tenants/acme")).status_code == 404


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/admin/tenants", {"name": "acme"}, 409),
        ("POST", "/admin/tenants", {"name": "x", "tier": "Gold"}, 422),
        ("POST", "/admin/tenants", {"name": "bad name"}, 422),
        ("POST", "/admin/tenants", {"name": "x", "qps": -1}, 422),
        ("POST", "/admin/tenants", {"name": "x", "colour": "red"}, 422),
        ("POST", "/admin/tenants", {"tier": "vip"}, 422),
        ("GET", "/admin/tenants/nope", None, 404),
        ("PATCH", "/admin/tenants/nope", {"qps": 1}, 404),
        ("PATCH", "/admin/tenants/acme", {"burst": 0}, 422),
        ("PATCH", "/admin/tenants/acme", {"tier": None}, 422),
        # A tier this server has no weights for, a number past the store's
        # integers (a 500 before), a "yes" or a true taken for a flag or a rate.
        ("POST", "/admin/tenants", {"name": "x", "tier": "platinum"}, 422),
        ("PATCH", "/admin/tenants/acme", {"tier": "gold"}, 422),
        ("POST", "/admin/tenants", {"name": "x", "burst": 10**30}, 422),
        ("PATCH", "/admin/tenants/acme", {"max_concurrency": 2**64}, 422),
        ("POST", "/admin/tenants", {"name": "x", "qps": True}, 422),
        ("POST", "/admin/keys", {"tenant": "acme", "admin": "yes"}, 422),
        ("DELETE", "/admin/tenants/nope", None, 404),
        ("POST", "/admin/keys", {"tenant": "nope"}, 404),
        ("POST", "/admin/keys", {}, 422),
        ("GET", "/admin/keys?tenant=nope", None, 404),
        ("DELETE", "/admin/keys/tsk_zzzzzzzz", None, 404),
        ("GET", "/admin/usage?since=yesterday-ish", None, 422),
        ("GET", "/admin/usage?step=0", None, 422),
        ("GET", "/admin/usage?since=-7d&step=1", None, 422),
    ],
)
async def test_errors(
    admin: httpx.AsyncClient, method: str, path: str, body: object, status: int
) -> None:
    assert (await admin.post("/admin/tenants", json={"name": "acme"})).status_code == 201
    r = await admin.request(method, path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


async def test_keys(admin: httpx.AsyncClient, app: FastAPI) -> None:
    store: TenantStore = app.state.tenant_store
    await admin.post("/admin/tenants", json={"name": "acme"})
    await admin.post("/admin/tenants", json={"name": "beta"})
    r = await admin.post("/admin/keys", json={"tenant": "acme", "admin": True})
    assert r.status_code == 201, r.text
    created = r.json()
    key = created["key"]
    assert key.startswith(created["prefix"] + "_")
    assert (created["tenant"], created["admin"], created["revoked_at"]) == ("acme", True, None)
    principal = store.authenticate(key)
    assert principal is not None
    assert principal.admin
    beta_key = (await admin.post("/admin/keys", json={"tenant": "beta"})).json()["key"]

    listing = await admin.get("/admin/keys")
    assert key not in listing.text
    assert [k["tenant"] for k in listing.json()["keys"]] == ["acme", "beta"]
    assert "key" not in listing.json()["keys"][0]
    only = (await admin.get("/admin/keys", params={"tenant": "beta"})).json()["keys"]
    assert [k["tenant"] for k in only] == ["beta"]

    r = await admin.delete(f"/admin/keys/{created['prefix']}")
    assert r.status_code == 200
    assert r.json()["revoked_at"] is not None
    assert store.authenticate(key) is None
    assert store.authenticate(beta_key) is not None


async def test_usage(admin: httpx.AsyncClient, app: FastAPI) -> None:
    audit: AuditLog = app.state.audit_log
    now = time.time()
    for tenant, status, units in [("a", 200, 3.0), ("a", 429, 0.0), ("b", 200, 1.0)]:
        audit.record(AuditRecord(now, tenant, None, "embed", "embedding", units, status, 0.0, 0.25))
    audit.record(AuditRecord(now - 3 * 86_400, "a", None, "embed", "embedding", 50, 200, 0, 1))
    await audit.flush()

    r = await admin.get("/admin/usage")  # since 00:00 UTC today by default
    assert r.status_code == 200, r.text
    usage = {row["tenant"]: row for row in r.json()["usage"]}
    assert (usage["a"]["requests"], usage["a"]["units"], usage["a"]["errors"]) == (2, 3.0, 1)
    assert usage["b"]["mean_total_s"] == 0.25
    assert r.json()["since"] <= now

    r = await admin.get("/admin/usage", params={"since": "-7d"})
    assert {row["tenant"]: row["requests"] for row in r.json()["usage"]} == {"a": 3, "b": 1}
    r = await admin.get("/admin/usage", params={"since": "-7d", "until": "-1d"})
    assert [row["units"] for row in r.json()["usage"]] == [50.0]


async def test_usage_has_what_each_tenant_cost_over_time(
    admin: httpx.AsyncClient, app: FastAPI
) -> None:
    audit: AuditLog = app.state.audit_log
    start = float(int(time.time()) - 30)
    since = dt.datetime.fromtimestamp(start, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for tenant, device_s in [("a", 0.5), ("a", 0.25), ("b", 1.0)]:
        audit.record(
            AuditRecord(
                start + 1, tenant, None, "embed", "embedding", 1.0, 200, 0.0, 0.1, device_s=device_s
            )
        )
    audit.record(MemoryRecord(start + 2, "a", "embed", 2e9))
    await audit.flush()
    r = await admin.get("/admin/usage", params={"since": since, "step": 60})
    assert r.status_code == 200, r.text
    usage = {row["tenant"]: row for row in r.json()["usage"]}
    assert usage["a"]["device_s"] == 0.75
    assert usage["a"]["byte_s"] == 2e9
    assert usage["b"]["byte_s"] == 0.0
    series = r.json()["series"]
    assert [(p["tenant"], p["device_s"], p["byte_s"]) for p in series] == [
        ("a", 0.75, 2e9),
        ("b", 1.0, 0.0),
    ]
    assert all(p["start"] == start for p in series)


async def test_missing_state_is_503(tmp_path: Path) -> None:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(tenants_admin.router)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.get("/admin/tenants")).status_code == 503
        assert (await client.get("/admin/usage")).status_code == 503
