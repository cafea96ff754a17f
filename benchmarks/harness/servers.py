"""Start and stop the servers a benchmark measures, and account for their processes.

Every server is started in a session of its own, so that stopping it stops
the children it started too (TorchServe's Java frontend and its Python
workers, for example) and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

READY_TIMEOUT_S = 300.0
# Unbuffered: tessera prints its bootstrap admin key on stdout, which goes to a file.
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
_ADMIN_KEY = re.compile(r"admin API key[^:]*:\s*(\S+)")
_PRELOAD_FAILED = re.compile(r"preload failed: .*")


@dataclass
class RunningServer:
    """One server process (and its children) that the benchmark started."""

    name: str
    process: subprocess.Popen[bytes]
    base_url: str
    command: list[str]
    log_path: Path
    startup_s: float
    key: str | None = None  # tessera's bootstrap admin key, where it requires keys
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def processes(self) -> list[psutil.Process]:
        """The server's process and every descendant alive now."""
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        return []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tessera_command() -> list[str]:
    script = Path(sys.executable).parent / "tessera"
    return [str(script)] if script.exists() else [sys.executable, "-m", "tessera"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _wait_ready(
    process: subprocess.Popen[bytes], ready: Callable[[], bool], log_path: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"server exited with {process.returncode}:\n{tail}")
        failure = _PRELOAD_FAILED.search(log_path.read_text(errors="replace"))
        if failure is not None:  # it would never be ready
            raise RuntimeError(f"server cannot get ready: {failure.group(0)}")
        with contextlib.suppress(httpx.HTTPError):
            if ready():
                return
        time.sleep(0.25)
    tail = log_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"server not ready within {timeout_s:.0f} s:\n{tail}")


def stop_group(process: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """Stop a server we started and every process of its session, by its PID.

    SIGTERM to the group, then wait until every member has gone (killing the
    group as soon as the leader exits would kill Python's multiprocessing
    resource trackers before they remove their semaphores and shared memory);
    SIGKILL whatever is left after ``grace_s``.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        process.poll()  # reap the leader, else it stays in the group as a zombie
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


@contextlib.contextmanager
def running_process(
    name: str,
    command: list[str],
    base_url: str,
    ready: Callable[[], bool],
    log_path: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[RunningServer]:
    """Run ``command`` in its own session until ``ready()`` holds; stop it on exit."""
    log(f"start {name}: {shlex.join(command)}")
    start = time.perf_counter()
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SERVER_ENV, **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )
    try:
        _wait_ready(process, ready, log_path, timeout_s)
        yield RunningServer(name, process, base_url, command, log_path, time.perf_counter() - start)
    finally:
        stop_group(process)


def url_ok(url: str) -> Callable[[], bool]:
    """A readiness check: GET ``url`` answers 200."""
    return lambda: httpx.get(url, timeout=2).status_code == 200


@contextlib.contextmanager
def running_tessera(
    work: Path, label: str, args: list[str], env: dict[str, str] | None = None
) -> Iterator[RunningServer]:
    """``tessera serve`` on a free loopback port with its own data folder."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [*tessera_command(), "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--data-dir", str(work / f"data-{label}"), *args]
    log_path = work / f"server-{label}.log"
    ready = url_ok(f"{base_url}/v2/health/ready")
    with running_process(label, command, base_url, ready, log_path, env) as server:
        match = _ADMIN_KEY.search(log_path.read_text(errors="replace"))
        server.key = match.group(1) if match else None
        yield server
