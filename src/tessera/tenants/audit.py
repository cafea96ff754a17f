"""The audit log: one row per request (refused ones too), no request content.

An admin change (a model registered, loaded, unloaded or retired; a tenant or
a key changed) has its row too, whose ``action`` names its method and route.

Rows live in ``<data_dir>/audit.db``, a SQLite file apart from ``tessera.db``:
the writer's transactions and the retention deletes never hold the lock that
tenant and key changes need, and the log can be moved or dropped on its own.
With a PostgreSQL ``url`` they live in its table ``audit`` beside the tenants
(its schema version in ``audit_schema_version``), where the rows of every
gateway interleave; the sums (``usage``, ``units_since``) are then the
cluster's, which is what the daily quota is seeded from.

``record`` only appends to an in-memory deque (no I/O, no lock, never blocks);
a task flushes it every ``flush_interval_s`` in a worker thread, in
transactions of at most ``max_batch`` rows. If writes fail the rows wait for
the next flush; past ``max_pending`` rows the oldest are dropped and counted.
Failures in a row (a full disk) are logged in one line a minute, without a
traceback, and the writer's return once.
Reads see what has been written: at most one flush interval behind. A crash
(kill -9) loses the rows still pending: those of the last flush interval at
most (0.5 s by default; the writer's pace is one flush per interval, the
interval counted from the end of the previous flush). Committed rows survive
it: WAL with ``synchronous=NORMAL`` loses nothing to a process crash.

A row's work units are what its request was charged, the same figure the
quota took (``request.Charge``): what ran for a request that ran, answered or
not (a generation its caller left is charged its prompt and the tokens made
before it stopped); nothing for a request refused, never run, or whose batch
failed. The daily quota is rebuilt at start from these rows.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime as dt
import logging
import math
import operator
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError, InvalidInputError, TenantError
from tessera.tenants.db import Dialect, migrate, open_database

log = logging.getLogger(__name__)

AUDIT_DB_FILE = "audit.db"
DAY_S = 86_400.0
# Writes that keep failing (a full disk) are logged in one line at most this
# often, without a traceback: the writer retries every flush interval.
FAILURE_LOG_INTERVAL_S = 60.0

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE audit (
            id INTEGER PRIMARY KEY,
            ts REAL NOT NULL,           -- wall time, seconds since the epoch
            tenant TEXT,
            key_prefix TEXT,
            model TEXT,
            task TEXT,
            units REAL NOT NULL,
            status INTEGER NOT NULL,
            queue_s REAL NOT NULL,
            total_s REAL NOT NULL,
            batch_size INTEGER,
            request_id TEXT,
            reason TEXT
        )""",
        "CREATE INDEX audit_ts ON audit(ts)",
        "CREATE INDEX audit_tenant_ts ON audit(tenant, ts)",
    ),
    # Rows used to hold a refused or failed request's estimate, which no sum
    # counted; units now hold what was charged, so theirs is nothing.
    ("UPDATE audit SET units = 0 WHERE status >= 400",),
    # An admin change's row names what it did: its method and route.
    ("ALTER TABLE audit ADD COLUMN action TEXT",),
    # What each tenant costs (``tessera.costs``): a request's share of the
    # device time of the batches it ran in, and the memory its models held.
    (
        "ALTER TABLE audit ADD COLUMN device_s REAL",
        """CREATE TABLE memory_usage (
            id INTEGER PRIMARY KEY,
            ts REAL NOT NULL,           -- the end of the span the bytes were held
            tenant TEXT NOT NULL,       -- '' for bytes held with no use in the window
            model TEXT NOT NULL,
            byte_s REAL NOT NULL
        )""",
        "CREATE INDEX memory_usage_ts ON memory_usage(ts)",
    ),
)


@dataclass(frozen=True)
class AuditRecord:
    """One request as the audit log keeps it. ``reason`` says why it was
    refused or failed (e.g. ``rate``, ``quota``, ``deadline``), never content;
    ``action``, on an admin change's row, its method and route
    (``POST /admin/models``)."""

    ts: float
    tenant: str | None
    key_prefix: str | None
    model: str | None
    task: str | None
    units: float
    status: int
    queue_s: float
    total_s: float
    batch_size: int | None = None
    request_id: str | None = None
    reason: str | None = None
    action: str | None = None
    device_s: float | None = None  # its share of its batches' run time (None: it ran none)


@dataclass(frozen=True)
class MemoryRecord:
    """Byte-seconds of a model's memory attributed to a tenant over a span
    ending at ``ts`` (``tenant`` '': held with no use, ``costs.UNATTRIBUTED``)."""

    ts: float
    tenant: str
    model: str
    byte_s: float


COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(AuditRecord))
_INSERT = f"INSERT INTO audit ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
_SELECT = f"SELECT {', '.join(COLUMNS)} FROM audit"
# Not dataclasses.astuple: it deep-copies, several times slower.
_values = operator.attrgetter(*COLUMNS)
_MEMORY_COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(MemoryRecord))
_INSERT_MEMORY = (
    f"INSERT INTO memory_usage ({', '.join(_MEMORY_COLUMNS)})"
    f" VALUES ({', '.join('?' * len(_MEMORY_COLUMNS))})"
)
_memory_values = operator.attrgetter(*_MEMORY_COLUMNS)


@dataclass(frozen=True)
class AuditStats:
    """Counters since the log was opened (for metrics)."""

    recorded: int
    written: int
    dropped: int
    pending: int
    num_flushes: int
    num_batches: int
    num_failures: int
    purged: int


class AuditLog:
    """Buffered audit rows in ``<data_dir>/audit.db``; see the module notes.

    ``retention_days=None`` keeps rows forever; otherwise rows older than that
    are deleted at ``start`` and then once every ``purge_interval_s``.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        url: str | None = None,
        flush_interval_s: float = 0.5,
        max_batch: int = 500,
        retention_days: float | None = 30.0,
        max_pending: int = 100_000,
        purge_interval_s: float = 3600.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if flush_interval_s <= 0 or max_batch < 1 or max_pending < 1:
            raise ConfigError("audit flush_interval_s, max_batch and max_pending must be positive")
        if retention_days is not None and retention_days <= 0:
            raise ConfigError("audit retention_days must be positive, or None to keep every row")
        self.path = Path(data_dir) / AUDIT_DB_FILE
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self.retention_days = retention_days
        self.purge_interval_s = purge_interval_s
        self._wall = wall_clock
        # synchronous=NORMAL: in WAL mode a crash of the process loses nothing;
        # a power cut may lose the last flushes, which an audit log can afford.
        self._conn = open_database(url, self.path, synchronous="NORMAL")
        # SQLite keeps the log in a file of its own; in a shared PostgreSQL
        # database its version table must not be the tenant store's.
        version_table = (
            "schema_version" if self._conn.dialect is Dialect.SQLITE else "audit_schema_version"
        )
        try:
            migrate(self._conn, MIGRATIONS, version_table)
        except BaseException:
            self._conn.close()
            raise
        self._lock = threading.Lock()  # the connection; never taken by record()
        self._pending: collections.deque[AuditRecord | MemoryRecord] = collections.deque(
            maxlen=max_pending
        )
        self._closing = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._last_purge = -math.inf
        self._recorded = self._written = self._dropped = 0
        self._num_flushes = self._num_batches = self._num_failures = self._purged = 0
        self._failing_since: float | None = None  # the first failed write in a row
        self._last_failure_log = -math.inf
        self._failures_unlogged = 0

    # -- the hot path --------------------------------------------------------

    def record(self, rec: AuditRecord | MemoryRecord) -> None:
        """Queue one row; no I/O. Safe from any thread."""
        # The counters are plain ints: exact on the event loop, close enough
        # from threads; they feed stats, not decisions.
        self._recorded += 1
        if self._closed:
            self._dropped += 1
            return
        if len(self._pending) == self._pending.maxlen:
            self._dropped += 1  # append pushes out the oldest
        self._pending.append(rec)

    # -- the writer ----------------------------------------------------------

    async def start(self) -> None:
        """Apply retention once, then flush in the background until ``close``."""
        await asyncio.to_thread(self.purge)
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="audit-log")

    async def run(self) -> None:
        """Flush every ``flush_interval_s`` until ``close`` (then once more)."""
        while not self._closing.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self.flush_interval_s)
            try:
                await self.flush()
            except Exception as e:  # the writer must outlive one bad flush
                self._failure(f"flush failed: {type(e).__name__}: {e}")

    async def flush(self) -> int:
        """Write the pending rows now, off the event loop; the number written."""
        return await asyncio.to_thread(self.write_pending)

    async def close(self) -> None:
        """Stop the writer, write what is pending, close the database."""
        if self._closed:
            return
        self._closing.set()
        if self._task is not None:
            await self._task
            self._task = None
        await self.flush()
        self._closed = True
        with self._lock:
            self._conn.close()

    def close_sync(self) -> None:
        """Write what is pending in this thread and close; for users without an
        event loop (the CLI). Not while ``start``'s writer runs."""
        if self._task is not None:
            raise RuntimeError("the audit writer is running; await close() instead")
        if self._closed:
            return
        self.write_pending()
        self._closed = True
        with self._lock:
            self._conn.close()

    def write_pending(self) -> int:
        """Write the rows pending now, in transactions of ``max_batch``; then
        purge if one is due. Blocking: call from a worker thread."""
        written = 0
        with self._lock:
            self._num_flushes += 1
            todo = len(self._pending)
            while todo > 0:
                chunk = [self._pending.popleft() for _ in range(min(todo, self.max_batch))]
                todo -= len(chunk)
                try:
                    self._insert(chunk)
                except self._conn.errors as e:
                    self._num_failures += 1
                    self._pending.extendleft(reversed(chunk))
                    self._failure(
                        f"cannot write rows ({type(e).__name__}: {e}); {len(self._pending)}"
                        f" wait in memory (at most {self._pending.maxlen}), retried every"
                        f" {self.flush_interval_s:g} s"
                    )
                    break
                written += len(chunk)
                self._num_batches += 1
            self._written += written
            if written and self._failing_since is not None:
                log.warning(
                    "audit log: writing again after %.0f s of failures",
                    self._wall() - self._failing_since,
                )
                self._failing_since = None
                self._last_failure_log = -math.inf
        if self._wall() - self._last_purge >= self.purge_interval_s:
            self.purge()
        return written

    def _failure(self, message: str) -> None:
        """Log a failed write in one line, at most once a ``FAILURE_LOG_INTERVAL_S``
        (a full disk fails every flush: a traceback each time filled the log)."""
        now = self._wall()
        if self._failing_since is None:
            self._failing_since = now
        if now - self._last_failure_log < FAILURE_LOG_INTERVAL_S:
            self._failures_unlogged += 1
            return
        more = self._failures_unlogged
        self._last_failure_log, self._failures_unlogged = now, 0
        log.error("audit log: %s%s", message, f" ({more} more failures)" if more else "")

    def purge(self) -> int:
        """Delete rows older than the retention; the number deleted."""
        self._last_purge = self._wall()
        if self.retention_days is None:
            return 0
        cutoff = self._wall() - self.retention_days * DAY_S
        with self._lock, self._errors():
            deleted = self._conn.execute("DELETE FROM audit WHERE ts < ?", (cutoff,)).rowcount
            self._conn.execute("DELETE FROM memory_usage WHERE ts < ?", (cutoff,))
            self._purged += deleted
        return deleted

    def _insert(self, chunk: list[AuditRecord | MemoryRecord]) -> None:
        requests = [_values(r) for r in chunk if isinstance(r, AuditRecord)]
        memory = [_memory_values(r) for r in chunk if isinstance(r, MemoryRecord)]
        with self._conn.transaction():
            if requests:
                self._conn.executemany(_INSERT, requests)
            if memory:
                self._conn.executemany(_INSERT_MEMORY, memory)

    def stats(self) -> AuditStats:
        return AuditStats(
            recorded=self._recorded,
            written=self._written,
            dropped=self._dropped,
            pending=len(self._pending),
            num_flushes=self._num_flushes,
            num_batches=self._num_batches,
            num_failures=self._num_failures,
            purged=self._purged,
        )

    # -- reads (blocking; from a worker thread in async code) ----------------

    def query(
        self,
        tenant: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = None,
    ) -> list[AuditRecord]:
        """Rows with ``since <= ts < until``, of one tenant if given, oldest first."""
        where, params = _window(since, until)
        if tenant is not None:
            where.append("tenant = ?")
            params.append(tenant)
        sql = _SELECT + _where(where) + " ORDER BY ts, id"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        with self._lock, self._errors():
            rows = self._conn.execute(sql, params).fetchall()
        return [AuditRecord(**{column: row[column] for column in COLUMNS}) for row in rows]

    def usage(self, since: float, until: float | None = None) -> list[dict[str, Any]]:
        """Per tenant and model: requests, units charged, errors (status >= 400),
        mean and max total seconds, device-seconds, and the byte-seconds of
        memory its models held (tenant '': held with no use)."""
        where, params = _window(since, until)
        sql = (
            "SELECT tenant, model, COUNT(*) AS requests,"
            " COALESCE(SUM(units), 0.0) AS units,"
            " SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END) AS errors,"
            " AVG(total_s) AS mean_total_s, MAX(total_s) AS max_total_s,"
            " COALESCE(SUM(device_s), 0.0) AS device_s"
            " FROM audit" + _where(where) + " GROUP BY tenant, model"
        )
        memory_sql = (
            "SELECT tenant, model, SUM(byte_s) AS byte_s FROM memory_usage"
            + _where(where)
            + " GROUP BY tenant, model"
        )
        with self._lock, self._errors():
            rows = {
                (row["tenant"], row["model"]): {**dict(row), "byte_s": 0.0}
                for row in self._conn.execute(sql, params).fetchall()
            }
            for row in self._conn.execute(memory_sql, params).fetchall():
                key = (row["tenant"], row["model"])
                found = rows.setdefault(key, {**_NO_REQUESTS, "tenant": key[0], "model": key[1]})
                found["byte_s"] = float(row["byte_s"])
        return [rows[key] for key in sorted(rows, key=lambda k: (k[0] or "", k[1] or ""))]

    def cost_series(
        self, since: float, step_s: float, until: float | None = None
    ) -> list[dict[str, Any]]:
        """Per ``step_s`` from ``since`` and per tenant: device-seconds and
        byte-seconds of memory (tenant '': held with no use), oldest first;
        ``start`` is each step's first second."""
        if step_s <= 0:
            raise InvalidInputError("step must be positive")
        # Steps counted from ``since``: ts >= since, so truncation is the floor.
        step = (
            "CAST((ts - ?) / ? AS INTEGER)"
            if self._conn.dialect is Dialect.SQLITE
            else "FLOOR((ts - ?) / ?)"
        )
        where, params = _window(since, until)
        series: dict[tuple[int, str], dict[str, Any]] = {}
        queries = (
            ("device_s", f"SELECT {step} AS step, tenant, SUM(device_s) AS v FROM audit"),
            ("byte_s", f"SELECT {step} AS step, tenant, SUM(byte_s) AS v FROM memory_usage"),
        )
        with self._lock, self._errors():
            for column, select in queries:
                sql = select + _where([*where, "tenant IS NOT NULL"]) + " GROUP BY step, tenant"
                for row in self._conn.execute(sql, [since, step_s, *params]).fetchall():
                    key = (int(row["step"]), str(row["tenant"]))
                    found = series.setdefault(
                        key,
                        {
                            "start": since + key[0] * step_s,
                            "tenant": key[1],
                            "device_s": 0.0,
                            "byte_s": 0.0,
                        },
                    )
                    found[column] = float(row["v"] or 0.0)
        return [series[key] for key in sorted(series)]

    def units_since(self, tenant: str, since: float) -> float:
        """Work units charged to ``tenant`` since ``since`` (as written)."""
        with self._lock, self._errors():
            row = self._conn.execute(
                "SELECT COALESCE(SUM(units), 0.0) AS units FROM audit WHERE tenant = ? AND ts >= ?",
                (tenant, since),
            ).fetchone()
        return float(row["units"])

    def requests_by_model(self, since: float) -> dict[str, int]:
        """Requests per model (as the caller named it), whatever their status,
        since ``since``."""
        with self._lock, self._errors():
            rows = self._conn.execute(
                "SELECT model, COUNT(*) AS n FROM audit WHERE ts >= ? AND model IS NOT NULL"
                " GROUP BY model",
                (since,),
            ).fetchall()
        return {str(row["model"]): int(row["n"]) for row in rows}

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except self._conn.errors as e:
            raise TenantError(f"audit log {self._conn.where}: {e}") from e


