"""``tessera tenants``, ``tessera keys`` and ``tessera audit``; mounted on the
main command by ``register``. Each works on ``--data-dir`` directly, so it may
run beside a live server: the server sees the change on its next request.
Gateways sharing a PostgreSQL database are reached the same way: with
``TESSERA_TENANT_STORE`` set to its URL (and the gateways' key secret in
``TESSERA_KEY_SECRET`` or ``TESSERA_KEY_SECRET_FILE``).

Lists are rich tables on a terminal and tab-separated lines (with a header)
otherwise. Errors print one line to stderr and exit 2.
"""

from __future__ import annotations

import contextlib
import csv
import enum
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from tessera.errors import InvalidTenantError, TesseraError
from tessera.tenants.audit import (
    AUDIT_DB_FILE,
    COLUMNS,
    AuditLog,
    iso_time,
    parse_time,
    start_of_day_utc,
)
from tessera.tenants.store import (
    DEFAULT_TIER,
    KNOWN_TIERS,
    ApiKey,
    Tenant,
    TenantStore,
    key_secret,
)

tenants_app = typer.Typer(help="Tenants: tier, limits, allowed models.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys (stored hashed; shown once).", no_args_is_help=True)

DataDirOpt = Annotated[Path, typer.Option("--data-dir", help="Where state is kept.")]
NameArg = Annotated[str, typer.Argument(help="Tenant name.")]
QpsOpt = Annotated[float | None, typer.Option("--qps", help="Requests per second.")]
BurstOpt = Annotated[int | None, typer.Option("--burst", help="Token bucket size.")]
ConcurrencyOpt = Annotated[
    int | None, typer.Option("--max-concurrency", help="Requests in flight at once.")
]
DailyOpt = Annotated[float | None, typer.Option("--daily-units", help="Work units per UTC day.")]
ModelsOpt = Annotated[
    str | None, typer.Option("--models", help="Allowed models, a,b; 'all' for every model.")
]
_TIER_HELP = f"Priority tier ({', '.join(KNOWN_TIERS)} or one from the config)."

_UNSETTABLE = {
    "qps": "qps",
    "burst": "burst",
    "max-concurrency": "max_concurrency",
    "daily-units": "daily_units",
    "models": "models",
}


class Format(enum.StrEnum):
    csv = "csv"
    json = "json"


def register(app: typer.Typer) -> None:
    """Add ``tenants``, ``keys`` and ``audit`` to the main command."""
    app.add_typer(tenants_app, name="tenants")
    app.add_typer(keys_app, name="keys")
    app.command("audit")(audit)


@contextlib.contextmanager
def _clear_errors() -> Iterator[None]:
    try:
        yield
    except TesseraError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e


STORE_ENV = "TESSERA_TENANT_STORE"
SECRET_FILE_ENV = "TESSERA_KEY_SECRET_FILE"


@contextlib.contextmanager
def _store(data_dir: Path) -> Iterator[TenantStore]:
    with _clear_errors():
        secret_file = os.environ.get(SECRET_FILE_ENV)
        secret = key_secret(data_dir, Path(secret_file) if secret_file else None)
        with TenantStore(data_dir, url=os.environ.get(STORE_ENV), secret=secret) as store:
            yield store


# -- tenants -------------------------------------------------------------------


