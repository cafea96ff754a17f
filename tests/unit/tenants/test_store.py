"""The tenant store: CRUD, keys stored hashed, authentication, bootstrap, migrations.

Tests of the interface take ``store`` (or ``database_url``) and run on SQLite
and on PostgreSQL alike; those of the SQLite files themselves on SQLite only."""

from __future__ import annotations

import hmac
import os
import sqlite3
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tessera.errors import (
    ApiKeyNotFoundError,
    ConfigError,
    InvalidTenantError,
    TenantError,
    TenantExistsError,
    TenantNotFoundError,
)
from tessera.tenants import TenantStore
from tessera.tenants.db import migrate, open_db, schema_version
from tessera.tenants.store import DB_FILE, MIGRATIONS, SECRET_ENV, SECRET_FILE, key_secret


class FakeWall:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def wall() -> FakeWall:
    return FakeWall()


@pytest.fixture
def store(tmp_path: Path, wall: FakeWall, database_url: str | None) -> Iterator[TenantStore]:
    with TenantStore(tmp_path, url=database_url, wall_clock=wall) as store:
        yield store


def test_add_get_list_update_remove(store: TenantStore, wall: FakeWall) -> None:
    acme = store.add_tenant("acme", tier="vip", qps=2, burst=4, models=["a", "b", "a"])
    assert acme.models == ("a", "b")
    assert acme.qps == 2.0
    assert acme.created_at == wall.now
    assert acme.allows("a")
    assert not acme.allows("c")
    store.add_tenant("beta")
    assert store.get_tenant("acme") == acme
    assert [t.name for t in store.list_tenants()] == ["acme", "beta"]
    beta = store.get_tenant("beta")
    assert (beta.tier, beta.qps, beta.models) == ("standard", None, None)
    assert beta.allows("anything")

    updated = store.update_tenant("acme", qps=None, max_concurrency=3, models=None)
    assert (updated.tier, updated.qps, updated.burst) == ("vip", None, 4)
    assert (updated.max_concurrency, updated.models) == (3, None)
    assert store.get_tenant("acme") == updated
    assert store.update_tenant("acme", tier="batch", daily_units=1e6).tier == "batch"

    assert store.remove_tenant("acme").tier == "batch"
    with pytest.raises(TenantNotFoundError):
        store.get_tenant("acme")
    assert [t.name for t in store.list_tenants()] == ["beta"]


def test_duplicate_and_missing_tenants(store: TenantStore) -> None:
    store.add_tenant("acme")
    with pytest.raises(TenantExistsError, match="acme"):
        store.add_tenant("acme", tier="vip")
    for call in (
        lambda: store.get_tenant("nope"),
        lambda: store.update_tenant("nope", qps=1),
        lambda: store.remove_tenant("nope"),
        lambda: store.create_key("nope"),
        lambda: store.list_keys("nope"),
    ):
        with pytest.raises(TenantNotFoundError):
            call()


@pytest.mark.parametrize(
    "fields",
    [
        {"name": ""},
        {"name": "has space"},
        {"name": "-leading"},
        {"name": "x" * 65},
        {"name": "ok", "tier": ""},
        {"name": "ok", "tier": "VIP"},
        {"name": "ok", "tier": "a b"},
        {"name": "ok", "qps": 0},
        {"name": "ok", "qps": -1.5},
        {"name": "ok", "qps": float("nan")},
        {"name": "ok", "qps": True},
        {"name": "ok", "burst": 0},
        {"name": "ok", "burst": 1.5},
        {"name": "ok", "max_concurrency": -2},
        {"name": "ok", "daily_units": float("inf")},
        {"name": "ok", "models": "a,b"},
        {"name": "ok", "models": ["a", ""]},
        {"name": "ok", "models": ["a b"]},
    ],
)
def test_bad_fields_are_refused(store: TenantStore, fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidTenantError):
        store.add_tenant(**fields)
    assert store.list_tenants() == []


def test_bad_update_changes_nothing(store: TenantStore) -> None:
    before = store.add_tenant("acme", qps=1)
    with pytest.raises(InvalidTenantError):
        store.update_tenant("acme", qps=-1)
    with pytest.raises(InvalidTenantError):
        store.update_tenant("acme", tier="Not Valid")
    assert store.get_tenant("acme") == before


def test_any_lowercase_tier_is_accepted(store: TenantStore) -> None:
    assert store.add_tenant("acme", tier="gold_2-x").tier == "gold_2-x"


