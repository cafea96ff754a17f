"""``/v1/ws`` goes through the same admission and fair scheduling as HTTP: on
a real server over fake models, a tenant's model list (404, as an unknown model) and its rate
(429 with ``retry_after``) refuse a message for its id, and a quiet tenant's
message is served beside another tenant's backlog on one model instead of
after it (in FIFO order it would wait for the whole backlog)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from websockets.sync.client import ClientConnection, connect

from builders import write_fake_repository
from serverproc import Server, start_server, stop_server
from tessera.tenants import TenantStore

BACKLOG = 16  # the flood's messages, one batch each
RUN_S = 0.25  # seconds a batch of the slow model takes
MODELS = {
    "embed": {"task": "embedding"},
    "other": {"task": "embedding"},
    "slow": {
        "task": "embedding",
        "options": {"run_s": RUN_S},
        "batching": {"max_batch_size": 1, "max_wait_ms": 0},
    },
}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    data_dir = tmp_path_factory.getbasetemp() / "ws-admission" / "data"
    with TenantStore(data_dir) as store:
        store.add_tenant("limited", qps=0.5, burst=1, models=("embed",))
        store.add_tenant("flood", models=("slow",))
        store.add_tenant("quiet", models=("slow",))
        return {name: store.create_key(name).key for name in ("limited", "flood", "quiet")}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, keys: dict[str, str]) -> Iterator[Server]:
    tmp = tmp_path_factory.getbasetemp() / "ws-admission"
    repo = write_fake_repository(tmp / "repo", MODELS)
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump({"include_default_models": False, "model_repositories": [str(repo)]})
    )
    process, server = start_server(
        tmp, "--config", str(config), "--data-dir", str(tmp / "data"), "--preload", "slow"
    )
    try:
        yield server
    finally:
        stop_server(process)


def open_socket(server: Server, key: str) -> ClientConnection:
    url = f"ws://127.0.0.1:{server.port}/v1/ws"
    return connect(url, additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=30)


def embed(ws: ClientConnection, message_id: str, model: str) -> None:
    ws.send(json.dumps({"id": message_id, "type": "embeddings", "model": model, "input": "x"}))


def answer(ws: ClientConnection) -> dict[str, Any]:
    reply: dict[str, Any] = json.loads(ws.recv(timeout=60))
    return reply


def test_the_tenants_model_list_and_rate_refuse_a_message_for_its_id(
    server: Server, keys: dict[str, str]
) -> None:
    with open_socket(server, keys["limited"]) as ws:
        embed(ws, "elsewhere", "other")
        reply = answer(ws)
        assert (reply["id"], reply["type"], reply["error"]["code"]) == ("elsewhere", "error", 404)
        for i in range(3):  # a burst of 1 at 0.5 a second: the second and third are refused
            embed(ws, f"r{i}", "embed")
        replies = {r["id"]: r for r in (answer(ws) for _ in range(3))}
    assert replies["r0"]["type"] == "result"
    for refused in (replies["r1"], replies["r2"]):
        assert refused["type"] == "error"
        assert refused["error"]["code"] == 429
        assert refused["retry_after"] >= 1


def test_a_quiet_tenant_is_served_beside_a_flood_on_one_model(
    server: Server, keys: dict[str, str]
) -> None:
    finished: list[float] = []  # when each of the flood's results arrived

    with open_socket(server, keys["flood"]) as flood, open_socket(server, keys["quiet"]) as quiet:

        def read_flood() -> None:
            for _ in range(BACKLOG):
                assert answer(flood)["type"] == "result"
                finished.append(time.monotonic())

        for i in range(BACKLOG):
            embed(flood, f"f{i}", "slow")
        reader = threading.Thread(target=read_flood)
        reader.start()
        deadline = time.monotonic() + 60
        while not finished:  # the backlog is queued and its first batch has run
            assert time.monotonic() < deadline, "the flood was never served"
            time.sleep(0.01)
        sent = time.monotonic()
        embed(quiet, "q", "slow")
        assert answer(quiet)["type"] == "result"
        served = time.monotonic()
        reader.join(timeout=120)
    assert len(finished) == BACKLOG
    meanwhile = sum(1 for t in finished if sent <= t < served)
    # Fair: it waits for the batches running (and perhaps one more), not the
    # ~14 still queued ahead of it in arrival order.
    assert meanwhile <= 4, (meanwhile, served - sent)
