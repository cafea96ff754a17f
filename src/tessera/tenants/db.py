"""SQLite plumbing shared by the tenant store and the audit log: open in WAL
mode, and apply an ordered list of schema migrations once.

The data folder and its databases are the owner's alone: the folder is made
0700 and each database file is created 0600 before SQLite opens it (SQLite
gives its ``-wal`` and ``-shm`` files the database file's mode), so no file
is ever readable by others, not even for a moment. A folder or files left
wider by an older tessera are narrowed when opened, with a warning.

A migration is a list of SQL statements; step ``i`` (1-based) brings the schema
to version ``i``. Steps are only ever appended, never edited, so a database at
any older version reaches the newest one by running the steps it lacks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat
from collections.abc import Sequence
from pathlib import Path

from tessera.errors import ConfigError

log = logging.getLogger(__name__)

Migration = Sequence[str]

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_SIDE_FILES = ("-wal", "-shm", "-journal")

# How long a writer waits for another process's write (the CLI beside a
# running server) before giving up with "database is locked".
BUSY_TIMEOUT_S = 5.0


def open_db(path: Path, *, synchronous: str = "FULL") -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), WAL journal,
    foreign keys on, usable from any thread (callers serialize with a lock)."""
    try:
        private_dir(path.parent)
        _private_file(path)
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


def private_dir(path: Path) -> None:
    """Make ``path`` (and missing parents) a folder only its owner can enter."""
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    _narrow(path, PRIVATE_DIR_MODE)


def _private_file(path: Path) -> None:
    """Create ``path`` empty with mode 0600 if it is missing (SQLite then writes
    into it, and takes its mode for the side files)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, PRIVATE_FILE_MODE)
    os.close(fd)
    for target in (path, *(path.with_name(path.name + s) for s in _SIDE_FILES)):
        with contextlib.suppress(FileNotFoundError):
            _narrow(target, PRIVATE_FILE_MODE)


def _narrow(path: Path, mode: int) -> None:
    """Take group and other bits off ``path`` if it has any (an older install's)."""
    current = stat.S_IMODE(path.stat().st_mode)
    if current & 0o077:
        log.warning("%s was readable by others (mode %o); making it %o", path, current, mode)
        path.chmod(current & ~0o077)


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
