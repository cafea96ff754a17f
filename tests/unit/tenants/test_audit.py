"""The audit log: buffered batch writes, queries, usage, retention, time parsing.

Tests of the interface take ``audit`` (or ``database_url``) and run on SQLite
and on PostgreSQL alike; those of the SQLite file itself on SQLite only."""

from __future__ import annotations

import asyncio
import datetime as dt
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tessera.errors import ConfigError, InvalidInputError
from tessera.tenants import AuditLog, AuditRecord
from tessera.tenants.audit import (
    AUDIT_DB_FILE,
    DAY_S,
    MIGRATIONS,
    MemoryRecord,
    iso_time,
    parse_time,
    start_of_day_utc,
)
from tessera.tenants.db import migrate, open_db

T0 = 1_700_000_000.0


class FakeWall:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_record(ts: float = T0, **fields: Any) -> AuditRecord:
    values: dict[str, Any] = {
        "ts": ts,
        "tenant": "acme",
        "key_prefix": "tsk_abcd1234",
        "model": "embed",
        "task": "embedding",
        "units": 10.0,
        "status": 200,
        "queue_s": 0.01,
        "total_s": 0.1,
        "batch_size": 4,
        "request_id": "r1",
        "reason": None,
    }
    values.update(fields)
    return AuditRecord(**values)


@pytest.fixture
def wall() -> FakeWall:
    return FakeWall()


@pytest.fixture
def audit(tmp_path: Path, wall: FakeWall, database_url: str | None) -> Iterator[AuditLog]:
    log = AuditLog(tmp_path, url=database_url, max_batch=500, wall_clock=wall)
    yield log
    log.close_sync()


async def test_records_wait_in_memory_then_flush_in_batches(audit: AuditLog) -> None:
    for i in range(1200):
        audit.record(make_record(T0 + i, request_id=f"r{i}"))
    assert audit.query() == []  # record() did no I/O
    assert audit.stats().pending == 1200
    assert await audit.flush() == 1200
    stats = audit.stats()
    assert (stats.written, stats.pending, stats.num_batches) == (1200, 0, 3)
    rows = audit.query()
    assert [r.request_id for r in rows] == [f"r{i}" for i in range(1200)]
    assert rows[0] == make_record(T0, request_id="r0")
    assert await audit.flush() == 0


async def test_start_and_close_flush_what_is_pending(
    tmp_path: Path, wall: FakeWall, database_url: str | None
) -> None:
    audit = AuditLog(tmp_path, url=database_url, flush_interval_s=3600, wall_clock=wall)
    await audit.start()
    audit.record(make_record())
    audit.record(make_record(status=429, reason="rate", units=0.0))
    await audit.close()
    assert audit.stats().written == 2
    audit.record(make_record())  # after close: dropped, not an error
    assert audit.stats().dropped == 1
    reopened = AuditLog(tmp_path, url=database_url, wall_clock=wall)
    try:
        assert [r.status for r in reopened.query()] == [200, 429]
        assert reopened.query()[1].reason == "rate"
    finally:
        reopened.close_sync()
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "audit-log"]


async def test_a_failed_write_keeps_the_rows(
    audit: AuditLog, monkeypatch: pytest.MonkeyPatch, database_url: str | None
) -> None:
    audit.record(make_record(request_id="a"))
    audit.record(make_record(request_id="b"))
    real_insert = audit._insert

    def failing(chunk: list[AuditRecord]) -> None:
        if database_url is None:
            raise sqlite3.OperationalError("disk I/O error")
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(audit, "_insert", failing)
    assert await audit.flush() == 0
    assert audit.stats().pending == 2
    assert audit.stats().num_failures == 1
    monkeypatch.setattr(audit, "_insert", real_insert)
    assert await audit.flush() == 2
    assert [r.request_id for r in audit.query()] == ["a", "b"]


def test_pending_is_bounded_dropping_the_oldest(tmp_path: Path, database_url: str | None) -> None:
    audit = AuditLog(tmp_path, url=database_url, max_pending=3, retention_days=None)
    try:
        for i in range(5):
            audit.record(make_record(request_id=str(i)))
        assert audit.stats().dropped == 2
        audit.write_pending()
        assert [r.request_id for r in audit.query()] == ["2", "3", "4"]
    finally:
        audit.close_sync()


def test_query_filters(audit: AuditLog) -> None:
    audit.record(make_record(T0, tenant="a"))
    audit.record(make_record(T0 + 10, tenant="b"))
    audit.record(make_record(T0 + 20, tenant="a"))
    audit.record(make_record(T0 + 30, tenant=None, key_prefix=None, status=401))
    audit.write_pending()
    assert [r.ts for r in audit.query(tenant="a")] == [T0, T0 + 20]
    assert [r.ts for r in audit.query(since=T0 + 10)] == [T0 + 10, T0 + 20, T0 + 30]
    assert [r.ts for r in audit.query(until=T0 + 20)] == [T0, T0 + 10]  # until is exclusive
    assert [r.ts for r in audit.query(tenant="a", since=T0 + 1, until=T0 + 21)] == [T0 + 20]
    assert [r.ts for r in audit.query(limit=2)] == [T0, T0 + 10]


