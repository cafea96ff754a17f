"""Database plumbing shared by the tenant store and the audit log: SQLite
files under the data folder (the default), or one PostgreSQL database that
many gateways share; and an ordered list of schema migrations applied once.

SQL is written once, in what both engines accept, with ``?`` placeholders;
``Database`` turns them into psycopg's ``%s``, and ``migrate`` turns the two
column types that differ into PostgreSQL's (``INTEGER PRIMARY KEY`` into an
identity column, ``REAL``, which is 4 bytes there, into ``DOUBLE PRECISION``).
Rows read by column name (``row["tenant"]``) in both.

``Database.transaction(exclusive=True)`` is SQLite's ``BEGIN IMMEDIATE``: one
writer at a time across every process. On PostgreSQL it is a transaction
that first takes a transaction-level advisory lock, so a check and the write
after it (a tenant's name is free, then insert it) cannot interleave with
another gateway's either.

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
import enum
import functools
import logging
import os
import re
import sqlite3
import stat
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from tessera.errors import ConfigError

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger(__name__)

Migration = Sequence[str]

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_SIDE_FILES = ("-wal", "-shm", "-journal")

# How long a writer waits for another process's write (the CLI beside a
# running server) before giving up with "database is locked".
BUSY_TIMEOUT_S = 5.0
# PostgreSQL: the advisory lock of exclusive transactions (any fixed number;
# tessera's tables are the only users of it in their database).
_WRITE_LOCK_KEY = 0x7E55E7A
_POSTGRES_SCHEMES = ("postgresql", "postgres")


class Dialect(enum.Enum):
    SQLITE = "sqlite"
    POSTGRES = "postgresql"


class Row(Protocol):
    """A row read by column name: ``sqlite3.Row`` or psycopg's dict row."""

    def __getitem__(self, key: str, /) -> Any: ...

    def keys(self) -> Iterable[str]: ...


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> Sequence[Any]: ...


class Database:
    """One connection, SQLite or PostgreSQL, autocommit unless in
    ``transaction``; usable from any thread (callers serialize with a lock)."""

    def __init__(
        self,
        dialect: Dialect,
        where: str,
        sqlite: sqlite3.Connection | None = None,
        url: str | None = None,
    ) -> None:
        self.dialect = dialect
        self.where = where  # a path or a URL without its password: for messages
        self._sqlite = sqlite
        self._url = url
        self._pg: psycopg.Connection[Any] | None = None
        self._pg_lock = threading.Lock()
        if dialect is Dialect.POSTGRES:
            import psycopg

            self.errors: tuple[type[Exception], ...] = (psycopg.Error,)
            self.integrity_errors: tuple[type[Exception], ...] = (psycopg.IntegrityError,)
            self._connect()
        else:
            self.errors = (sqlite3.Error,)
            self.integrity_errors = (sqlite3.IntegrityError,)

    def execute(self, sql: str, params: Sequence[object] = ()) -> Cursor:
        if self._sqlite is not None:
            return self._sqlite.execute(sql, params)
        return self._connect().execute(_pg_sql(sql), params)

    def executemany(self, sql: str, rows: Sequence[Sequence[object]]) -> None:
        if self._sqlite is not None:
            self._sqlite.executemany(sql, rows)
        else:
            self._connect().cursor().executemany(_pg_sql(sql), rows)

    @contextlib.contextmanager
    def transaction(self, *, exclusive: bool = False) -> Iterator[None]:
        """Commit what the block does, or nothing if it raises. ``exclusive``:
        no other exclusive transaction, of any process, runs meanwhile."""
        if self._sqlite is not None:
            conn = self._sqlite
            conn.execute("BEGIN IMMEDIATE" if exclusive else "BEGIN")
            try:
                yield
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return
        with self._connect().transaction():
            if exclusive:
                self.execute("SELECT pg_advisory_xact_lock(?)", (_WRITE_LOCK_KEY,))
            yield

    def data_version(self) -> int | None:
        """SQLite's count that moves when any connection commits; None on
        PostgreSQL, which has no such cheap check."""
        if self._sqlite is None:
            return None
        return int(self._sqlite.execute("PRAGMA data_version").fetchone()[0])

    def close(self) -> None:
        if self._sqlite is not None:
            self._sqlite.close()
        with self._pg_lock:
            if self._pg is not None:
                self._pg.close()
            self._url = None  # closed for good: no reconnection

    def _connect(self) -> psycopg.Connection[Any]:
        """The PostgreSQL connection, opened again if the last one broke (the
        server restarted): the call that found it broken failed, the next one
        reconnects."""
        import psycopg
        from psycopg.rows import dict_row

        with self._pg_lock:
            if self._pg is not None and not self._pg.broken:
                return self._pg
            if self._url is None:
                raise psycopg.InterfaceError("the database is closed")
            try:
                self._pg = psycopg.connect(self._url, autocommit=True, row_factory=dict_row)
            except psycopg.Error as e:
                raise ConfigError(f"cannot connect to {self.where}: {e}") from e
            return self._pg


