"""Tenants and their API keys, in SQLite under the data dir (``tessera.db``),
or in a PostgreSQL database that many gateways share (``url``).

A key reads ``tsk_<8 public chars>_<43 secret chars>``. Only its prefix
(``tsk_<8 chars>``, shown to tell keys apart) and HMAC-SHA256(server secret,
key) are stored. The server secret is ``secret.key`` in the data dir (mode
0600), never in the database, so a copy of the database alone cannot even
check a guess. Losing ``secret.key`` invalidates every key. Gateways sharing
one database must share the secret too: ``key_secret`` reads it from
``TESSERA_KEY_SECRET`` (hex) or a file named in the config before the data dir.

Nothing is kept stale: every ``authenticate`` checks the database, so a change
made by the CLI (another process), the admin API or another gateway takes
effect on the next request. On SQLite a key found once is remembered while
SQLite's ``data_version`` stays the same (one cheap check instead of a join);
PostgreSQL has no such check, so there each ``authenticate`` is one query.
Calls are short and thread-safe; the reader and the writer have a connection
each, so authentication never waits behind a write of this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import stat
import string
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from tessera.errors import (
    ApiKeyNotFoundError,
    ConfigError,
    InvalidTenantError,
    TenantError,
    TenantExistsError,
    TenantNotFoundError,
)
from tessera.tenants.db import Database, Row, migrate, open_database, private_dir

log = logging.getLogger(__name__)

DB_FILE = "tessera.db"
SECRET_FILE = "secret.key"
SECRET_ENV = "TESSERA_KEY_SECRET"
DEFAULT_TIER = "standard"
KNOWN_TIERS = ("vip", "standard", "batch")
# The largest integer limit: SQLite's and PostgreSQL's BIGINT.
MAX_LIMIT = 2**63 - 1
BOOTSTRAP_TENANT = "default"

KEY_SCHEME = "tsk"
_PREFIX_ALPHABET = string.ascii_lowercase + string.digits
_PREFIX_CHARS = 8
_SECRET_BYTES = 32  # token_urlsafe(32) -> 43 characters, 256 bits
_MAX_KEY_CHARS = 200
_KEY_RE = re.compile(r"tsk_([a-z0-9]{8})_([A-Za-z0-9_-]{32,150})")
_PREFIX_RE = re.compile(r"(?:tsk_)?([a-z0-9]{8})")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_TIER_RE = re.compile(r"[a-z0-9_-]{1,32}")
_MODEL_RE = re.compile(r"[^\s,]{1,200}")

# Append only: a step is never edited once released (see tenants/db.py).
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE tenants (
            name TEXT PRIMARY KEY,
            tier TEXT NOT NULL,
            qps REAL,
            burst INTEGER,
            max_concurrency INTEGER,
            daily_units REAL,
            models TEXT,            -- JSON array of model names; NULL = every model
            created_at REAL NOT NULL
        )""",
        """CREATE TABLE api_keys (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
            prefix TEXT NOT NULL UNIQUE,
            hash_alg TEXT NOT NULL DEFAULT 'hmac-sha256',
            key_hash TEXT NOT NULL,
            admin INTEGER NOT NULL DEFAULT 0 CHECK (admin IN (0, 1)),
            created_at REAL NOT NULL,
            revoked_at REAL
        )""",
        "CREATE INDEX api_keys_tenant ON api_keys(tenant)",
    ),
)


@dataclass(frozen=True)
class Tenant:
    """A customer: its tier and limits (None = unlimited) and allowed models."""

    name: str
    tier: str
    qps: float | None
    burst: int | None
    max_concurrency: int | None
    daily_units: float | None
    models: tuple[str, ...] | None  # None = every model; () = none
    created_at: float

    def allows(self, model: str) -> bool:
        """Whether this tenant may use ``model``."""
        return self.models is None or model in self.models


@dataclass(frozen=True)
class ApiKey:
    """What is known of a key after it was shown once: never the key itself."""

    id: int
    tenant: str
    prefix: str
    admin: bool
    created_at: float
    revoked_at: float | None


