"""SQLite plumbing shared by the tenant store and the audit log: open in WAL
mode, and apply an ordered list of schema migrations once.

A migration is a list of SQL statements; step ``i`` (1-based) brings the schema
to version ``i``. Steps are only ever appended, never edited, so a database at
any older version reaches the newest one by running the steps it lacks.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path

from tessera.errors import ConfigError

Migration = Sequence[str]

# How long a writer waits for another process's write (the CLI beside a
# running server) before giving up with "database is locked".
BUSY_TIMEOUT_S = 5.0


def open_db(path: Path, *, synchronous: str = "FULL") -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), WAL journal,
    foreign keys on, usable from any thread (callers serialize with a lock)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
    except (OSError, sqlite3.Error) as e:
        raise ConfigError(f"cannot open database {path}: {e}") from e
    try:
        conn.row_factory = sqlite3.Row
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise ConfigError(f"database {path} cannot use WAL mode (got {mode})")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute(f"PRAGMA synchronous={synchronous}")
    except sqlite3.Error as e:
        conn.close()
        raise ConfigError(f"cannot open database {path}: {e}") from e
    except ConfigError:
        conn.close()
        raise
    return conn


def schema_version(conn: sqlite3.Connection) -> int:
    """The version the database is at; 0 for a new one."""
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


def migrate(conn: sqlite3.Connection, steps: Sequence[Migration]) -> int:
    """Apply the steps the database lacks, each in its own transaction; return
    the version reached. Safe to call from two processes at once: the version
    is read again under the write lock."""
    try:
        version = schema_version(conn)
        if version < len(steps):
            for number, statements in enumerate(steps, start=1):
                conn.execute("BEGIN IMMEDIATE")
                try:
                    if schema_version(conn) < number:
                        for statement in statements:
                            conn.execute(statement)
                        conn.execute("INSERT INTO schema_version (version) VALUES (?)", (number,))
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
            version = schema_version(conn)
    except sqlite3.Error as e:
        raise ConfigError(f"cannot migrate database schema: {e}") from e
    if version > len(steps):
        raise ConfigError(
            f"database schema is at version {version}, newer than this tessera knows"
            f" ({len(steps)}); upgrade tessera"
        )
    return version
