"""One real tessera server process for the whole session, on loopback, with the
default models; the acceptance tests talk to it with real clients."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from serverproc import Server, start_server, stop_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("server")
    process, server = start_server(tmp, "--memory-budget", "3GiB", "--preload", "all-minilm-l6-v2")
    try:
        yield server
    finally:
        stop_server(process)
        assert process.returncode is not None