_NO_REQUESTS: dict[str, Any] = {
    "requests": 0,
    "units": 0.0,
    "errors": 0,
    "mean_total_s": None,
    "max_total_s": None,
    "device_s": 0.0,
}


def _window(since: float | None, until: float | None) -> tuple[list[str], list[Any]]:
    where: list[str] = []
    params: list[Any] = []
    if since is not None:
        where.append("ts >= ?")
        params.append(since)
    if until is not None:
        where.append("ts < ?")
        params.append(until)
    return where, params


def _where(conditions: list[str]) -> str:
    return " WHERE " + " AND ".join(conditions) if conditions else ""


# -- times as people write them ------------------------------------------------

_RELATIVE = re.compile(r"-?\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw])")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY_S, "w": 7 * DAY_S}


def parse_time(text: str, now: float) -> float:
    """Seconds since the epoch from ISO 8601 (no zone = UTC), ``now``,
    ``today`` (00:00 UTC), or a time ago such as ``-1h``, ``30m``, ``7d``."""
    value = text.strip()
    if value.lower() == "now":
        return now
    if value.lower() == "today":
        return start_of_day_utc(now)
    relative = _RELATIVE.fullmatch(value)
    if relative is not None:
        return now - float(relative.group(1)) * _UNIT_S[relative.group(2)]
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError as e:
        raise InvalidInputError(
            f"bad time {text!r}: use ISO 8601 (2024-05-01T12:00:00Z), now, today, or -1h/30m/7d"
        ) from e
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def start_of_day_utc(now: float) -> float:
    day = dt.datetime.fromtimestamp(now, dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return day.timestamp()


def iso_time(ts: float) -> str:
    """``2024-05-01T12:00:00.123Z``."""
    text = dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")
