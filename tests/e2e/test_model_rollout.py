"""Acceptance for the model lifecycle on a real server and a real model: a new
version of MiniLM (``normalize: false``, so its embeddings' norms tell it apart)
rolled out under load from several tenants with ``tessera models add``, then a
broken one rolled back, then a model registered over the admin API, used at
once with the openai client and retired. Zero failed requests throughout."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import yaml

from builders import write_fake_repository
from serverproc import Server, start_server, stop_server
from tessera.repository import default_repository_path
from tessera.tenants import TenantStore

TENANTS = ("north", "south", "east")


def minilm_card(name: str, packaged: str = "all-minilm-l6-v2") -> dict[str, object]:
    card = yaml.safe_load((default_repository_path() / packaged / "model.yaml").read_text())
    card["name"] = name
    card["preload"] = False
    return card


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Server, dict[str, str]]]:
    repo = tmp_path / "repo"
    (repo / "minilm" / "1").mkdir(parents=True)
    (repo / "minilm" / "model.yaml").write_text(yaml.safe_dump(minilm_card("minilm")))
    data = tmp_path / "data"
    with TenantStore(data) as store:
        keys = {"ops": ""}
        store.add_tenant("ops")
        keys["ops"] = store.create_key("ops", admin=True).key
        for name in TENANTS:
            store.add_tenant(name)
            keys[name] = store.create_key(name).key
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model_repositories": [str(repo)],
                "include_default_models": False,
                "preload": ["minilm"],
                "memory_budget": "2GiB",
            }
        )
    )
    process, srv = start_server(tmp_path, "--config", str(config), key=keys["ops"])
    try:
        yield process, srv, keys
    finally:
        stop_server(process)


class Load:
    """Threads of each tenant sending embeddings; each answer's version and norm."""

    def __init__(self, server: Server, keys: dict[str, str]) -> None:
        self.answers: list[tuple[str, float]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(server, keys[t], t)) for t in TENANTS
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, server: Server, key: str, tenant: str) -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                response = client.post(
                    "/v1/embeddings",
                    json={"model": "minilm", "input": f"{tenant} sentence {n}"},
                    headers={"Authorization": f"Bearer {key}"},
                )
                if response.status_code != 200:
                    self.failures.append(f"{response.status_code} {response.text}")
                    continue
                norm = float(np.linalg.norm(response.json()["data"][0]["embedding"]))
                self.answers.append((response.headers["x-model-version"], norm))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def models_add(server: Server, folder: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tessera", "models", "add", str(folder)]
    command += ["--url", server.base_url, "--key", str(server.key)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def test_a_new_version_rolls_out_and_a_broken_one_rolls_back_under_load(
    server: tuple[subprocess.Popen[bytes], Server, dict[str, str]], tmp_path: Path
) -> None:
    process, srv, keys = server
    model = tmp_path / "repo" / "minilm"
    load = Load(srv, keys)
    try:
        (model / "2").mkdir()
        (model / "2" / "model.yaml").write_text(yaml.safe_dump({"options": {"normalize": False}}))
        added = models_add(srv, model)
        assert added.returncode == 0, added.stderr
        # A broken version: its weights are missing. Rolled back; version 2 serves on.
        (model / "3").mkdir()
        (model / "3" / "model.yaml").write_text(
            yaml.safe_dump({"source": {"path": str(tmp_path / "missing")}})
        )
        broken = models_add(srv, model)
        assert broken.returncode == 1
        assert "rollout_failed" in broken.stderr
    finally:
        load.stop()
    residency = httpx.get(f"{srv.base_url}/admin/residency", headers=srv.headers).json()
    stop_server(process)

    assert load.failures == []
    versions = {version for version, _ in load.answers}
    assert versions == {"1", "2"}
    for version, norm in load.answers:  # each answer from the one version it names
        assert (norm == pytest.approx(1.0, abs=1e-4)) == (version == "1"), (version, norm)
    done, rolled_back = residency["rollouts"][-2:]
    assert (done["version"], done["state"]) == ("2", "done")
    # Version 2 (another option over the same encoder files) added no bytes beside 1.
    assert done["used_bytes_peak"] == done["used_bytes_before"] > 0
    assert (rolled_back["version"], rolled_back["state"]) == ("3", "rolled_back")
    assert "weights not found" in rolled_back["error"]
    assert [m["name"] for m in residency["models"]] == ["minilm@2"]
    # In the order the server answered (its audit log), one switch from 1 to 2.
    with sqlite3.connect(tmp_path / "data" / "audit.db") as db:
        served = [
            row[0]
            for row in db.execute("SELECT model FROM audit WHERE model LIKE 'minilm@%' ORDER BY id")
        ]
    first_new = served.index("minilm@2")
    assert set(served[:first_new]) == {"minilm@1"}
    assert set(served[first_new:]) == {"minilm@2"}


def test_a_model_registered_over_the_admin_api_serves_at_once_and_gives_its_bytes_back(
    server: tuple[subprocess.Popen[bytes], Server, dict[str, str]],
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    _, srv, _ = server
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=str(srv.key))
    request.addfinalizer(client.close)
    with httpx.Client(base_url=srv.base_url, headers=srv.headers, timeout=300) as admin:
        before = admin.get("/admin/residency").json()["used_bytes"]
        # A copy of minilm's card: its encoder files are minilm@1's, held once.
        shared = register(admin, tmp_path, "all-minilm-l6-v2", "minilm-copy")
        assert len(client.embeddings.create(model="minilm-copy", input="hi").data) == 1
        assert admin.get("/admin/residency").json()["used_bytes"] == before
        # The int8 ONNX MiniLM holds weights of its own.
        register(admin, tmp_path, "all-minilm-l6-v2-int8", "minilm-int8")
        answer = client.embeddings.create(model="minilm-int8", input="registered a moment ago")
        assert len(answer.data[0].embedding) == 384
        during = admin.get("/admin/residency").json()["used_bytes"]
        removed = admin.delete("/admin/models/minilm-int8")
        assert removed.status_code == 200
        after = admin.get("/admin/residency").json()["used_bytes"]
        assert shared.status_code == 201
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="minilm-int8", input="retired")
    assert during > before
    assert after == before
    assert removed.json()["freed_bytes"] == during - before


def register(admin: httpx.Client, tmp_path: Path, packaged: str, name: str) -> httpx.Response:
    folder = tmp_path / "repo" / name  # registered only from the server's repositories
    folder.mkdir(parents=True)
    (folder / "model.yaml").write_text(yaml.safe_dump(minilm_card(name, packaged)))
    response = admin.post("/admin/models", json={"path": str(folder)})
    assert response.status_code == 201, response.text
    return response


def test_a_watched_repository_serves_a_version_folder_moved_in(tmp_path: Path) -> None:
    """``watch_repository: true`` in the config file: a real server rolls out a
    version folder moved into its repository, with no call to it."""
    repo = write_fake_repository(tmp_path / "repo", {"ver": {"task": "embedding"}})
    (repo / "ver" / "1").mkdir()
    with TenantStore(tmp_path / "data") as store:
        store.add_tenant("ops")
        key = store.create_key("ops", admin=True).key
    config = tmp_path / "config.yaml"
    settings = {"model_repositories": [str(repo)], "include_default_models": False}
    settings |= {"watch_repository": True, "watch_interval_s": 0.2}
    config.write_text(yaml.safe_dump(settings))
    process, srv = start_server(tmp_path, "--config", str(config), key=key)
    try:

        def served_version() -> str:
            body = {"model": "ver", "input": "hi"}
            answer = httpx.post(f"{srv.base_url}/v1/embeddings", json=body, headers=srv.headers)
            assert answer.status_code == 200, answer.text
            return answer.headers["x-model-version"]

        assert served_version() == "1"
        staged = tmp_path / "staged"  # made outside, then moved in (docs/models.md)
        staged.mkdir()
        (staged / "model.yaml").write_text(yaml.safe_dump({"options": {"scale": 2.0}}))
        staged.rename(repo / "ver" / "2")
        deadline = time.monotonic() + 60
        while served_version() != "2":
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.2)
    finally:
        stop_server(process)
    assert "repository watch: ver@2 done" in srv.log()