def test_keys_authenticate_and_revoke(store: TenantStore) -> None:
    store.add_tenant("acme", qps=5)
    key, info = store.create_key("acme")
    admin_key, admin_info = store.create_key("acme", admin=True)
    assert key.startswith(info.prefix + "_")
    assert len(key.split("_", 2)[2]) >= 32
    assert (info.tenant, info.admin, info.revoked_at) == ("acme", False, None)
    assert admin_info.admin
    principal = store.authenticate(key)
    assert principal is not None
    assert (principal.tenant.name, principal.tenant.qps) == ("acme", 5.0)
    assert (principal.key_prefix, principal.admin) == (info.prefix, False)
    admin = store.authenticate(admin_key)
    assert admin is not None
    assert admin.admin
    assert [k.prefix for k in store.list_keys()] == [info.prefix, admin_info.prefix]

    revoked = store.revoke_key(info.prefix)
    assert revoked.revoked_at is not None
    assert store.authenticate(key) is None
    assert store.authenticate(admin_key) is not None
    # Revoking again changes nothing; a bare prefix or the whole key also work.
    assert store.revoke_key(info.prefix.removeprefix("tsk_")) == revoked
    assert store.revoke_key(admin_key).revoked_at is not None
    assert store.authenticate(admin_key) is None


def test_wrong_and_malformed_keys(store: TenantStore) -> None:
    store.add_tenant("acme")
    key, info = store.create_key("acme")
    other, _ = store.create_key("acme")
    flipped = key[:-1] + ("A" if key[-1] != "A" else "B")
    secret = key.split("_", 2)[2]
    swapped = other.split("_", 2)[0] + "_" + other.split("_", 2)[1] + "_" + secret
    for bad in [
        flipped,
        swapped,
        "",
        "tsk_",
        info.prefix,
        f"Bearer {key}",
        key + " ",
        key.upper(),
        key + "x" * 300,
        "tsk_zzzzzzzz_" + secret,
    ]:
        assert store.authenticate(bad) is None, bad
    with pytest.raises(ApiKeyNotFoundError):
        store.revoke_key("tsk_zzzzzzzz")
    with pytest.raises(ApiKeyNotFoundError):
        store.revoke_key("not a prefix")


