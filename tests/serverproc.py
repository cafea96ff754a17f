"""Start and stop a real tessera server process on loopback."""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from harness.fake_models import fake_adapter_args, harness_pythonpath

READY_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Server:
    base_url: str
    port: int
    log_path: Path
    key: str | None = None
    grpc_port: int | None = None  # where it was given --grpc-port

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(
    tmp: Path,
    *args: str,
    key: str | None = None,
    probe: str = "/v2/health/ready",
    command_name: str = "serve",
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], Server]:
    """Start ``tessera serve`` (or ``command_name``) with the ``fake`` adapter
    registered, ``args`` (a later ``--data-dir`` wins) and ``env`` over this
    process's environment, and wait
    until it is ready (or until ``probe`` answers 200: ``/v2/health/live``, up)."""
    port = free_port()
    log_path = tmp / f"server-{port}.log"
    environ = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    environ = {**environ, "PYTHONPATH": harness_pythonpath(), **(env or {})}
    command = [sys.executable, "-m", "tessera", command_name, "--port", str(port)]
    command += ["--data-dir", str(tmp / "data"), *fake_adapter_args(), *args]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environ)
    server = Server(f"http://127.0.0.1:{port}", port, log_path, key)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}{probe}", timeout=2).status_code == 200:
                return process, server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # a fake-model server is ready about 2 s after its start
    stop_server(process)
    raise RuntimeError(f"server not ready in {READY_TIMEOUT_S}s:\n{server.log()}")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def audit_rows(
    data_dir: Path, prefix: str, count: int, columns: str = "tenant, status, reason"
) -> dict[str, tuple[Any, ...]]:
    """A server's audit rows (``columns``) by request id, for the ids starting
    with ``prefix``, once ``count`` are written (the audit is written off the
    hot path) or after 10 s."""
    deadline = time.monotonic() + 10
    rows: list[tuple[Any, ...]] = []
    while time.monotonic() < deadline:
        with sqlite3.connect(data_dir / "audit.db") as conn:
            rows = conn.execute(
                f"SELECT request_id, {columns} FROM audit WHERE request_id LIKE ?",
                (prefix + "%",),
            ).fetchall()
        if len(rows) >= count:
            break
        time.sleep(0.2)
    return {str(row[0]): row[1:] for row in rows}
