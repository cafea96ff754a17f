"""``tessera serve --gateways 2`` over fake models, with keys on: one engine
process and two gateway processes on one port, reached by real clients.
Requests are answered whichever gateway takes them, a tenant's concurrency
is one count across both, the metrics and admin routes are the engine
process's (one view), a gateway that dies is started again, and SIGTERM
stops all three processes (the engine process's status 0)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import yaml
from websockets.sync.client import connect

from builders import write_fake_repository
from serverproc import Server, start_server, stop_server
from tessera.tenants import TenantStore


@dataclass(frozen=True)
class Split:
    server: Server
    pid: int
    admin_key: str
    acme_key: str


def start_split(tmp: Path) -> tuple[Split, subprocess.Popen[bytes]]:
    data_dir = tmp / "data"
    with TenantStore(data_dir) as store:
        store.add_tenant("ops")
        admin_key = store.create_key("ops", admin=True).key
        store.add_tenant("acme", max_concurrency=2)
        acme_key = store.create_key("acme").key
    repo = write_fake_repository(
        tmp / "repo",
        {
            "echo": {"task": "embedding"},
            "counted": {"task": "embedding"},  # asked for by the metrics test alone
            "chatty": {"task": "generate", "options": {"word_s": 0.02}},
            "slow": {"task": "embedding", "options": {"run_s": 2.0}},
        },
    )
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {"include_default_models": False, "model_repositories": [str(repo)], "gateways": 2}
        )
    )
    process, server = start_server(
        tmp, "--config", str(config), "--threads", "1", "--data-dir", str(data_dir), key=admin_key
    )
    return Split(server, process.pid, admin_key, acme_key), process


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    found, process = start_split(tmp_path_factory.mktemp("split"))
    try:
        yield found
    finally:
        stop_server(process)


def gateways(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_two_gateway_processes_answer_on_one_port(split: Split) -> None:
    assert len(gateways(split.pid)) == 2
    client = openai.OpenAI(base_url=f"{split.server.base_url}/v1", api_key=split.acme_key)
    for i in range(20):  # new connections: the kernel hands them to either gateway
        result = client.embeddings.create(model="echo", input=[f"text {i}", "two"])
        assert len(result.data) == 2
    client.close()


def test_a_tenants_concurrency_is_one_count_across_gateways(split: Split) -> None:
    def call(_: int) -> int:
        with httpx.Client(timeout=30) as http:  # a connection each: both gateways see some
            body = {"model": "slow", "input": "x"}
            url = f"{split.server.base_url}/v1/embeddings"
            return http.post(url, json=body, headers=bearer(split.acme_key)).status_code

    with ThreadPoolExecutor(8) as pool:
        statuses = sorted(pool.map(call, range(8)))
    assert statuses == [200, 200] + [429] * 6  # max_concurrency 2, each batch 2 s


def test_metrics_and_admin_are_the_engine_process_s(split: Split) -> None:
    base = split.server.base_url
    for _ in range(6):
        response = httpx.post(
            f"{base}/v1/embeddings",
            json={"model": "counted", "input": "x"},
            headers=bearer(split.acme_key),
        )
        assert response.status_code == 200
    deadline = time.monotonic() + 5
    while _requests_total(base, split.admin_key) < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _requests_total(base, split.admin_key) == 6
    residency = httpx.get(f"{base}/admin/residency", headers=bearer(split.admin_key))
    assert residency.status_code == 200
    assert {m["name"] for m in residency.json()["models"]} == {
        "echo",
        "counted",
        "slow",
        "chatty",
    }
    assert httpx.get(f"{base}/admin/residency").status_code == 401
    denied = httpx.get(f"{base}/admin/residency", headers=bearer(split.acme_key))
    assert denied.status_code == 403


def _requests_total(base: str, key: str) -> float:
    text = httpx.get(f"{base}/metrics", headers=bearer(key)).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('tessera_requests_total{model="counted"') and 'status="200"' in line
    )


def test_a_chat_streams_through_a_gateway_piece_by_piece(split: Split) -> None:
    client = openai.OpenAI(base_url=f"{split.server.base_url}/v1", api_key=split.acme_key)
    stream = client.chat.completions.create(
        model="chatty",
        messages=[{"role": "user", "content": "one two three four"}],
        stream=True,
    )
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta]
    words = [p for p in pieces if p]
    assert len(words) >= 4  # one chunk a word, as the engine process made them
    whole = client.chat.completions.create(
        model="chatty", messages=[{"role": "user", "content": "one two three four"}]
    )
    assert "".join(words).strip() == (whole.choices[0].message.content or "").strip()
    client.close()


def test_the_websocket_runs_through_a_gateway(split: Split) -> None:
    url = f"ws://127.0.0.1:{split.server.port}/v1/ws"
    headers = bearer(split.acme_key)
    with connect(url, additional_headers=headers, open_timeout=30) as ws:
        ws.send(json.dumps({"id": "e", "type": "embeddings", "model": "echo", "input": ["a"]}))
        chat = {"role": "user", "content": "a b c"}
        ws.send(json.dumps({"id": "c", "type": "chat", "model": "chatty", "messages": [chat]}))
        done: dict[str, str] = {}
        while len(done) < 2:
            reply = json.loads(ws.recv(timeout=30))
            if reply["type"] in ("result", "error"):
                done[reply["id"]] = reply["type"]
    assert done == {"e": "result", "c": "result"}


def test_bad_input_is_a_json_error_from_the_gateway(split: Split) -> None:
    url = f"{split.server.base_url}/v1/embeddings"
    response = httpx.post(url, content=b"{not json", headers=bearer(split.acme_key))
    assert response.status_code == 400  # OpenAI's status for an invalid request
    assert response.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.post(url, json={"model": "nope", "input": "x"}, headers=bearer(split.acme_key))
    assert missing.status_code == 404
    assert missing.json()["error"]["type"]


def test_a_gateway_that_dies_is_started_again(split: Split) -> None:
    victim = gateways(split.pid)[0]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive = [p for p in gateways(split.pid) if p.status() != psutil.STATUS_ZOMBIE]
        if len(alive) == 2 and victim.pid not in {p.pid for p in alive}:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the gateway was not started again within 30 s")
    for _ in range(10):
        response = httpx.post(
            f"{split.server.base_url}/v1/embeddings",
            json={"model": "echo", "input": "x"},
            headers=bearer(split.acme_key),
        )
        assert response.status_code == 200


def test_sigterm_stops_every_process_with_status_0(tmp_path: Path) -> None:
    found, process = start_split(tmp_path)
    children = gateways(found.pid)
    assert len(children) == 2
    process.terminate()
    assert process.wait(timeout=60) == 0
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive


def test_a_port_in_use_is_one_line_and_status_3(tmp_path: Path) -> None:
    # 3 as a single process's (uvicorn's start-up failure), found before any
    # process is started or any tenant made.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "tessera", "serve", "--no-auth", "--gateways", "2"]
        command += ["--port", str(port), "--data-dir", str(tmp_path / "data")]
        command += ["--preload", "nothing-at-all", "--no-fill"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 3
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr
