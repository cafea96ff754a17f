"""``tessera tenants``, ``keys`` and ``audit`` through typer's CliRunner."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tessera.tenants import AuditLog, TenantStore
from tessera.tenants.audit import AuditRecord, MemoryRecord
from tessera.tenants.cli import register

T0 = 1_700_000_000.0


def make_app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """tessera (test)."""

    register(app)
    return app


APP = make_app()


class Cli:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.runner = CliRunner()

    def __call__(self, *args: str, code: int = 0) -> str:
        result = self.runner.invoke(APP, [*args, "--data-dir", str(self.data_dir)])
        assert result.exit_code == code, (result.stdout, result.stderr, result.exception)
        if code == 2:
            assert "Traceback" not in result.output
            return result.stderr
        return result.stdout


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return Cli(tmp_path / "data")


def _rows(output: str) -> list[dict[str, str]]:
    header, *lines = output.strip().split("\n")
    return [dict(zip(header.split("\t"), line.split("\t"), strict=True)) for line in lines]


def test_add_list_show_update_remove(cli: Cli) -> None:
    out = cli(
        "tenants",
        "add",
        "acme",
        "--tier",
        "vip",
        "--qps",
        "2",
        "--burst",
        "3",
        "--models",
        "embed,rerank",
    )
    assert "acme" in out
    cli("tenants", "add", "beta", "--max-concurrency", "4", "--daily-units", "1000")
    rows = _rows(cli("tenants", "list"))
    assert [(r["name"], r["tier"], r["qps"], r["burst"], r["models"]) for r in rows] == [
        ("acme", "vip", "2", "3", "embed,rerank"),
        ("beta", "standard", "-", "-", "all"),
    ]
    assert (rows[1]["max_concurrency"], rows[1]["daily_units"]) == ("4", "1000")

    show = {r["field"]: r["value"] for r in _rows(cli("tenants", "show", "acme"))}
    assert (show["tier"], show["qps"], show["keys"]) == ("vip", "2", "-")

    cli("tenants", "update", "acme", "--tier", "batch", "--unset", "qps", "--models", "all")
    cli("tenants", "update", "beta", "--unset", "max-concurrency", "--unset", "daily_units")
    with TenantStore(cli.data_dir) as store:
        acme = store.get_tenant("acme")
        beta = store.get_tenant("beta")
    assert (acme.tier, acme.qps, acme.burst, acme.models) == ("batch", None, 3, None)
    assert (beta.max_concurrency, beta.daily_units) == (None, None)

    assert "removed" in cli("tenants", "remove", "acme")
    assert [r["name"] for r in _rows(cli("tenants", "list"))] == ["beta"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tenants", "add", "acme"], "exists"),
        (["tenants", "add", "bad name"], "bad tenant name"),
        (["tenants", "add", "x", "--tier", "Gold"], "bad tier"),
        (["tenants", "add", "x", "--qps", "-1"], "qps"),
        (["tenants", "show", "nope"], "not found"),
        (["tenants", "update", "acme"], "nothing to change"),
        (["tenants", "update", "acme", "--unset", "tier"], "cannot unset"),
        (["tenants", "update", "acme", "--qps", "1", "--unset", "qps"], "both"),
        (["tenants", "remove", "nope"], "not found"),
        (["keys", "create", "nope"], "not found"),
        (["keys", "list", "--tenant", "nope"], "not found"),
        (["keys", "revoke", "tsk_zzzzzzzz"], "not found"),
        (["audit", "--since", "yesterday-ish"], "bad time"),
    ],
)
def test_errors_exit_2_with_a_message(cli: Cli, args: list[str], message: str) -> None:
    cli("tenants", "add", "acme")
    assert message in cli(*args, code=2)


def test_audit_without_a_log_is_an_error(cli: Cli) -> None:
    assert "no audit log" in cli("audit", code=2)


def test_keys_create_prints_the_key_last(cli: Cli) -> None:
    cli("tenants", "add", "acme")
    out = cli("keys", "create", "acme", "--admin")
    key = out.split()[-1]
    admin_out = cli("keys", "create", "acme")
    plain_key = admin_out.split()[-1]
    with TenantStore(cli.data_dir) as store:
        principal = store.authenticate(key)
        assert principal is not None
        assert (principal.tenant.name, principal.admin) == ("acme", True)
        plain = store.authenticate(plain_key)
        assert plain is not None
        assert not plain.admin

    rows = _rows(cli("keys", "list"))
    assert [r["admin"] for r in rows] == ["yes", "no"]
    assert all(r["revoked"] == "-" for r in rows)
    listing = cli("keys", "list", "--tenant", "acme")
    assert key not in listing
    assert key.split("_", 2)[2] not in listing
    assert rows[0]["prefix"] in cli("tenants", "show", "acme")

    assert "revoked" in cli("keys", "revoke", rows[0]["prefix"])
    with TenantStore(cli.data_dir) as store:
        assert store.authenticate(key) is None
        assert store.authenticate(plain_key) is not None
    assert _rows(cli("keys", "list"))[0]["revoked"] != "-"


def _seed_audit(data_dir: Path) -> None:
    audit = AuditLog(data_dir, retention_days=None)
    for i, tenant in enumerate(["a", "b", "a", None]):
        audit.record(
            AuditRecord(
                ts=T0 + 3600 * i,
                tenant=tenant,
                key_prefix=None if tenant is None else f"tsk_{tenant * 8}",
                model="embed",
                task="embedding",
                units=float(i),
                status=200 if tenant else 401,
                queue_s=0.0,
                total_s=0.5,
                batch_size=None,
                request_id=f"r{i}",
                reason=None if tenant else "no key",
            )
        )
    audit.close_sync()


def test_audit_csv(cli: Cli) -> None:
    _seed_audit(cli.data_dir)
    out = cli("audit")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["request_id"] for r in rows] == ["r0", "r1", "r2", "r3"]
    assert rows[0]["time"] == "2023-11-14T22:13:20.000Z"
    assert (rows[3]["tenant"], rows[3]["status"], rows[3]["reason"]) == ("", "401", "no key")
    out = cli("audit", "--tenant", "a", "--format", "csv")
    assert [r["request_id"] for r in csv.DictReader(io.StringIO(out))] == ["r0", "r2"]


def test_audit_json_with_a_window(cli: Cli) -> None:
    _seed_audit(cli.data_dir)
    out = cli(
        "audit",
        "--format",
        "json",
        "--since",
        "2023-11-14T23:13:20Z",
        "--until",
        "2023-11-15T01:13:20",
    )
    rows = json.loads(out)
    assert [r["request_id"] for r in rows] == ["r1", "r2"]
    assert rows[0]["tenant"] == "b"
    assert rows[0]["units"] == 1.0
    assert set(rows[0]) == {
        "time",
        "tenant",
        "key_prefix",
        "model",
        "task",
        "units",
        "status",
        "queue_s",
        "total_s",
        "batch_size",
        "request_id",
        "reason",
        "action",
        "device_s",
    }
    assert json.loads(cli("audit", "--format", "json", "--tenant", "nobody")) == []


def test_tenants_usage_csv_for_billing(cli: Cli) -> None:
    audit = AuditLog(cli.data_dir, retention_days=None)
    for i, (tenant, device_s) in enumerate([("a", 0.25), ("b", 0.5), ("a", 0.75)]):
        audit.record(
            AuditRecord(
                ts=T0 + i,
                tenant=tenant,
                key_prefix=None,
                model="embed",
                task="embedding",
                units=2.0,
                status=200,
                queue_s=0.0,
                total_s=0.1,
                device_s=device_s,
            )
        )
    audit.record(MemoryRecord(T0 + 1, tenant="a", model="embed", byte_s=1.5e9))
    audit.record(MemoryRecord(T0 + 2, tenant="", model="embed", byte_s=0.5e9))
    audit.close_sync()
    out = cli("tenants", "usage", "--since", "2023-11-14T22:13:20Z")
    assert out.splitlines()[0] == ("tenant,model,requests,units,errors,device_seconds,gb_seconds")
    rows = {r["tenant"]: r for r in csv.DictReader(io.StringIO(out))}
    assert set(rows) == {"", "a", "b"}
    assert (rows["a"]["requests"], rows["a"]["units"]) == ("2", "4.0")
    assert float(rows["a"]["device_seconds"]) == pytest.approx(1.0)
    assert float(rows["a"]["gb_seconds"]) == pytest.approx(1.5)
    assert float(rows[""]["gb_seconds"]) == pytest.approx(0.5)
    assert rows[""]["requests"] == "0"
    later = json.loads(
        cli("tenants", "usage", "--since", "2023-11-14T22:13:21Z", "--format", "json")
    )
    assert {r["tenant"] for r in later} == {"", "a", "b"}
    assert sum(r["device_seconds"] for r in later) == pytest.approx(1.25)


def test_the_commands_reach_a_shared_database_through_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services import postgres_schema

    secret_file = tmp_path / "shared.key"
    with postgres_schema() as url:
        monkeypatch.setenv("TESSERA_TENANT_STORE", url)
        monkeypatch.setenv("TESSERA_KEY_SECRET_FILE", str(secret_file))
        Cli(tmp_path / "ops-laptop")("tenants", "add", "acme", "--qps", "3")
        key = Cli(tmp_path / "ops-laptop")("keys", "create", "acme").split()[-1]
        log = AuditLog(tmp_path / "gateway", url=url, retention_days=None)
        log.record(AuditRecord(T0, "acme", None, "m", "embedding", 4.0, 200, 0.0, 0.1))
        log.close_sync()
        secret = secret_file.read_text().strip()
        # A gateway elsewhere, with the same database and secret, sees both.
        with TenantStore(tmp_path / "gateway", url=url, secret=bytes.fromhex(secret)) as store:
            principal = store.authenticate(key)
            assert principal is not None
            assert principal.tenant.qps == 3.0
        out = Cli(tmp_path / "elsewhere")("audit", "--format", "json")
        assert [row["units"] for row in json.loads(out)] == [4.0]
