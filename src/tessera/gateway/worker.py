"""A gateway process (``gateway/split.py``): ``python -m tessera.gateway.worker
SETTINGS_FILE LISTENER_FD INDEX``, started by the engine process.

It serves the app over a ``RemoteEngine`` on the listening socket it was
given, with the tenant store and audit log of the server's config, and
stops when it is signalled or when it loses the engine process.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import socket
import sys
from pathlib import Path

import uvicorn

from tessera.config import ServerConfig
from tessera.engine.remote import RemoteEngine
from tessera.gateway.server import GatewayServer, http_config
from tessera.logs import configure_logging


class GatewayProcessServer(GatewayServer):
    """Connects to the engine process before it serves; stops if it is lost."""

    def __init__(
        self, config: uvicorn.Config, engine: RemoteEngine, shutdown_grace_s: float
    ) -> None:
        super().__init__(config, engine, shutdown_grace_s)
        self.remote = engine
        self.engine_lost = False  # it stopped because the engine process went

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        await self.remote.connect()
        lost = asyncio.create_task(self._stop_when_lost(), name="engine-lost")
        try:
            await super().serve(sockets)
        finally:
            lost.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lost

    async def _stop_when_lost(self) -> None:
        await self.remote.lost.wait()
        if not self.should_exit:
            self.engine_lost = True
            self.should_exit = True


def main(argv: list[str]) -> int:
    from tessera.gateway import create_app

    settings_file, fd = Path(argv[1]), int(argv[2])
    with settings_file.open("rb") as f:
        settings, log_level, core_socket, app_socket = pickle.load(f)
    assert isinstance(settings, ServerConfig)
    configure_logging(log_level, settings.log_format)
    engine = RemoteEngine(core_socket)
    store, audit_log = settings.tenancy() if settings.auth else (None, None)
    app = create_app(
        engine,
        max_body_bytes=settings.max_body_bytes,
        image_limits=settings.image_limits,
        header_timeout_s=settings.header_timeout_s,
        tenant_store=store,
        audit_log=audit_log,
        response_store=settings.response_store(),
        tiers=settings.tiers,
        metrics_public=settings.metrics_public,
        engine_app=app_socket,
        request_events=engine,
    )
    if settings.grpc_port is not None:  # each gateway listens (grpcio sets SO_REUSEPORT)
        app.state.grpc_address = (settings.host, settings.grpc_port)
    listener = socket.socket(fileno=fd)
    server = GatewayProcessServer(
        http_config(app, settings, log_level), engine, settings.shutdown_grace_s
    )
    server.run(sockets=[listener])
    return 1 if server.engine_lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