@functools.lru_cache(maxsize=256)
def _pg_sql(sql: str) -> str:
    # Our SQL holds no literal '?' or '%': placeholders are the only ones.
    return sql.replace("%", "%%").replace("?", "%s")


_PG_TYPES = (
    (
        re.compile(r"\bINTEGER PRIMARY KEY( AUTOINCREMENT)?"),
        "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
    ),
    (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),
)


def _ddl(dialect: Dialect, statement: str) -> str:
    if dialect is Dialect.SQLITE:
        return statement
    for pattern, replacement in _PG_TYPES:
        statement = pattern.sub(replacement, statement)
    return statement


def is_postgres_url(url: str | None) -> bool:
    return url is not None and urlsplit(url).scheme in _POSTGRES_SCHEMES


def open_database(url: str | None, sqlite_path: Path, *, synchronous: str = "FULL") -> Database:
    """PostgreSQL if ``url`` is a ``postgresql://`` URL, else the SQLite file."""
    if url is None:
        return open_db(sqlite_path, synchronous=synchronous)
    if not is_postgres_url(url):
        raise ConfigError(f"unknown database URL {redact(url)!r}: use postgresql://...")
    return Database(Dialect.POSTGRES, redact(url), url=url)


def redact(url: str) -> str:
    """``url`` without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def open_db(path: Path, *, synchronous: str = "FULL") -> Database:
    """A SQLite connection in autocommit mode (transactions are explicit), WAL
    journal, foreign keys on, usable from any thread (callers serialize)."""
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
    return Database(Dialect.SQLITE, str(path), sqlite=conn)


def private_dir(path: Path) -> None:
    """Make ``path`` (and missing parents) a folder only its owner can enter."""
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    _narrow(path, PRIVATE_DIR_MODE)


def _private_file(path: Path) -> None:
    """Create ``path`` empty with mode 0600 if it is missing (SQLite then writes
    into it, and takes its mode for the side files).

    An existing file is never opened: closing any descriptor of a file drops
    every POSIX lock this process holds on it, so a second connection opened
    here would take away the first one's locks, and another process closing
    its last connection would then checkpoint and delete the WAL under this
    one (which reads a stale snapshot from then on, and would lose its
    writes): "How To Corrupt An SQLite Database File", 2.2."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE))
    for target in (path, *(path.with_name(path.name + s) for s in _SIDE_FILES)):
        with contextlib.suppress(FileNotFoundError):
            _narrow(target, PRIVATE_FILE_MODE)


def _narrow(path: Path, mode: int) -> None:
    """Take group and other bits off ``path`` if it has any (an older install's)."""
    current = stat.S_IMODE(path.stat().st_mode)
    if current & 0o077:
        log.warning("%s was readable by others (mode %o); making it %o", path, current, mode)
        path.chmod(current & ~0o077)


def schema_version(db: Database, table: str = "schema_version") -> int:
    """The version the database is at; 0 for a new one."""
    row = db.execute(f"SELECT MAX(version) AS version FROM {table}").fetchone()
    return int(row["version"] or 0)


def migrate(db: Database, steps: Sequence[Migration], table: str = "schema_version") -> int:
    """Apply the steps the database lacks, each in its own transaction; return
    the version reached, kept in ``table``. Safe to call from two processes at
    once: the version is read again inside the exclusive transaction."""
    try:
        with db.transaction(exclusive=True):
            db.execute(f"CREATE TABLE IF NOT EXISTS {table} (version INTEGER NOT NULL)")
        version = schema_version(db, table)
        if version < len(steps):
            for number, statements in enumerate(steps, start=1):
                with db.transaction(exclusive=True):
                    if schema_version(db, table) < number:
                        for statement in statements:
                            db.execute(_ddl(db.dialect, statement))
                        db.execute(f"INSERT INTO {table} (version) VALUES (?)", (number,))
            version = schema_version(db, table)
    except db.errors as e:
        raise ConfigError(f"cannot migrate database schema: {e}") from e
    if version > len(steps):
        raise ConfigError(
            f"database schema is at version {version}, newer than this tessera knows"
            f" ({len(steps)}); upgrade tessera"
        )
    return version