@dataclass(frozen=True)
class Principal:
    """Who a request is from: the tenant as it is now, and which key."""

    tenant: Tenant
    key_prefix: str
    admin: bool


AUTH_CACHE_MAX = 10_000  # keys remembered between database changes


class NewKey(NamedTuple):
    """A key just created: ``key`` is the plaintext, returned this once."""

    key: str
    info: ApiKey


class Bootstrap(NamedTuple):
    """The tenant and admin key made on first start."""

    tenant: Tenant
    key: str


class Unset(enum.Enum):
    """Marks a field ``update_tenant`` leaves as it is (None means unlimited)."""

    UNSET = enum.auto()


UNSET = Unset.UNSET


class TenantStore:
    """Tenants and API keys in ``<data_dir>/tessera.db``, or in the PostgreSQL
    database at ``url``; see the module notes. ``secret`` is the HMAC key
    (default: ``<data_dir>/secret.key``, made if missing)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        url: str | None = None,
        secret: bytes | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / DB_FILE  # the SQLite file, when there is no url
        self._wall = wall_clock
        # Successful authentications by key digest, valid while the database is
        # unchanged: SQLite's data_version moves when any connection, in any
        # process, commits. A lookup is a join on every request; the check is not.
        self._auth_cache: dict[str, Principal] = {}
        self._auth_version: int | None = None
        try:
            private_dir(self.data_dir)
        except OSError as e:
            raise ConfigError(f"cannot create the data dir {self.data_dir}: {e}") from e
        if secret is None:
            secret = load_secret(self.data_dir / SECRET_FILE, private=True)
        self._secret = secret
        self._writer = open_database(url, self.path)
        try:
            migrate(self._writer, MIGRATIONS)
            self._reader = open_database(url, self.path)
        except BaseException:
            self._writer.close()
            raise
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()

    def close(self) -> None:
        with self._write_lock, self._read_lock:
            self._writer.close()
            self._reader.close()

    def __enter__(self) -> TenantStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- tenants -----------------------------------------------------------

    def add_tenant(
        self,
        name: str,
        tier: str = DEFAULT_TIER,
        qps: float | None = None,
        burst: int | None = None,
        max_concurrency: int | None = None,
        daily_units: float | None = None,
        models: Sequence[str] | None = None,
    ) -> Tenant:
        """Create a tenant; TenantExistsError if the name is taken."""
        tenant = Tenant(
            name=check_name(name),
            tier=check_tier(tier),
            qps=_positive_float("qps", qps),
            burst=_positive_int("burst", burst),
            max_concurrency=_positive_int("max_concurrency", max_concurrency),
            daily_units=_positive_float("daily_units", daily_units),
            models=check_models(models),
            created_at=self._wall(),
        )
        with self._write() as conn:
            if _tenant_row(conn, tenant.name) is not None:
                raise TenantExistsError(tenant.name)
            _insert_tenant(conn, tenant)
        return tenant

    def update_tenant(
        self,
        name: str,
        *,
        tier: str | Unset = UNSET,
        qps: float | Unset | None = UNSET,
        burst: int | Unset | None = UNSET,
        max_concurrency: int | Unset | None = UNSET,
        daily_units: float | Unset | None = UNSET,
        models: Sequence[str] | Unset | None = UNSET,
    ) -> Tenant:
        """Change the fields given; None clears a limit (or allows every model)."""
        changes: dict[str, Any] = {}
        if not isinstance(tier, Unset):
            changes["tier"] = check_tier(tier)
        if not isinstance(qps, Unset):
            changes["qps"] = _positive_float("qps", qps)
        if not isinstance(burst, Unset):
            changes["burst"] = _positive_int("burst", burst)
        if not isinstance(max_concurrency, Unset):
            changes["max_concurrency"] = _positive_int("max_concurrency", max_concurrency)
        if not isinstance(daily_units, Unset):
            changes["daily_units"] = _positive_float("daily_units", daily_units)
        if not isinstance(models, Unset):
            changes["models"] = check_models(models)
        with self._write() as conn:
            tenant = dataclasses.replace(_get_tenant(conn, name), **changes)
            conn.execute(
                "UPDATE tenants SET tier = ?, qps = ?, burst = ?, max_concurrency = ?,"
                " daily_units = ?, models = ? WHERE name = ?",
                (*_tenant_params(tenant)[1:7], tenant.name),
            )
        return tenant

    def remove_tenant(self, name: str) -> Tenant:
        """Delete a tenant and all its keys (they stop working at once)."""
        with self._write() as conn:
            tenant = _get_tenant(conn, name)
            conn.execute("DELETE FROM tenants WHERE name = ?", (name,))
        return tenant

    def get_tenant(self, name: str) -> Tenant:
        """The tenant; TenantNotFoundError if there is none of that name."""
        with self._read() as conn:
            return _get_tenant(conn, name)

    def list_tenants(self) -> list[Tenant]:
        with self._read() as conn:
            rows = conn.execute("SELECT * FROM tenants ORDER BY name").fetchall()
        return [_tenant_of(row) for row in rows]

    # -- keys --------------------------------------------------------------

    def create_key(self, tenant: str, admin: bool = False) -> NewKey:
        """A new key for ``tenant``; its plaintext is in the result and nowhere else."""
        with self._write() as conn:
            _get_tenant(conn, tenant)
            return self._insert_key(conn, tenant, admin)

    def list_keys(self, tenant: str | None = None) -> list[ApiKey]:
        """Every key (revoked ones too), oldest first; of one tenant if given."""
        with self._read() as conn:
            if tenant is None:
                rows = conn.execute("SELECT * FROM api_keys ORDER BY id").fetchall()
            else:
                _get_tenant(conn, tenant)
                rows = conn.execute(
                    "SELECT * FROM api_keys WHERE tenant = ? ORDER BY id", (tenant,)
                ).fetchall()
        return [_key_of(row) for row in rows]

    def revoke_key(self, prefix: str) -> ApiKey:
        """Revoke a key by its prefix (``tsk_abcd1234``, ``abcd1234`` or the
        whole key). Revoking a revoked key changes nothing."""
        normalized = normalize_prefix(prefix)
        if normalized is None:
            raise ApiKeyNotFoundError(prefix)
        with self._write() as conn:
            conn.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE prefix = ? AND revoked_at IS NULL",
                (self._wall(), normalized),
            )
            row = conn.execute("SELECT * FROM api_keys WHERE prefix = ?", (normalized,)).fetchone()
        if row is None:
            raise ApiKeyNotFoundError(prefix)
        return _key_of(row)

    def authenticate(self, key: str) -> Principal | None:
        """Who holds ``key``; None if it is malformed, unknown or revoked.

        Raises TenantError only if the database itself fails."""
        if not isinstance(key, str) or len(key) > _MAX_KEY_CHARS:
            return None
        match = _KEY_RE.fullmatch(key)
        if match is None:
            return None
        digest = self._digest(key)
        with self._read() as conn:
            version = conn.data_version()
            if version is None or version != self._auth_version:
                self._auth_cache.clear()
                self._auth_version = version
            cached = self._auth_cache.get(digest)
            if cached is not None:
                return cached
            row = conn.execute(
                "SELECT k.key_hash, k.admin, k.revoked_at, t.* FROM api_keys k"
                " JOIN tenants t ON t.name = k.tenant WHERE k.prefix = ?",
                (f"{KEY_SCHEME}_{match.group(1)}",),
            ).fetchone()
        if row is None:
            # Same work on a miss as on a hit, so timing tells little about prefixes.
            hmac.compare_digest(digest, digest)
            return None
        if not hmac.compare_digest(str(row["key_hash"]), digest):
            return None
        if row["revoked_at"] is not None:
            return None
        prefix = f"{KEY_SCHEME}_{match.group(1)}"
        principal = Principal(tenant=_tenant_of(row), key_prefix=prefix, admin=bool(row["admin"]))
        with self._read_lock:
            # Nothing changed since the row was read (never known on PostgreSQL).
            if version is not None and self._auth_version == version:
                if len(self._auth_cache) >= AUTH_CACHE_MAX:
                    self._auth_cache.clear()
                self._auth_cache[digest] = principal
        return principal

    def ensure_bootstrap(self) -> Bootstrap | None:
        """On a store with no tenants, create tenant ``default`` (standard, no
        limits) and an admin key for it, and return both; otherwise None."""
        with self._write() as conn:
            if conn.execute("SELECT 1 FROM tenants LIMIT 1").fetchone() is not None:
                return None
            tenant = Tenant(
                name=BOOTSTRAP_TENANT,
                tier=DEFAULT_TIER,
                qps=None,
                burst=None,
                max_concurrency=None,
                daily_units=None,
                models=None,
                created_at=self._wall(),
            )
            _insert_tenant(conn, tenant)
            new = self._insert_key(conn, tenant.name, admin=True)
        return Bootstrap(tenant, new.key)

    # -- internals ---------------------------------------------------------

    def _digest(self, key: str) -> str:
        return hmac.new(self._secret, key.encode("utf-8"), hashlib.sha256).hexdigest()

    def _insert_key(self, conn: Database, tenant: str, admin: bool) -> NewKey:
        for _ in range(8):
            public = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(_PREFIX_CHARS))
            prefix = f"{KEY_SCHEME}_{public}"
            taken = conn.execute("SELECT 1 FROM api_keys WHERE prefix = ?", (prefix,)).fetchone()
            if taken is None:
                break
        else:  # 36^8 prefixes: eight collisions in a row means something else is wrong
            raise TenantError("could not draw an unused key prefix")
        key = f"{prefix}_{secrets.token_urlsafe(_SECRET_BYTES)}"
        created_at = self._wall()
        row = conn.execute(
            "INSERT INTO api_keys (tenant, prefix, key_hash, admin, created_at)"
            " VALUES (?, ?, ?, ?, ?) RETURNING id",
            (tenant, prefix, self._digest(key), int(bool(admin)), created_at),
        ).fetchone()
        if row is None:
            raise TenantError("the database did not return the new key's id")
        info = ApiKey(int(row["id"]), tenant, prefix, bool(admin), created_at, None)
        return NewKey(key, info)

    @contextlib.contextmanager
    def _read(self) -> Iterator[Database]:
        with self._read_lock, self._errors():
            yield self._reader

    @contextlib.contextmanager
    def _write(self) -> Iterator[Database]:
        """One write transaction; exclusive so that a check and the write after
        it cannot interleave with another process's (another gateway's)."""
        with self._write_lock, self._errors(), self._writer.transaction(exclusive=True):
            yield self._writer

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except self._writer.errors as e:
            raise TenantError(f"tenant store {self._writer.where}: {e}") from e


# -- validation ------------------------------------------------------------


def check_name(name: object) -> str:
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise InvalidTenantError(
            f"bad tenant name {name!r}: use 1-64 of A-Z a-z 0-9 _ . -,"
            " starting with a letter or digit"
        )
    return name


def check_tier(tier: object) -> str:
    if not isinstance(tier, str) or _TIER_RE.fullmatch(tier) is None:
        raise InvalidTenantError(
            f"bad tier {tier!r}: use 1-32 of a-z 0-9 _ - (known: {', '.join(KNOWN_TIERS)})"
        )
    return tier


def check_models(models: object) -> tuple[str, ...] | None:
    """A tuple of model names without repeats, or None for every model."""
    if models is None:
        return None
    if isinstance(models, str) or not isinstance(models, Sequence):
        raise InvalidTenantError(f"models must be a list of model names, not {models!r}")
    names: list[str] = []
    for model in models:
        if not isinstance(model, str) or _MODEL_RE.fullmatch(model) is None:
            raise InvalidTenantError(f"bad model name {model!r}")
        if model not in names:
            names.append(model)
    return tuple(names)


def _positive_float(field: str, value: object) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InvalidTenantError(f"{field} must be a positive number or unset, not {value!r}")
    return float(value)


def _positive_int(field: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
        raise InvalidTenantError(
            f"{field} must be a positive integer up to {MAX_LIMIT} or unset, not {value!r}"
        )
    return value


def normalize_prefix(text: str) -> str | None:
    """``tsk_abcd1234`` from that, from ``abcd1234``, or from a whole key."""
    match = _KEY_RE.fullmatch(text) or _PREFIX_RE.fullmatch(text)
    return f"{KEY_SCHEME}_{match.group(1)}" if match else None


# -- rows --------------------------------------------------------------------


def _tenant_row(conn: Database, name: str) -> Row | None:
    row: Row | None = conn.execute("SELECT * FROM tenants WHERE name = ?", (name,)).fetchone()
    return row


def _get_tenant(conn: Database, name: str) -> Tenant:
    row = _tenant_row(conn, name)
    if row is None:
        raise TenantNotFoundError(name)
    return _tenant_of(row)


def _insert_tenant(conn: Database, tenant: Tenant) -> None:
    conn.execute(
        "INSERT INTO tenants (name, tier, qps, burst, max_concurrency, daily_units, models,"
        " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        _tenant_params(tenant),
    )


def _tenant_params(tenant: Tenant) -> tuple[object, ...]:
    models = None if tenant.models is None else json.dumps(list(tenant.models))
    return (
        tenant.name,
        tenant.tier,
        tenant.qps,
        tenant.burst,
        tenant.max_concurrency,
        tenant.daily_units,
        models,
        tenant.created_at,
    )


def _tenant_of(row: Row) -> Tenant:
    models = row["models"]
    return Tenant(
        name=row["name"],
        tier=row["tier"],
        qps=row["qps"],
        burst=row["burst"],
        max_concurrency=row["max_concurrency"],
        daily_units=row["daily_units"],
        models=None if models is None else tuple(json.loads(models)),
        created_at=row["created_at"],
    )


def _key_of(row: Row) -> ApiKey:
    return ApiKey(
        id=row["id"],
        tenant=row["tenant"],
        prefix=row["prefix"],
        admin=bool(row["admin"]),
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
    )


# -- the server secret ---------------------------------------------------------


def key_secret(
    data_dir: Path, secret_file: Path | None = None, environ: Mapping[str, str] = os.environ
) -> bytes:
    """The HMAC secret for keys: ``TESSERA_KEY_SECRET`` (hex, 32 bytes or more)
    if set, else the file ``secret_file``, else ``<data_dir>/secret.key``
    (either file made if missing). Gateways that share a database share it."""
    text = environ.get(SECRET_ENV)
    if text is None and secret_file is not None:
        return load_secret(secret_file)
    if text is None:
        try:
            private_dir(data_dir)
        except OSError as e:
            raise ConfigError(f"cannot create the data dir {data_dir}: {e}") from e
        return load_secret(data_dir / SECRET_FILE, private=True)
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError as e:
        raise ConfigError(f"{SECRET_ENV} must be hex: {e}") from e
    if len(secret) < 32:
        raise ConfigError(f"{SECRET_ENV} is too short ({len(secret)} bytes, at least 32)")
    return secret


def load_secret(path: Path, *, private: bool = False) -> bytes:
    """The HMAC secret in ``path``, created (mode 0600) if missing. Never
    overwritten: replacing it would invalidate every key. A file readable by
    others is narrowed to its owner when ``private`` (the data folder's own, as
    its databases are), else only warned about (an operator's file, which may
    sit on a read-only mount)."""
    if not path.exists():
        _create_secret(path)
    try:
        text = path.read_text(encoding="ascii").strip()
        secret = bytes.fromhex(text)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the server secret {path}: {e}") from e
    if len(secret) < 32:
        raise ConfigError(f"the server secret {path} is too short ({len(secret)} bytes)")
    with contextlib.suppress(OSError):
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077 and private:
            log.warning("%s was readable by others (mode %o); making it 600", path, mode)
            path.chmod(mode & ~0o077)
        elif mode & 0o077:
            log.warning("%s is readable by others; chmod 600 it", path)
    return secret


def _create_secret(path: Path) -> None:
    # Written under a temporary name, then linked into place: link fails if
    # another process got there first, and nobody ever reads a half-written file.
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, (secrets.token_hex(32) + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):
            os.link(temp, path)
    except OSError as e:
        raise ConfigError(f"cannot create the server secret {path}: {e}") from e
    finally:
        with contextlib.suppress(OSError):
            temp.unlink()