def test_usage_per_tenant_and_model(audit: AuditLog) -> None:
    audit.record(make_record(T0, tenant="a", model="m", units=10, total_s=0.1))
    audit.record(make_record(T0 + 1, tenant="a", model="m", units=30, total_s=0.3))
    # Units are what each request was charged: nothing for a refused one, what
    # ran for one that failed after running (a generation cut by its deadline).
    audit.record(make_record(T0 + 2, tenant="a", model="m", units=0, status=429, total_s=0.0))
    audit.record(make_record(T0 + 3, tenant="a", model="n", units=5, total_s=0.2))
    audit.record(make_record(T0 + 4, tenant="b", model="m", units=7, status=504, total_s=1.0))
    audit.record(make_record(T0 - 100, tenant="b", model="m", units=1000))
    audit.write_pending()
    rows = audit.usage(since=T0)
    by_key = {(r["tenant"], r["model"]): r for r in rows}
    assert set(by_key) == {("a", "m"), ("a", "n"), ("b", "m")}
    am = by_key["a", "m"]
    assert (am["requests"], am["units"], am["errors"]) == (3, 40.0, 1)
    assert am["mean_total_s"] == pytest.approx(0.4 / 3)
    assert am["max_total_s"] == pytest.approx(0.3)
    bm = by_key["b", "m"]
    assert (bm["requests"], bm["units"], bm["errors"]) == (1, 7.0, 1)
    assert [r["requests"] for r in audit.usage(since=T0, until=T0 + 2)] == [2]


def test_usage_sums_device_seconds_and_memory_byte_seconds(audit: AuditLog) -> None:
    audit.record(make_record(T0, tenant="a", model="m", device_s=0.25))
    audit.record(make_record(T0 + 1, tenant="a", model="m", device_s=0.5))
    audit.record(make_record(T0 + 2, tenant="a", model="m", status=429))  # ran nothing
    audit.record(MemoryRecord(T0 + 1, tenant="a", model="m", byte_s=3e9))
    audit.record(MemoryRecord(T0 + 2, tenant="a", model="m", byte_s=1e9))
    # Held with no use: a row of its own, with no requests.
    audit.record(MemoryRecord(T0 + 2, tenant="", model="idle", byte_s=2e9))
    audit.record(MemoryRecord(T0 - 100, tenant="a", model="m", byte_s=1e12))
    audit.write_pending()
    by_key = {(r["tenant"], r["model"]): r for r in audit.usage(since=T0)}
    assert set(by_key) == {("a", "m"), ("", "idle")}
    am = by_key["a", "m"]
    assert am["requests"] == 3
    assert am["device_s"] == pytest.approx(0.75)
    assert am["byte_s"] == pytest.approx(4e9)
    idle = by_key["", "idle"]
    assert (idle["requests"], idle["device_s"], idle["byte_s"]) == (0, 0.0, 2e9)
    assert [r["byte_s"] for r in audit.usage(since=T0, until=T0 + 2)] == [3e9]


def test_cost_series_per_step_and_tenant(audit: AuditLog) -> None:
    audit.record(make_record(T0 + 10, tenant="a", device_s=1.0))
    audit.record(make_record(T0 + 50, tenant="a", device_s=2.0))
    audit.record(make_record(T0 + 70, tenant="b", device_s=4.0))
    audit.record(make_record(T0 + 75, tenant=None, device_s=None, status=401))
    audit.record(MemoryRecord(T0 + 61, tenant="a", model="m", byte_s=5e9))
    audit.record(MemoryRecord(T0 + 130, tenant="", model="m", byte_s=1e9))
    audit.record(MemoryRecord(T0 - 1, tenant="a", model="m", byte_s=1e12))
    audit.write_pending()
    series = audit.cost_series(T0, step_s=60.0)
    assert [(p["start"] - T0, p["tenant"], p["device_s"], p["byte_s"]) for p in series] == [
        (0.0, "a", 3.0, 0.0),
        (60.0, "a", 0.0, 5e9),
        (60.0, "b", 4.0, 0.0),
        (120.0, "", 0.0, 1e9),
    ]
    assert len(audit.cost_series(T0, step_s=60.0, until=T0 + 60)) == 1
    with pytest.raises(InvalidInputError, match="step"):
        audit.cost_series(T0, step_s=0)


def test_units_since_counts_every_unit_charged(audit: AuditLog) -> None:
    audit.record(make_record(T0 - 1, units=1000))
    audit.record(make_record(T0, units=10))
    audit.record(make_record(T0 + 1, units=0, status=429))
    audit.record(make_record(T0 + 2, units=2.5, status=499))  # a generation left mid-way
    audit.record(make_record(T0 + 3, tenant="other", units=50))
    audit.write_pending()
    assert audit.units_since("acme", T0) == 12.5
    assert audit.units_since("nobody", T0) == 0.0


