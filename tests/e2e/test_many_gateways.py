"""Two real gateways (``tessera serve`` processes over fake models) sharing one
PostgreSQL database and one Redis: a key made through one gateway's admin API
works on the other at once, a tenant's rate holds across both together, and
both gateways' audit rows land in the one table."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from builders import write_fake_repository
from serverproc import Server, start_server, stop_server
from services import postgres_schema, redis_prefix, redis_url
from tessera.tenants import AuditLog, TenantStore
from tessera.tenants.store import load_secret

BURST = 5


@dataclass(frozen=True)
class Cluster:
    gateways: list[Server]
    admin_key: str
    acme_key: str
    tenant_store: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("gateways")
    secret_file = tmp / "shared-secret.key"
    repo = write_fake_repository(tmp / "repo", {"echo": {"task": "embedding"}})
    with postgres_schema() as url, redis_prefix() as prefix:
        with TenantStore(tmp / "setup", url=url, secret=load_secret(secret_file)) as store:
            store.add_tenant("ops")
            admin_key = store.create_key("ops", admin=True).key
            # One token every 100 s: the count of a burst is exact.
            store.add_tenant("acme", qps=0.01, burst=BURST)
            acme_key = store.create_key("acme").key
        config = tmp / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "include_default_models": False,
                    "model_repositories": [str(repo)],
                    "tenant_store": url,
                    "key_secret_file": str(secret_file),
                    "admission_store": redis_url(),
                    "admission_prefix": prefix,
                    "admission_lease_s": 5,
                }
            )
        )
        processes = []
        gateways = []
        try:
            for name in ("a", "b"):
                folder = tmp / name
                folder.mkdir()
                process, server = start_server(
                    folder, "--config", str(config), "--threads", "1", key=admin_key
                )
                processes.append(process)
                gateways.append(server)
            yield Cluster(gateways, admin_key, acme_key, url)
        finally:
            for process in processes:
                stop_server(process)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def embed(server: Server, key: str, request_id: str) -> int:
    r = httpx.post(
        f"{server.base_url}/v1/embeddings",
        json={"model": "echo", "input": ["hello"]},
        headers={**bearer(key), "x-request-id": request_id},
        timeout=30,
    )
    return r.status_code


def test_a_key_made_on_one_gateway_works_on_the_other_at_once(cluster: Cluster) -> None:
    a, b = cluster.gateways
    admin = bearer(cluster.admin_key)
    r = httpx.post(f"{a.base_url}/admin/tenants", json={"name": "beta"}, headers=admin)
    assert r.status_code == 201, r.text
    r = httpx.post(f"{a.base_url}/admin/keys", json={"tenant": "beta"}, headers=admin)
    assert r.status_code == 201, r.text
    key, prefix = r.json()["key"], r.json()["prefix"]
    assert embed(b, key, "beta-1") == 200
    r = httpx.delete(f"{b.base_url}/admin/keys/{prefix}", headers=admin)
    assert r.status_code == 200, r.text
    assert embed(a, key, "beta-2") == 401


def test_a_burst_split_over_both_gateways_gets_the_buckets_worth(cluster: Cluster) -> None:
    gateways = cluster.gateways
    total = 3 * BURST
    with ThreadPoolExecutor(max_workers=6) as pool:
        statuses = list(
            pool.map(lambda i: embed(gateways[i % 2], cluster.acme_key, f"acme-{i}"), range(total))
        )
    # A bucket each would have let 2 x BURST through: the limit is the pair's.
    assert sorted(statuses) == [200] * BURST + [429] * (total - BURST)


def test_both_gateways_audit_into_the_one_table(cluster: Cluster, tmp_path: Path) -> None:
    a, b = cluster.gateways
    for i in range(3):
        assert embed(a, cluster.admin_key, f"ops-a-{i}") == 200
        assert embed(b, cluster.admin_key, f"ops-b-{i}") == 200
    log = AuditLog(tmp_path, url=cluster.tenant_store, retention_days=None)
    try:
        ids: set[str] = set()
        # The gateways write their rows every 0.5 s; wait for both, counting rows.
        for _ in range(100):
            ids = {r.request_id or "" for r in log.query(tenant="ops")}
            if {f"ops-{g}-{i}" for g in "ab" for i in range(3)} <= ids:
                break
            time.sleep(0.1)
        assert {f"ops-{g}-{i}" for g in "ab" for i in range(3)} <= ids
    finally:
        log.close_sync()
