"""Tenants, their API keys and limits, and the audit log (SQLite under the data dir)."""

from tessera.tenants.audit import AuditLog, AuditRecord, AuditStats
from tessera.tenants.store import (
    UNSET,
    ApiKey,
    Bootstrap,
    NewKey,
    Principal,
    Tenant,
    TenantStore,
)

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
]