def test_requests_by_model_counts_rows_since_a_time(audit: AuditLog) -> None:
    audit.record(make_record(T0 - 1, model="old"))
    for i, model in enumerate(("embed", "embed", "chat@2", None)):
        audit.record(make_record(T0 + i, model=model, status=200 if i else 503))
    audit.write_pending()
    assert audit.requests_by_model(T0) == {"embed": 2, "chat@2": 1}


def test_rows_of_the_old_rule_keep_costing_nothing(tmp_path: Path) -> None:
    # Before migration 2 a refused or failed request's row held its estimate,
    # which no sum counted; after it, the sums are the same as they were.
    conn = open_db(tmp_path / AUDIT_DB_FILE)
    migrate(conn, MIGRATIONS[:1])
    insert = "INSERT INTO audit (ts, tenant, units, status, queue_s, total_s) VALUES (?,?,?,?,0,0)"
    conn.execute(insert, (T0, "acme", 10.0, 200))
    conn.execute(insert, (T0, "acme", 99.0, 429))
    conn.close()
    log = AuditLog(tmp_path, retention_days=None)
    try:
        assert log.units_since("acme", T0) == 10.0
    finally:
        log.close_sync()


async def test_retention_at_start_and_hourly(
    tmp_path: Path, wall: FakeWall, database_url: str | None
) -> None:
    seed = AuditLog(tmp_path, url=database_url, retention_days=None)
    seed.record(make_record(T0 - 31 * DAY_S, request_id="old"))
    seed.record(make_record(T0 - 29 * DAY_S, request_id="recent"))
    seed.close_sync()
    audit = AuditLog(
        tmp_path, url=database_url, retention_days=30, flush_interval_s=3600, wall_clock=wall
    )
    assert [r.request_id for r in audit.query()] == ["old", "recent"]
    await audit.start()  # start purges once
    assert [r.request_id for r in audit.query()] == ["recent"]
    wall.now += 2 * DAY_S  # "recent" is now 31 days old
    audit.record(make_record(wall.now, request_id="new"))
    await audit.flush()  # more than an hour since the last purge
    assert [r.request_id for r in audit.query()] == ["new"]
    assert audit.stats().purged == 2
    await audit.close()


def test_purge_waits_for_its_interval(audit: AuditLog, wall: FakeWall) -> None:
    audit.write_pending()  # purges: the first time
    audit.record(make_record(T0 - 40 * DAY_S))
    wall.now += 60
    audit.write_pending()  # a minute later: no purge yet
    assert len(audit.query()) == 1
    wall.now += 3600
    audit.write_pending()
    assert audit.query() == []


def test_no_retention_keeps_everything(tmp_path: Path, database_url: str | None) -> None:
    audit = AuditLog(tmp_path, url=database_url, retention_days=None)
    try:
        audit.record(make_record(1.0))
        audit.write_pending()
        assert audit.purge() == 0
        assert len(audit.query()) == 1
    finally:
        audit.close_sync()


def test_audit_file_holds_the_schema_once(tmp_path: Path) -> None:
    for _ in range(2):
        AuditLog(tmp_path).close_sync()
    conn = sqlite3.connect(tmp_path / AUDIT_DB_FILE)
    try:
        assert [r[0] for r in conn.execute("SELECT version FROM schema_version")] == [1, 2, 3, 4]
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2023-11-14T22:13:20Z", T0),
        ("2023-11-14T22:13:20", T0),
        ("2023-11-14T23:13:20+01:00", T0),
        ("2023-11-14 22:13:20.000", T0),
        ("now", T0),
        ("-1h", T0 - 3600),
        ("30m", T0 - 1800),
        ("7d", T0 - 7 * DAY_S),
        ("-1.5w", T0 - 1.5 * 7 * DAY_S),
        ("today", dt.datetime(2023, 11, 14, tzinfo=dt.UTC).timestamp()),
    ],
)
def test_parse_time(text: str, expected: float) -> None:
    assert parse_time(text, T0) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "yesterday", "1y", "2023-13-01", "-h"])
def test_parse_time_refuses_nonsense(text: str) -> None:
    with pytest.raises(InvalidInputError, match="bad time"):
        parse_time(text, T0)


def test_time_helpers() -> None:
    assert iso_time(T0) == "2023-11-14T22:13:20.000Z"
    assert start_of_day_utc(T0) == dt.datetime(2023, 11, 14, tzinfo=dt.UTC).timestamp()


@pytest.mark.parametrize("bad", [{"flush_interval_s": 0}, {"max_batch": 0}, {"retention_days": 0}])
def test_bad_settings_are_config_errors(tmp_path: Path, bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        AuditLog(tmp_path, **bad)
