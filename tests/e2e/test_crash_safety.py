"""Crash safety: a real server process under load from real clients is killed
with SIGKILL; its SQLite files pass ``PRAGMA integrity_check``, the audit holds
every answered request but those of the last flush interval, and a server
restarted on the same folder has its tenants and keys, the same usage, and a
daily quota that counts every unit the audit holds."""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from builders import write_fake_repository
from serverproc import Server, start_server, stop_server
from tessera.tenants import TenantStore

NUM_CLIENTS = 4
LOAD_S = 3.0
# The audit is flushed every 0.5 s (AuditLog.flush_interval_s): a crash loses the
# rows of the last interval at most. The check allows 2 s, for a loaded machine
# whose event loop or writer thread may lag the pace a little.
SLACK_S = 2.0


@dataclass
class Answers:
    """What the clients saw: request id -> when its answer arrived."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    at: dict[str, float] = field(default_factory=dict)


def load(server: Server, key: str, answers: Answers, stop: threading.Event) -> None:
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        while not stop.is_set():
            request_id = f"crash-{uuid.uuid4().hex}"
            try:
                r = client.post(
                    "/v1/embeddings",
                    json={"model": "echo", "input": f"hello {request_id}"},
                    headers={"Authorization": f"Bearer {key}", "x-request-id": request_id},
                )
            except httpx.HTTPError:
                return  # the server is gone
            if r.status_code == 200:
                with answers.lock:
                    answers.at[request_id] = time.monotonic()


def test_kill_9_under_load_loses_at_most_the_last_flush(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with TenantStore(data_dir) as store:
        store.add_tenant("ops")
        store.add_tenant("loadgen", daily_units=10**9)
        admin_key = store.create_key("ops", admin=True).key
        key = store.create_key("loadgen").key
    repo = write_fake_repository(tmp_path / "repo", {"echo": {"task": "embedding"}})
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "include_default_models": False,
                "model_repositories": [str(repo)],
                "preload": ["echo"],
            }
        )
    )
    args = ("--config", str(config), "--data-dir", str(data_dir))
    process, server = start_server(tmp_path, *args, key=key)
    answers, stop = Answers(), threading.Event()
    clients = [
        threading.Thread(target=load, args=(server, key, answers, stop)) for _ in range(NUM_CLIENTS)
    ]
    try:
        for client in clients:
            client.start()
        time.sleep(LOAD_S)
        process.kill()  # SIGKILL, mid-load
        killed_at = time.monotonic()
        process.wait(timeout=10)
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=30)
        if process.poll() is None:
            stop_server(process)
    assert len(answers.at) > 50, "the load did not get going"

    for name in ("tessera.db", "audit.db"):
        with sqlite3.connect(data_dir / name) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)], name
    with sqlite3.connect(data_dir / "audit.db") as conn:
        audited = {
            request_id: (status, units)
            for request_id, status, units in conn.execute(
                "SELECT request_id, status, units FROM audit WHERE request_id LIKE 'crash-%'"
            )
        }
        (units_audited,) = conn.execute(
            "SELECT TOTAL(units) FROM audit WHERE tenant = 'loadgen'"
        ).fetchone()
    lost = [rid for rid in answers.at if rid not in audited]
    lost_early = [rid for rid in lost if answers.at[rid] < killed_at - SLACK_S]
    oldest_lost_s = max((killed_at - answers.at[rid] for rid in lost), default=0.0)
    print(
        f"{len(answers.at)} answered, {len(lost)} not in the audit,"
        f" the oldest answered {oldest_lost_s:.2f} s before the kill"
    )
    assert lost_early == []
    assert all(audited[rid][0] == 200 for rid in answers.at if rid in audited)

    process, server = start_server(tmp_path, *args, key=key)
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            # The key still works, and the tenants are there.
            r = client.post(
                "/v1/embeddings",
                json={"model": "echo", "input": "after"},
                headers=server.headers,
            )
            assert r.status_code == 200
            admin = {"Authorization": f"Bearer {admin_key}"}
            tenants = client.get("/admin/tenants", headers=admin).json()["tenants"]
            assert {t["name"] for t in tenants} == {"ops", "loadgen"}
            after_units = r.json()["usage"]["prompt_tokens"]
            # The quota counts every unit the audit held at the kill: a limit one
            # unit above them (and the request just made) refuses the next request.
            limit = units_audited + after_units + 1
            r = client.patch("/admin/tenants/loadgen", json={"daily_units": limit}, headers=admin)
            assert r.status_code == 200
            r = client.post(
                "/v1/embeddings",
                json={"model": "echo", "input": "one more request"},
                headers=server.headers,
            )
            assert r.status_code == 429
            assert f"({units_audited + after_units:g} used" in r.json()["error"]["message"]
            # The usage endpoint agrees with the audit (once the new row is written).
            deadline = time.monotonic() + 10
            expected = units_audited + after_units
            usage_units = None
            while time.monotonic() < deadline and usage_units != expected:
                usage = client.get("/admin/usage", headers=admin).json()["usage"]
                usage_units = sum(row["units"] for row in usage if row["tenant"] == "loadgen")
                time.sleep(0.2)
            assert usage_units == expected
    finally:
        stop_server(process)
