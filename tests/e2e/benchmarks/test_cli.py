"""``tessera bench`` against a real server over fake models: bounded, reported."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from builders import write_fake_repository
from serverproc import Server, start_server, stop_server
from tessera.tenants import TenantStore


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("bench")
    repo = write_fake_repository(tmp / "repo", {"echo": {"task": "embedding"}})
    data_dir = tmp / "data"
    with TenantStore(data_dir) as store:
        store.add_tenant("ops")
        key = store.create_key("ops", admin=True).key
    args = ("--model-repository", str(repo), "--data-dir", str(data_dir), "--preload", "echo")
    process, server = start_server(tmp, *args, key=key)
    try:
        yield server
    finally:
        stop_server(process)


def bench(server: Server, tmp_path: Path, *args: str) -> tuple[dict[str, object], str]:
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "tessera", "bench", "--url", server.base_url]
    command += ["--key", server.key or "", "--model", "echo", "--out", str(out), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), done.stderr


def test_closed_loop_is_bounded_by_count_and_reports_latency(
    server: Server, tmp_path: Path
) -> None:
    result, progress = bench(server, tmp_path, "--concurrency", "4", "--requests", "60")
    assert result["requests"] == 60
    assert result["ok"] == 60
    assert result["task"] == "embedding"
    assert result["mode"] == "closed"
    assert 0 < result["p50_ms"] <= result["p99_ms"]  # type: ignore[operator]
    assert "bench: 60/60 requests done" in progress  # plain lines off a terminal


def test_open_loop_is_bounded_by_time(server: Server, tmp_path: Path) -> None:
    result, _ = bench(server, tmp_path, "--rate", "20", "--requests", "1000", "--duration", "1")
    assert result["mode"] == "open"
    assert 5 <= result["requests"] <= 40  # type: ignore[operator]
    assert result["failed"] == 0


def test_unknown_model_is_a_clear_error(server: Server) -> None:
    command = [sys.executable, "-m", "tessera", "bench", "--url", server.base_url]
    command += ["--key", server.key or "", "--model", "nope"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "not served" in done.stderr
    assert "Traceback" not in done.stderr
