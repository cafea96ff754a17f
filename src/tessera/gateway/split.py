"""The process split: one engine process, several gateway processes.

``tessera serve`` with ``gateways: N`` (N > 0; ``auto`` picks by device)
runs as the engine process: the ``Engine`` (queues, fair scheduler,
admission, residency, the device), its ``EngineCore`` on
``<data_dir>/run/engine.sock``, and the whole app on
``<data_dir>/run/app.sock`` for the routes that read or change the
engine's state (``gateway/forward.py``). It binds the HTTP port itself and
starts N gateway processes (``python -m tessera.gateway.worker``) that
accept on it: each runs the app over a ``RemoteEngine``, so HTTP, keys,
JSON and the audit are spread over N interpreters, and every request still
meets one set of queues and tenant limits.

The engine process runs ``engine_loop``'s event loop (``engine/loop.py``:
by default asyncio's, polling its sockets at most every 0.2 ms while
callbacks are ready, so that it keeps the interpreter lock from the compute
workers for fewer hand-overs); the gateways run uvicorn's (uvloop's where it
is installed).

Signals: the engine process passes SIGTERM and SIGINT on to its gateways
(their own session: a terminal's Ctrl-C reaches the engine process only).
Each side drains as one process does (``gateway/server.py``); the engine
process stops its core once its gateways have exited. A gateway that exits
on its own is started again (at most ``MAX_RESTARTS`` in a row within a
minute); one that loses the engine process stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from tessera.config import ServerConfig
from tessera.engine import Engine
from tessera.engine.core import EngineCore
from tessera.engine.loop import uvicorn_loop
from tessera.gateway.server import FLUSH_S, GatewayServer, http_config

log = logging.getLogger(__name__)

MAX_RESTARTS = 5
_WATCH_S = 0.5


class GatewayProcesses:
    """The gateway processes, started from ``settings_file`` on one listener."""

    def __init__(self, settings_file: Path, listener: socket.socket, count: int) -> None:
        self.settings_file = settings_file
        self.listener = listener
        self.count = count
        self.procs: list[subprocess.Popen[bytes]] = []
        self._restarts: list[float] = []
        self._given_up: set[int] = set()
        self.stopping = False  # signalled: an exit is no longer a failure

    def start(self) -> None:
        self.procs = [self._spawn(index) for index in range(self.count)]

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        fd = self.listener.fileno()
        command = [sys.executable, "-m", "tessera.gateway.worker", str(self.settings_file)]
        return subprocess.Popen(
            [*command, str(fd), str(index)], pass_fds=(fd,), start_new_session=True
        )

    async def watch(self) -> None:
        """Until cancelled: start again a gateway that exited."""
        while True:
            await asyncio.sleep(_WATCH_S)
            for index, proc in enumerate(self.procs):
                if self.stopping or index in self._given_up or proc.poll() is None:
                    continue
                now = time.monotonic()
                self._restarts = [t for t in self._restarts if now - t < 60] + [now]
                if len(self._restarts) > MAX_RESTARTS:
                    log.error(
                        "gateway %d exited (status %s): more than %d restarts within a minute,"
                        " not started again",
                        index,
                        proc.returncode,
                        MAX_RESTARTS,
                    )
                    self._given_up.add(index)
                    continue
                log.error(
                    "gateway %d exited (status %s): starting it again", index, proc.returncode
                )
                self.procs[index] = self._spawn(index)

    def signal(self, sig: signal.Signals) -> None:
        self.stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(sig)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM those still running, wait up to ``timeout_s``, then SIGKILL."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                await asyncio.to_thread(proc.wait, max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("gateway %d did not stop within %gs: killed", proc.pid, timeout_s)
                proc.kill()
                await asyncio.to_thread(proc.wait)


class EngineProcessServer(GatewayServer):
    """The engine process's server: its app on a Unix socket, the core, the gateways."""

    def __init__(
        self,
        config: Any,
        engine: Engine,
        shutdown_grace_s: float,
        core: EngineCore,
        core_socket: Path,
        gateways: GatewayProcesses,
    ) -> None:
        super().__init__(config, engine, shutdown_grace_s)
        self.core = core
        self.core_socket = core_socket
        self.gateways = gateways

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        await self.core.start(self.core_socket)
        self.gateways.start()
        watch = asyncio.create_task(self.gateways.watch(), name="gateways")
        try:
            await super().serve(sockets)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            # Their requests were answered by the drain; what is left is writing them.
            await self.gateways.stop(self.shutdown_grace_s + FLUSH_S)
            await self.core.close()

    def _on_signal(self, sig: signal.Signals) -> None:
        self.gateways.signal(sig)
        super()._on_signal(sig)


def run_dir(settings: ServerConfig) -> Path:
    path = settings.data_dir / "run"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def serve_split(
    settings: ServerConfig, app: FastAPI, engine: Engine, num_gateways: int, log_level: str
) -> None:
    """Run the engine process until it is stopped (module notes)."""
    folder = run_dir(settings)
    core_socket, app_socket = folder / "engine.sock", folder / "app.sock"
    with contextlib.suppress(FileNotFoundError):
        app_socket.unlink()  # left by a process that was killed
    try:
        listener = socket.create_server((settings.host, settings.port), backlog=2048)
    except OSError as e:  # as uvicorn says it in one process: a line and status 1
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, e)
        raise SystemExit(1) from e
    settings_file = folder / "gateway.pickle"
    with settings_file.open("wb") as f:
        pickle.dump((settings, log_level, core_socket, app_socket), f)
    core = EngineCore(engine, on_events=app.state.stats.on_request)
    config = http_config(
        app,
        settings,
        log_level,
        trust_forwarded=True,
        uds=str(app_socket),
        loop=uvicorn_loop(settings.engine_loop),
    )
    gateways = GatewayProcesses(settings_file, listener, num_gateways)
    server = EngineProcessServer(
        config, engine, settings.shutdown_grace_s, core, core_socket, gateways
    )
    try:
        server.run()
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(core_socket)