def test_keys_are_compared_in_constant_time(
    store: TenantStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every well-formed key is checked by hmac.compare_digest on its digest,
    never by ``==``: a right key, a wrong secret under a real prefix, and an
    unknown prefix (the same work on a miss as on a hit)."""
    store.add_tenant("acme")
    key, _ = store.create_key("acme")
    compared: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def spy(a: str, b: str) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    scheme, public, secret = key.split("_", 2)  # the secret may hold "_" itself
    wrong = f"{scheme}_{public}_" + ("A" if secret[0] != "A" else "B") + secret[1:]
    for candidate, expected in ((key, True), (wrong, False), ("tsk_zzzzzzzz_" + secret, False)):
        compared.clear()
        assert (store.authenticate(candidate) is not None) is expected, candidate
        assert len(compared) == 1, candidate
        assert all(len(a) == len(b) == 64 for a, b in compared)  # digests, not keys


def test_changes_from_another_process_take_effect_at_once(
    store: TenantStore, tmp_path: Path, database_url: str | None
) -> None:
    store.add_tenant("acme", qps=1)
    key, info = store.create_key("acme")
    # A second store on the same database stands in for the CLI's process
    # (or, on PostgreSQL, for another gateway).
    with TenantStore(tmp_path, url=database_url) as cli:
        cli.update_tenant("acme", qps=9)
        principal = store.authenticate(key)
        assert principal is not None
        assert principal.tenant.qps == 9.0
        cli.revoke_key(info.prefix)
        assert store.authenticate(key) is None
        new_key, _ = cli.create_key("acme")
    assert store.authenticate(new_key) is not None


def test_remove_tenant_removes_its_keys(store: TenantStore) -> None:
    store.add_tenant("acme")
    store.add_tenant("beta")
    key, _ = store.create_key("acme")
    beta_key, beta_info = store.create_key("beta")
    store.remove_tenant("acme")
    assert store.authenticate(key) is None
    assert store.list_keys() == [beta_info]
    assert store.authenticate(beta_key) is not None


def _stored_bytes(data_dir: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(data_dir.glob(DB_FILE + "*")))


def _stored_values(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return [
            str(value)
            for table in tables
            for row in conn.execute(f"SELECT * FROM {table}")
            for value in row
        ]
    finally:
        conn.close()


def test_no_key_is_stored_in_plain_text(tmp_path: Path) -> None:
    store = TenantStore(tmp_path)
    store.add_tenant("acme")
    keys = [store.create_key("acme", admin=i == 0).key for i in range(5)]
    bootstrap = TenantStore(tmp_path / "other").ensure_bootstrap()
    assert bootstrap is not None
    secrets = [k.split("_", 2)[2] for k in keys]

    def check() -> None:
        raw = _stored_bytes(tmp_path)
        values = _stored_values(tmp_path / DB_FILE)
        for key, secret in zip(keys, secrets, strict=True):
            assert key.encode() not in raw
            assert secret.encode() not in raw
            assert secret[:16].encode() not in raw
            assert not any(secret in v or key in v for v in values)
        assert (tmp_path / SECRET_FILE).read_text().strip() not in "".join(values)

    check()  # with the write-ahead log still open
    store.close()
    check()  # after the checkpoint into the main file
    assert stat.S_IMODE((tmp_path / SECRET_FILE).stat().st_mode) == 0o600


def test_keys_survive_reopen_and_need_the_secret(tmp_path: Path, database_url: str | None) -> None:
    with TenantStore(tmp_path, url=database_url) as store:
        store.add_tenant("acme")
        key, _ = store.create_key("acme")
    with TenantStore(tmp_path, url=database_url) as store:
        assert store.authenticate(key) is not None
    # A new secret (the old one lost) invalidates every key.
    (tmp_path / SECRET_FILE).unlink()
    with TenantStore(tmp_path, url=database_url) as store:
        assert store.authenticate(key) is None


def test_the_key_secret_comes_from_the_environment_a_file_or_the_data_dir(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared.key"
    from_file = key_secret(tmp_path / "a", shared, environ={})
    assert shared.is_file()
    assert key_secret(tmp_path / "b", shared, environ={}) == from_file  # a second gateway
    own = key_secret(tmp_path, environ={})
    assert own != from_file
    assert (tmp_path / SECRET_FILE).read_text().strip() == own.hex()
    text = "ab" * 32
    assert key_secret(tmp_path, shared, environ={SECRET_ENV: text}) == bytes.fromhex(text)
    for bad in ("not hex", "abcd"):
        with pytest.raises(ConfigError, match=SECRET_ENV):
            key_secret(tmp_path, environ={SECRET_ENV: bad})


@pytest.mark.parametrize("content", ["", "not hex", "abcd"])
def test_bad_secret_file_is_a_config_error(tmp_path: Path, content: str) -> None:
    (tmp_path / SECRET_FILE).write_text(content)
    with pytest.raises(ConfigError, match="secret"):
        TenantStore(tmp_path)


def test_bootstrap_once(store: TenantStore) -> None:
    first = store.ensure_bootstrap()
    assert first is not None
    assert (first.tenant.name, first.tenant.tier, first.tenant.qps) == ("default", "standard", None)
    principal = store.authenticate(first.key)
    assert principal is not None
    assert principal.admin
    assert principal.tenant == first.tenant
    assert store.ensure_bootstrap() is None
    assert len(store.list_keys()) == 1


def test_no_bootstrap_when_tenants_exist(store: TenantStore) -> None:
    store.add_tenant("acme")
    assert store.ensure_bootstrap() is None
    assert store.list_keys() == []


def test_migrations_are_idempotent_on_reopen(tmp_path: Path) -> None:
    with TenantStore(tmp_path) as store:
        store.add_tenant("acme")
    for _ in range(2):
        with TenantStore(tmp_path) as store:
            assert [t.name for t in store.list_tenants()] == ["acme"]
    conn = sqlite3.connect(tmp_path / DB_FILE)
    try:
        versions = [r[0] for r in conn.execute("SELECT version FROM schema_version")]
        assert versions == list(range(1, len(MIGRATIONS) + 1))
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_migrate_applies_only_missing_steps(tmp_path: Path) -> None:
    conn = open_db(tmp_path / "x.db")
    try:
        steps = [["CREATE TABLE a (x INTEGER)"], ["CREATE TABLE b (y INTEGER)"]]
        assert migrate(conn, steps[:1]) == 1
        assert migrate(conn, steps) == 2
        assert migrate(conn, steps) == 2
        assert schema_version(conn) == 2
        # A database newer than this code is refused, not silently used.
        with pytest.raises(ConfigError, match="newer"):
            migrate(conn, steps[:1])
        # A failing step leaves the version where it was.
        with pytest.raises(ConfigError):
            migrate(conn, [*steps, ["CREATE TABLE c (z INTEGER)", "NOT SQL"]])
        assert schema_version(conn) == 2
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master").fetchall()}
        assert "c" not in names
    finally:
        conn.close()


def test_foreign_keys_are_on(tmp_path: Path) -> None:
    store = TenantStore(tmp_path)
    conn = sqlite3.connect(store.path)
    try:
        # The store's own connections enforce it; check the schema declares it.
        sql = conn.execute("SELECT sql FROM sqlite_master WHERE name='api_keys'").fetchone()[0]
        assert "REFERENCES tenants(name) ON DELETE CASCADE" in sql
    finally:
        conn.close()
    assert store._writer.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    store.close()


def test_closed_store_raises_tenant_error(tmp_path: Path, database_url: str | None) -> None:
    store = TenantStore(tmp_path, url=database_url)
    store.close()
    with pytest.raises(TenantError):
        store.list_tenants()


def test_threads_share_one_store(store: TenantStore) -> None:
    store.add_tenant("acme")
    keys = [store.create_key("acme").key for _ in range(4)]

    def work(i: int) -> bool:
        if i % 5 == 0:
            store.create_key("acme")
        return store.authenticate(keys[i % len(keys)]) is not None

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert all(pool.map(work, range(200)))
    assert len(store.list_keys("acme")) == 4 + 40


def test_a_remembered_key_is_refused_at_once_after_a_change(
    store: TenantStore, tmp_path: Path, database_url: str | None
) -> None:
    store.add_tenant("acme", qps=1)
    key, info = store.create_key("acme")
    for _ in range(3):  # the second and third come from memory
        principal = store.authenticate(key)
        assert principal is not None
        assert principal.tenant.qps == 1.0
    with TenantStore(tmp_path, url=database_url) as cli:
        cli.update_tenant("acme", qps=5)
        principal = store.authenticate(key)
        assert principal is not None
        assert principal.tenant.qps == 5.0
        cli.revoke_key(info.prefix)
    assert store.authenticate(key) is None
    assert store.authenticate("tsk_" + "0" * 8 + "_" + "x" * 32) is None


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_data_folder_and_databases_are_the_owners_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tessera.tenants import AuditLog

    data_dir = tmp_path / "data"
    old_umask = os.umask(0)  # the widest: only the modes asked for at creation hold
    try:
        with TenantStore(data_dir) as store:
            store.add_tenant("acme")
            audit = AuditLog(data_dir)
            audit.close_sync()
            files = sorted(p.name for p in data_dir.iterdir())
            modes = {p.name: _mode(p) for p in data_dir.iterdir()}
    finally:
        os.umask(old_umask)
    assert {"tessera.db", "tessera.db-wal", "tessera.db-shm", "audit.db"} <= set(files)
    assert _mode(data_dir) == 0o700
    assert modes == dict.fromkeys(files, 0o600)
    # Created private, never narrowed after: nothing was ever wider.
    assert "readable by others" not in caplog.text


def test_an_older_wider_data_folder_is_narrowed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data_dir = tmp_path / "data"
    with TenantStore(data_dir):
        pass
    data_dir.chmod(0o755)
    (data_dir / DB_FILE).chmod(0o644)
    (data_dir / SECRET_FILE).chmod(0o644)
    with TenantStore(data_dir):
        assert _mode(data_dir) == 0o700
        assert _mode(data_dir / DB_FILE) == 0o600
        assert _mode(data_dir / SECRET_FILE) == 0o600
    assert "readable by others" in caplog.text
    # The server reads the secret before its store: the same for that path.
    (data_dir / SECRET_FILE).chmod(0o640)
    key_secret(data_dir, environ={})
    assert _mode(data_dir / SECRET_FILE) == 0o600
    # An operator's own secret file is left as it is, with a warning.
    own = tmp_path / "own.key"
    own.write_text((data_dir / SECRET_FILE).read_text())
    own.chmod(0o644)
    key_secret(data_dir, own, environ={})
    assert _mode(own) == 0o644
