"""Acceptance of ``isolation: process`` on a real ``tessera serve``: a fake model
in a worker process calls ``os.abort()`` on a marked input while another model
serves under load; the marked request gets 503 with Retry-After, every request
of the other model succeeds, the isolated model serves again after, and a
SIGTERM leaves no worker process behind."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
import psutil

from builders import write_fake_repository
from serverproc import Server, start_server, stop_server

NUM_CLIENTS = 4
STOP_S = 60.0


def embed(server: Server, model: str, text: str) -> httpx.Response:
    body = {"model": model, "input": text}
    return httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=60)


def worker_pid(server: Server, name: str) -> int:
    listing = httpx.get(f"{server.base_url}/admin/residency", timeout=10).json()
    entry = next(m for m in listing["models"] if m["name"] == name)
    return int(entry["engine_metrics"]["worker_pid"])


def test_an_aborting_worker_fails_only_its_request_and_sigterm_leaves_no_worker(
    tmp_path: Path,
) -> None:
    repository = write_fake_repository(
        tmp_path / "models",
        {
            "isolated": {
                "task": "embedding",
                "isolation": "process",
                "options": {"abort_on": "CRASH"},
            },
            "other": {"task": "embedding", "options": {"run_s": 0.01}},
        },
    )
    process, server = start_server(
        tmp_path,
        "--no-auth",
        "--model-repository",
        str(repository),
        "--preload",
        "isolated",
        "--preload",
        "other",
    )
    try:
        assert embed(server, "isolated", "hello").status_code == 200
        first = worker_pid(server, "isolated")
        assert first in {p.pid for p in psutil.Process(process.pid).children(recursive=True)}

        # The other model under load from several clients while the worker aborts.
        statuses: list[int] = []
        done = threading.Event()

        def load(client: int) -> None:
            sent = 0
            while not done.is_set() or sent < 20:
                statuses.append(embed(server, "other", f"client {client} #{sent}").status_code)
                sent += 1

        clients = [threading.Thread(target=load, args=(c,)) for c in range(NUM_CLIENTS)]
        for thread in clients:
            thread.start()
        crashed = embed(server, "isolated", "please CRASH now")
        done.set()
        for thread in clients:
            thread.join(timeout=120)

        assert crashed.status_code == 503, crashed.text
        assert int(crashed.headers["retry-after"]) >= 1
        assert "SIGABRT" in crashed.json()["error"]["message"]
        assert len(statuses) >= NUM_CLIENTS * 20
        assert set(statuses) == {200}
        assert not psutil.pid_exists(first)

        assert embed(server, "isolated", "hello again").status_code == 200
        second = worker_pid(server, "isolated")
        assert second != first
        workers = [psutil.Process(second)]
    except BaseException:
        stop_server(process)
        raise
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=STOP_S) == 0
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"orphans: {alive}"