@tenants_app.command("add")
def tenants_add(
    name: NameArg,
    tier: Annotated[str, typer.Option("--tier", help=_TIER_HELP)] = DEFAULT_TIER,
    qps: QpsOpt = None,
    burst: BurstOpt = None,
    max_concurrency: ConcurrencyOpt = None,
    daily_units: DailyOpt = None,
    models: ModelsOpt = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """Add a tenant (no limit unless given; every model unless --models)."""
    with _store(data_dir) as store:
        tenant = store.add_tenant(
            name,
            tier=tier,
            qps=qps,
            burst=burst,
            max_concurrency=max_concurrency,
            daily_units=daily_units,
            models=_models(models) if models is not None else None,
        )
        typer.echo(f"added tenant {tenant.name} (tier {tenant.tier})")


@tenants_app.command("list")
def tenants_list(data_dir: DataDirOpt = Path("data")) -> None:
    """List the tenants."""
    with _store(data_dir) as store:
        tenants = store.list_tenants()
    _print_rows(_TENANT_HEADER, [_tenant_cells(t) for t in tenants])


@tenants_app.command("show")
def tenants_show(name: NameArg, data_dir: DataDirOpt = Path("data")) -> None:
    """Show one tenant and its keys."""
    with _store(data_dir) as store:
        tenant = store.get_tenant(name)
        keys = store.list_keys(name)
    fields = list(zip(_TENANT_HEADER, _tenant_cells(tenant), strict=True))
    active = [k.prefix for k in keys if k.revoked_at is None]
    fields.append(("keys", ",".join(active) or "-"))
    _print_rows(("field", "value"), fields)


@tenants_app.command("update")
def tenants_update(
    name: NameArg,
    tier: Annotated[str | None, typer.Option("--tier", help=_TIER_HELP)] = None,
    qps: QpsOpt = None,
    burst: BurstOpt = None,
    max_concurrency: ConcurrencyOpt = None,
    daily_units: DailyOpt = None,
    models: ModelsOpt = None,
    unset: Annotated[
        list[str] | None,
        typer.Option("--unset", help=f"Remove a limit (repeatable): {', '.join(_UNSETTABLE)}."),
    ] = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """Change a tenant's tier, limits or models; --unset FIELD lifts a limit."""
    given: dict[str, Any] = {
        "tier": tier,
        "qps": qps,
        "burst": burst,
        "max_concurrency": max_concurrency,
        "daily_units": daily_units,
    }
    changes = {k: v for k, v in given.items() if v is not None}
    if models is not None:
        changes["models"] = _models(models)  # None for 'all'
    with _clear_errors():
        for option in unset or ():
            field = _UNSETTABLE.get(option.replace("_", "-"))
            if field is None:
                raise InvalidTenantError(
                    f"cannot unset {option!r}: choose from {', '.join(_UNSETTABLE)}"
                )
            if field in changes:
                raise InvalidTenantError(f"{option} is both set and unset")
            changes[field] = None
        if not changes:
            raise InvalidTenantError("nothing to change: give an option or --unset")
    with _store(data_dir) as store:
        tenant = store.update_tenant(name, **changes)
    typer.echo(f"updated tenant {tenant.name}")


@tenants_app.command("remove")
def tenants_remove(name: NameArg, data_dir: DataDirOpt = Path("data")) -> None:
    """Remove a tenant and its keys."""
    with _store(data_dir) as store:
        tenant = store.remove_tenant(name)
    typer.echo(f"removed tenant {tenant.name} and its keys")


# -- keys ----------------------------------------------------------------------


@keys_app.command("create")
def keys_create(
    name: NameArg,
    admin: Annotated[bool, typer.Option("--admin", help="May use the admin API.")] = False,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """Create a key; it is printed this once, as the last word."""
    with _store(data_dir) as store:
        key, info = store.create_key(name, admin=admin)
    kind = "admin key" if info.admin else "key"
    typer.echo(f"created {kind} {info.prefix} for tenant {info.tenant}; shown this once:")
    typer.echo(key)


@keys_app.command("list")
def keys_list(
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's.")] = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """List keys by prefix (never the keys themselves)."""
    with _store(data_dir) as store:
        keys = store.list_keys(tenant)
    _print_rows(_KEY_HEADER, [_key_cells(k) for k in keys])


@keys_app.command("revoke")
def keys_revoke(
    prefix: Annotated[str, typer.Argument(help="The key's prefix, e.g. tsk_ab12cd34.")],
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """Revoke a key; it stops working at once."""
    with _store(data_dir) as store:
        key = store.revoke_key(prefix)
    typer.echo(f"revoked key {key.prefix} of tenant {key.tenant}")


# -- audit ---------------------------------------------------------------------


def audit(
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant.")] = None,
    since: Annotated[
        str | None, typer.Option("--since", help="ISO 8601 (UTC if no zone), today, or -1h/7d.")
    ] = None,
    until: Annotated[str | None, typer.Option("--until", help="As --since; exclusive.")] = None,
    fmt: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.csv,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """Print the audit log: one row per request, oldest first."""
    with _clear_errors():
        now = time.time()
        start = parse_time(since, now) if since is not None else None
        end = parse_time(until, now) if until is not None else None
        with _audit_log(data_dir) as log:
            records = log.query(tenant=tenant, since=start, until=end)
    header = ("time", *COLUMNS[1:])
    rows = [(iso_time(r.ts), *(getattr(r, c) for c in COLUMNS[1:])) for r in records]
    _print_table(header, rows, fmt)


_USAGE_HEADER = (
    "tenant",
    "model",
    "requests",
    "units",
    "errors",
    "device_seconds",
    "gb_seconds",
)


@tenants_app.command("usage")
def tenants_usage(
    since: Annotated[
        str | None,
        typer.Option("--since", help="ISO 8601 (UTC if no zone), today, or -1h/7d; default today."),
    ] = None,
    until: Annotated[str | None, typer.Option("--until", help="As --since; exclusive.")] = None,
    fmt: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.csv,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """What each tenant used, per model: requests, units, device-seconds and
    GB-seconds of memory (tenant empty: memory held with no use), for billing."""
    with _clear_errors():
        now = time.time()
        start = parse_time(since, now) if since is not None else start_of_day_utc(now)
        end = parse_time(until, now) if until is not None else None
        with _audit_log(data_dir) as log:
            usage = log.usage(start, end)
    rows = [
        (
            u["tenant"] or "",
            u["model"] or "",
            u["requests"],
            round(float(u["units"]), 6),
            u["errors"],
            round(float(u["device_s"]), 6),
            round(float(u["byte_s"]) / 1e9, 6),
        )
        for u in usage
    ]
    _print_table(_USAGE_HEADER, rows, fmt)


@contextlib.contextmanager
def _audit_log(data_dir: Path) -> Iterator[AuditLog]:
    url = os.environ.get(STORE_ENV)
    if url is None and not (data_dir / AUDIT_DB_FILE).exists():
        raise InvalidTenantError(f"no audit log in {data_dir} (is --data-dir right?)")
    log = AuditLog(data_dir, url=url, retention_days=None)
    try:
        yield log
    finally:
        log.close_sync()


def _print_table(header: Sequence[str], rows: Sequence[Sequence[Any]], fmt: Format) -> None:
    if fmt is Format.json:
        objects = [json.dumps(dict(zip(header, row, strict=True))) for row in rows]
        typer.echo("[\n" + ",\n".join(objects) + "\n]" if objects else "[]")
    else:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)


# -- output --------------------------------------------------------------------

_TENANT_HEADER = (
    "name",
    "tier",
    "qps",
    "burst",
    "max_concurrency",
    "daily_units",
    "models",
    "created",
)
_KEY_HEADER = ("prefix", "tenant", "admin", "created", "revoked")


def _tenant_cells(t: Tenant) -> tuple[str, ...]:
    models = "all" if t.models is None else ",".join(t.models) or "(none)"
    return (
        t.name,
        t.tier,
        _num(t.qps),
        _num(t.burst),
        _num(t.max_concurrency),
        _num(t.daily_units),
        models,
        iso_time(t.created_at),
    )


def _key_cells(k: ApiKey) -> tuple[str, ...]:
    revoked = iso_time(k.revoked_at) if k.revoked_at is not None else "-"
    return (k.prefix, k.tenant, "yes" if k.admin else "no", iso_time(k.created_at), revoked)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _models(text: str) -> list[str] | None:
    if text.strip().lower() in ("all", "*"):
        return None
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise typer.BadParameter("give model names a,b or 'all'", param_hint="--models")
    return names


def _print_rows(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(*header)
        for row in rows:
            table.add_row(*row)
        Console().print(table)
        return
    typer.echo("\t".join(header))
    for row in rows:
        typer.echo("\t".join(row))
