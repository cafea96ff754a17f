"""Responses kept for OpenAI's Responses API, where the server is told to keep
them (``store_responses``; off by default, as the audit log keeps no content):
a response whose request said ``store`` (the API's default) is kept for
``responses_retention_hours`` with the conversation up to it, so that a later
request may continue it by ``previous_response_id``, and
``GET`` / ``DELETE /v1/responses/{id}`` find it.

A row holds the response object as answered and the conversation as the
API's input items: the request's own (its earlier turns already resolved)
and its output (the message, the function calls). A tenant sees its own rows
only (with auth off, all rows are the one tenant ``""``'s). Rows past their
retention are not found, and are deleted at open and at most once a minute
as rows are written. In ``<data_dir>/responses.db``, or in the tenant store's
PostgreSQL database, where gateway processes and servers share it.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError, TenantError
from tessera.tenants.db import Dialect, migrate, open_database

RESPONSES_DB_FILE = "responses.db"
PURGE_INTERVAL_S = 60.0

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            created REAL NOT NULL,      -- wall time, seconds since the epoch
            response TEXT NOT NULL,     -- the response object, JSON
            conversation TEXT NOT NULL  -- its input and output as input items, JSON
        )""",
        "CREATE INDEX responses_created ON responses(created)",
    ),
)


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """See the module notes; every call blocks on the database (callers run
    it off the event loop)."""

    def __init__(
        self,
        data_dir: Path,
        url: str | None,
        retention_s: float,
        *,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if retention_s <= 0:
            raise ConfigError("responses_retention_hours must be positive")
        self.retention_s = retention_s
        self._wall = wall_clock
        self._db = open_database(url, Path(data_dir) / RESPONSES_DB_FILE, synchronous="NORMAL")
        version_table = (
            "schema_version" if self._db.dialect is Dialect.SQLITE else "responses_schema_version"
        )
        try:
            migrate(self._db, MIGRATIONS, version_table)
        except BaseException:
            self._db.close()
            raise
        self._lock = threading.Lock()
        self._last_purge = 0.0
        self.purge()

    def put(
        self, tenant: str, response: dict[str, Any], conversation: list[dict[str, Any]]
    ) -> None:
        now = self._wall()
        row = (response["id"], tenant, now, json.dumps(response), json.dumps(conversation))
        with self._lock, self._errors():
            self._db.execute(
                "INSERT INTO responses (id, tenant, created, response, conversation)"
                " VALUES (?, ?, ?, ?, ?)",
                row,
            )
        if now - self._last_purge > PURGE_INTERVAL_S:
            self.purge()

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """``tenant``'s response of that id, unless past its retention."""
        with self._lock, self._errors():
            row = self._db.execute(
                "SELECT response, conversation FROM responses"
                " WHERE id = ? AND tenant = ? AND created >= ?",
                (response_id, tenant, self._wall() - self.retention_s),
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(json.loads(row["response"]), json.loads(row["conversation"]))

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock, self._errors():
            cursor = self._db.execute(
                "DELETE FROM responses WHERE id = ? AND tenant = ?", (response_id, tenant)
            )
        return cursor.rowcount > 0

    def purge(self) -> int:
        """Delete the rows past their retention; how many."""
        self._last_purge = self._wall()
        cutoff = self._last_purge - self.retention_s
        with self._lock, self._errors():
            return self._db.execute("DELETE FROM responses WHERE created < ?", (cutoff,)).rowcount

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except self._db.errors as e:
            raise TenantError(f"response store {self._db.where}: {e}") from e
