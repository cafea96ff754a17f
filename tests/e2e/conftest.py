"""One real tessera server process for the whole session, on loopback, with the
default models; the acceptance tests talk to it with real clients."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from serverproc import Server, free_port, start_server, stop_server
from tessera.tenants import TenantStore


@pytest.fixture(scope="session")
def admin_key(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An admin key of tenant ``acceptance``, made in the data dir before the server starts."""
    data_dir = tmp_path_factory.getbasetemp() / "server-data"
    with TenantStore(data_dir) as store:
        store.add_tenant("acceptance", tier="standard")
        return store.create_key("acceptance", admin=True).key


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, admin_key: str) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("server")
    data_dir = tmp_path_factory.getbasetemp() / "server-data"
    grpc_port = free_port()
    process, server = start_server(
        tmp,
        *("--memory-budget", "3GiB", "--preload", "all-minilm-l6-v2"),
        *("--data-dir", str(data_dir), "--grpc-port", str(grpc_port)),
        key=admin_key,
    )
    try:
        yield dataclasses.replace(server, grpc_port=grpc_port)
    finally:
        stop_server(process)
