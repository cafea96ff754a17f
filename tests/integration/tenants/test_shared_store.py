"""Many gateways on one PostgreSQL database at once: each gateway is a
``TenantStore`` and an ``AuditLog`` of its own (its own connections, its own
data dir), sharing the database and the key secret."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest

from services import postgres_schema
from tessera.errors import TenantExistsError
from tessera.tenants import AuditLog, AuditRecord, TenantStore
from tessera.tenants.audit import MIGRATIONS as AUDIT_MIGRATIONS
from tessera.tenants.db import open_database, schema_version
from tessera.tenants.store import MIGRATIONS as STORE_MIGRATIONS

T = TypeVar("T")
T0 = 1_700_000_000.0
NUM_GATEWAYS = 4


@pytest.fixture
def url() -> Iterator[str]:
    with postgres_schema() as url:
        yield url


@pytest.fixture
def secret() -> bytes:
    return secrets.token_bytes(32)


def at_once(calls: list[Callable[[], T]]) -> list[T | BaseException]:
    """Run every call in a thread of its own; each one's result or exception."""

    def run(call: Callable[[], T]) -> T | BaseException:
        try:
            return call()
        except Exception as e:
            return e

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return list(pool.map(run, calls))


def test_gateways_starting_together_migrate_a_fresh_database_once(
    url: str, secret: bytes, tmp_path: Path
) -> None:
    def start(i: int) -> tuple[TenantStore, AuditLog]:
        return (
            TenantStore(tmp_path / f"gw{i}", url=url, secret=secret),
            AuditLog(tmp_path / f"gw{i}", url=url),
        )

    opened = at_once([lambda i=i: start(i) for i in range(NUM_GATEWAYS)])
    for result in opened:
        assert isinstance(result, tuple), result
        store, audit = result
        store.close()
        audit.close_sync()
    db = open_database(url, tmp_path / "unused.db")
    try:
        assert schema_version(db) == len(STORE_MIGRATIONS)
        assert schema_version(db, "audit_schema_version") == len(AUDIT_MIGRATIONS)
        rows = db.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
        assert [row["version"] for row in rows] == list(range(1, len(STORE_MIGRATIONS) + 1))
    finally:
        db.close()


def test_a_tenant_made_by_many_gateways_at_once_is_made_once(
    url: str, secret: bytes, tmp_path: Path
) -> None:
    stores = [TenantStore(tmp_path / f"gw{i}", url=url, secret=secret) for i in range(2)]
    try:
        results = at_once([lambda s=stores[i % 2]: s.add_tenant("acme", qps=5) for i in range(8)])
        made = [r for r in results if not isinstance(r, BaseException)]
        assert len(made) == 1
        assert all(isinstance(r, TenantExistsError) for r in results if r not in made)
        bootstraps = at_once([s.ensure_bootstrap for s in stores])
        assert bootstraps == [None, None]  # tenants exist
        assert [t.name for t in stores[1].list_tenants()] == ["acme"]
    finally:
        for store in stores:
            store.close()


def test_gateways_bootstrapping_a_fresh_database_together_make_one_admin_key(
    url: str, secret: bytes, tmp_path: Path
) -> None:
    stores = [TenantStore(tmp_path / f"gw{i}", url=url, secret=secret) for i in range(3)]
    try:
        results = at_once([s.ensure_bootstrap for s in stores])
        made = [r for r in results if r is not None]
        assert len(made) == 1, results
        assert not isinstance(made[0], BaseException)
        for store in stores:  # the key works on every gateway at once
            principal = store.authenticate(made[0].key)
            assert principal is not None
            assert principal.admin
        assert len(stores[0].list_keys()) == 1
    finally:
        for store in stores:
            store.close()


def test_a_key_made_on_one_gateway_works_on_another_that_shares_the_secret(
    url: str, secret: bytes, tmp_path: Path
) -> None:
    with (
        TenantStore(tmp_path / "a", url=url, secret=secret) as a,
        TenantStore(tmp_path / "b", url=url, secret=secret) as b,
        TenantStore(tmp_path / "c", url=url) as other_secret,  # its data dir's own
    ):
        a.add_tenant("acme")
        key, info = a.create_key("acme")
        principal = b.authenticate(key)
        assert principal is not None
        assert principal.key_prefix == info.prefix
        assert other_secret.authenticate(key) is None
        b.revoke_key(info.prefix)
        assert a.authenticate(key) is None


def make_record(ts: float, gateway: int, units: float) -> AuditRecord:
    return AuditRecord(
        ts=ts,
        tenant="acme",
        key_prefix=None,
        model="embed",
        task="embedding",
        units=units,
        status=200,
        queue_s=0.0,
        total_s=0.01,
        request_id=f"gw{gateway}-{ts - T0:g}",
    )


def test_audit_rows_of_many_gateways_interleave(url: str, tmp_path: Path) -> None:
    logs = [
        AuditLog(tmp_path / f"gw{i}", url=url, max_batch=7, retention_days=None)
        for i in range(NUM_GATEWAYS)
    ]
    try:
        per_gateway = 50
        for n in range(per_gateway):
            for i, log in enumerate(logs):
                log.record(make_record(T0 + n * NUM_GATEWAYS + i, i, units=i + 1))
        written = at_once([log.write_pending for log in logs])
        assert written == [per_gateway] * NUM_GATEWAYS
        rows = logs[0].query(tenant="acme")
        assert len(rows) == per_gateway * NUM_GATEWAYS
        assert [r.ts for r in rows] == [T0 + k for k in range(per_gateway * NUM_GATEWAYS)]
        # Each gateway sees the cluster's sums: what the daily quota is seeded from.
        total = per_gateway * sum(i + 1 for i in range(NUM_GATEWAYS))
        assert {log.units_since("acme", T0) for log in logs} == {float(total)}
        usage = logs[-1].usage(since=T0)
        assert [(u["requests"], u["units"], u["errors"]) for u in usage] == [
            (per_gateway * NUM_GATEWAYS, float(total), 0)
        ]
    finally:
        for log in logs:
            log.close_sync()
