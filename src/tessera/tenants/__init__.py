"""Tenants, their API keys and limits, and the audit log (SQLite under the data dir)."""

from pathlib import Path

from tessera.tenants.audit import AuditLog, AuditRecord, AuditStats
from tessera.tenants.store import (
    UNSET,
    ApiKey,
    Bootstrap,
    NewKey,
    Principal,
    Tenant,
    TenantStore,
    key_secret,
)


def open_tenancy(
    data_dir: Path, url: str | None, key_secret_file: Path | None, retention_days: float | None
) -> tuple[TenantStore, AuditLog]:
    """The tenant store and the audit log: the SQLite files of ``data_dir``, or
    the PostgreSQL database at ``url`` that gateways share."""
    secret = key_secret(data_dir, key_secret_file)
    store = TenantStore(data_dir, url=url, secret=secret)
    return store, AuditLog(data_dir, url=url, retention_days=retention_days)


__all__ = [
    "UNSET",
    "ApiKey",
    "AuditLog",
    "AuditRecord",
    "AuditStats",
    "Bootstrap",
    "NewKey",
    "Principal",
    "Tenant",
    "TenantStore",
    "open_tenancy",
]
