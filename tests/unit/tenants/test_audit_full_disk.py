"""Audit writes that keep failing (a full disk: SQLite's "database or disk is
full") are logged in one line a minute without a traceback, while the rows
wait in memory, bounded, and are written once the disk has room again. Time
is the log's injected wall clock."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from tessera.tenants.audit import FAILURE_LOG_INTERVAL_S, AuditLog, AuditRecord


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def record(i: int) -> AuditRecord:
    return AuditRecord(
        ts=1_000_000.0 + i,
        tenant="acme",
        key_prefix=None,
        model="m",
        task="embedding",
        units=1.0,
        status=200,
        queue_s=0.0,
        total_s=0.0,
        request_id=f"r{i}",
    )


def test_a_full_disk_is_one_line_a_minute_and_rows_wait_bounded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    audit = AuditLog(tmp_path, wall_clock=clock, max_pending=5, retention_days=None)
    full = True
    insert = audit._insert

    def insert_or_fail(chunk: list[AuditRecord]) -> None:
        if full:
            raise sqlite3.OperationalError("database or disk is full")
        insert(chunk)

    monkeypatch.setattr(audit, "_insert", insert_or_fail)
    try:
        with caplog.at_level(logging.INFO, logger="tessera.tenants.audit"):
            for i in range(8):
                audit.record(record(i))
            for _ in range(100):  # 50 s of flushes every 0.5 s
                assert audit.write_pending() == 0
                clock.now += 0.5
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert len(errors) == 1
            assert errors[0].exc_info is None
            assert "disk is full" in errors[0].getMessage()
            assert "\n" not in errors[0].getMessage()
            clock.now += FAILURE_LOG_INTERVAL_S
            audit.write_pending()
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert len(errors) == 2
            assert "(99 more failures)" in errors[1].getMessage()
            full = False
            assert audit.write_pending() == 5  # the newest 5 of 8: bounded
            assert "writing again" in caplog.text
        assert [r.request_id for r in audit.query()] == ["r3", "r4", "r5", "r6", "r7"]
        assert audit.stats().dropped == 3
    finally:
        audit.close_sync()
