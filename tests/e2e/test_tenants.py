"""Acceptance for tenants: a real server process over fake models, real HTTP,
real SQLite. Keys, permissions, limits, queue bounds and the audit log."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml

from builders import write_fake_repository
from serverproc import Server, free_port, start_server, stop_server
from tessera.tenants import TenantStore

METRICS_PORT = free_port()
MODELS = {
    "echo": {"task": "embedding", "options": {"own_bytes": 1000}},
    "slow": {
        "task": "embedding",
        "options": {"own_bytes": 1000, "run_s": 0.5},
        "batching": {"max_batch_size": 1, "max_wait_ms": 0, "max_concurrent_batches": 1},
    },
    "secret-model": {"task": "embedding", "options": {"own_bytes": 1000}},
}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    data_dir = tmp_path_factory.getbasetemp() / "tenants-data"
    with TenantStore(data_dir) as store:
        store.add_tenant("ops", tier="standard")
        store.add_tenant("acme", tier="standard", models=("echo", "slow"))
        store.add_tenant("limited", tier="batch", qps=2, burst=2, models=("echo",))
        return {
            "admin": store.create_key("ops", admin=True).key,
            "acme": store.create_key("acme").key,
            "limited": store.create_key("limited").key,
        }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, keys: dict[str, str]) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("tenants")
    repo = write_fake_repository(tmp / "repo", MODELS)
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "include_default_models": False,
                "model_repositories": [str(repo)],
                "max_queue": 3,
                "preload": ["echo"],
                "metrics_port": METRICS_PORT,
            }
        )
    )
    data_dir = tmp_path_factory.getbasetemp() / "tenants-data"
    process, server = start_server(
        tmp, "--config", str(config), "--data-dir", str(data_dir), key=keys["acme"]
    )
    try:
        yield server
    finally:
        stop_server(process)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def embed(server: Server, key: str | None, model: str = "echo") -> httpx.Response:
    headers = bearer(key) if key else {}
    return httpx.post(
        f"{server.base_url}/v1/embeddings",
        json={"model": model, "input": "hello"},
        headers=headers,
        timeout=30,
    )


def test_missing_and_wrong_keys_are_401(server: Server) -> None:
    assert embed(server, None).status_code == 401
    assert embed(server, "tsk_nothere_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx").status_code == 401
    assert embed(server, "garbage").status_code == 401
    r = httpx.post(
        f"{server.base_url}/v1/embeddings",
        json={"model": "echo", "input": "x"},
        headers={"x-api-key": server.key or ""},
    )
    assert r.status_code == 200
    assert httpx.get(f"{server.base_url}/v2/health/live").status_code == 200


def test_model_outside_tenant_list_is_404_and_hidden(server: Server, keys: dict[str, str]) -> None:
    r = embed(server, keys["acme"], model="secret-model")
    assert r.status_code == 404
    assert "secret-model" in r.json()["error"]["message"]
    listed = httpx.get(f"{server.base_url}/v1/models", headers=bearer(keys["acme"])).json()
    assert {m["id"] for m in listed["data"]} == {"echo", "slow"}
    r = httpx.get(f"{server.base_url}/v2/models/secret-model", headers=bearer(keys["acme"]))
    assert r.status_code == 404


def test_admin_routes_need_an_admin_key(server: Server, keys: dict[str, str]) -> None:
    assert (
        httpx.get(f"{server.base_url}/admin/tenants", headers=bearer(keys["acme"])).status_code
        == 403
    )
    r = httpx.get(f"{server.base_url}/admin/tenants", headers=bearer(keys["admin"]))
    assert r.status_code == 200
    assert {"ops", "acme", "limited"} <= {t["name"] for t in r.json()["tenants"]}


def test_revoked_key_is_refused_within_a_second(server: Server, keys: dict[str, str]) -> None:
    created = httpx.post(
        f"{server.base_url}/admin/keys", json={"tenant": "acme"}, headers=bearer(keys["admin"])
    ).json()
    key = created["key"]
    assert embed(server, key).status_code == 200
    r = httpx.delete(
        f"{server.base_url}/admin/keys/{created['prefix']}", headers=bearer(keys["admin"])
    )
    assert r.status_code == 200
    revoked_at = time.monotonic()
    status = embed(server, key).status_code
    while status != 401 and time.monotonic() - revoked_at < 1.0:
        status = embed(server, key).status_code
    assert status == 401


def test_a_key_revoked_by_the_cli_while_serving_is_refused_at_once(
    server: Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The operator's path: ``tessera keys revoke`` is another process on the
    server's SQLite file. (Opening a second descriptor of the file in the server
    once dropped its connections' locks, so this process's exit deleted the WAL
    under the server, which read a stale snapshot from then on.)"""
    data_dir = tmp_path_factory.getbasetemp() / "tenants-data"
    with TenantStore(data_dir) as store:
        fresh = store.create_key("acme")
    assert embed(server, fresh.key).status_code == 200
    subprocess.run(
        [sys.executable, "-m", "tessera", "keys", "revoke", fresh.info.prefix,
         "--data-dir", str(data_dir)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    assert embed(server, fresh.key).status_code == 401


async def burst(server: Server, key: str, model: str, count: int) -> list[httpx.Response]:
    """``count`` simultaneous one-sentence requests from one tenant."""
    async with httpx.AsyncClient(
        base_url=server.base_url, headers=bearer(key), timeout=30
    ) as client:
        return await asyncio.gather(
            *(
                client.post("/v1/embeddings", json={"model": model, "input": f"t{i}"})
                for i in range(count)
            )
        )


async def test_burst_over_qps_gets_429_with_retry_after(
    server: Server, keys: dict[str, str]
) -> None:
    responses = await burst(server, keys["limited"], "echo", 12)
    refused = [r for r in responses if r.status_code == 429]
    assert len(refused) >= 8
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert refused[0].headers["x-ratelimit-limit"] == "2"
    assert "x-ratelimit-remaining" in refused[0].headers
    assert "rate" in refused[0].json()["error"]["message"]


async def test_full_model_queue_is_503_with_retry_after(
    server: Server, keys: dict[str, str]
) -> None:
    responses = await burst(server, keys["acme"], "slow", 8)
    statuses = [r.status_code for r in responses]
    assert 503 in statuses
    assert 200 in statuses
    full = next(r for r in responses if r.status_code == 503)
    assert int(full.headers["retry-after"]) >= 1


def test_sqlite_holds_no_plaintext_key(
    keys: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    data_dir = tmp_path_factory.getbasetemp() / "tenants-data"
    blobs = b"".join(p.read_bytes() for p in data_dir.iterdir() if p.is_file())
    for key in keys.values():
        # tsk_<prefix>_<secret>; the secret is URL-safe base64 and may hold "_" itself.
        secret = key.split("_", 2)[2]
        assert key.encode() not in blobs
        assert secret.encode() not in blobs


def test_audit_rows_for_every_request_including_refused(
    server: Server, keys: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Every row this test checks comes from a request it made itself, found by
    # its request id: rows other tests left behind prove nothing here.
    marker = "audit-check"
    requests = {
        marker: ({"model": "echo"}, bearer(keys["acme"])),
        marker + "-401": ({"model": "echo"}, {}),
        marker + "-404": ({"model": "secret-model"}, bearer(keys["acme"])),
    }
    for request_id, (body, headers) in requests.items():
        r = httpx.post(
            f"{server.base_url}/v1/embeddings",
            json={**body, "input": "x"},
            headers={**headers, "x-request-id": request_id},
        )
        assert r.headers["x-request-id"] == request_id
    data_dir = tmp_path_factory.getbasetemp() / "tenants-data"
    deadline = time.monotonic() + 5
    rows: list[tuple[object, ...]] = []
    while time.monotonic() < deadline:
        with sqlite3.connect(data_dir / "audit.db") as conn:
            rows = conn.execute(
                "SELECT request_id, tenant, status, model FROM audit WHERE request_id LIKE ?",
                (marker + "%",),
            ).fetchall()
        if len(rows) == len(requests):
            break
        time.sleep(0.2)
    by_id = {row[0]: row[1:] for row in rows}
    assert by_id == {
        marker: ("acme", 200, "echo"),
        marker + "-401": (None, 401, None),
        marker + "-404": ("acme", 404, "secret-model"),
    }


async def test_requests_of_callers_that_hang_up_are_dropped_before_running(
    server: Server, keys: dict[str, str]
) -> None:
    admin = bearer(keys["admin"])

    def slow_stats() -> dict[str, int]:
        stats = httpx.get(f"{server.base_url}/admin/batches", headers=admin).json()
        return dict(next(m for m in stats["models"] if m["name"] == "slow"))

    before = slow_stats()
    async with httpx.AsyncClient(base_url=server.base_url, headers=bearer(keys["acme"])) as client:
        # One request keeps "slow" busy for 0.5 s; three more give up after 0.1 s.
        running = asyncio.ensure_future(
            client.post("/v1/embeddings", json={"model": "slow", "input": "kept"}, timeout=30)
        )
        await asyncio.sleep(0.05)
        for i in range(3):
            with pytest.raises(httpx.TimeoutException):
                await client.post(
                    "/v1/embeddings", json={"model": "slow", "input": f"gone{i}"}, timeout=0.1
                )
        assert (await running).status_code == 200
    await asyncio.sleep(1.0)  # time for a wrongly kept request to have run
    after = slow_stats()
    assert after["num_batches"] - before["num_batches"] == 1
    assert after["num_dropped"] - before["num_dropped"] == 3


def test_metrics_port_serves_metrics_without_a_key(server: Server, keys: dict[str, str]) -> None:
    embed(server, keys["acme"])
    assert httpx.get(f"{server.base_url}/metrics").status_code == 401
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    assert "tessera_memory_budget_bytes" in text
    assert 'tessera_requests_total{model="echo"' in text
