"""/metrics, /admin/stats and /admin/slo after real traffic, on the app in-process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from builders import ISSUE_FAMILIES
from tessera.engine import Engine
from tessera.gateway import create_app
from tessera.gateway.observability import router
from tessera.metrics.prometheus import MODEL_STATES
from tessera.metrics.rolling import REJECT_REASONS
from tessera.tenants import TenantStore


def make_client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tessera")


@pytest.fixture
async def observed(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    """The app of ``client``, with the metrics installed (auth off)."""
    app = create_app(engine, max_body_bytes=64 * 1024)
    async with make_client(app) as client:
        yield client


def parse(text: str) -> dict[str, Metric]:
    """Families by the name a query uses (counters with ``_total``)."""
    families = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        families[name] = family
    return families


def value(family: Metric, sample: str | None = None, **labels: str) -> float:
    """The sum of ``family``'s samples named ``sample`` whose labels include ``labels``."""
    name = sample or family.name
    return sum(
        s.value
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def send_traffic(client: httpx.AsyncClient) -> None:
    embeds = [
        client.post("/v1/embeddings", json={"model": "embed", "input": f"text {i}"})
        for i in range(8)
    ]
    for r in await asyncio.gather(*embeds):
        assert r.status_code == 200
    r = await client.post("/v1/rerank", json={"model": "rerank", "query": "q", "documents": ["a"]})
    assert r.status_code == 200  # a cold model: one load
    r = await client.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert r.status_code == 404
    # "slow" runs one item per batch for 0.1 s and its queue holds 8.
    burst = [client.post("/v1/embeddings", json={"model": "slow", "input": "x"}) for _ in range(12)]
    statuses = [r.status_code for r in await asyncio.gather(*burst)]
    assert 503 in statuses


async def test_metrics_after_traffic(observed: httpx.AsyncClient) -> None:
    await send_traffic(observed)
    r = await observed.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    families = parse(r.text)
    assert ISSUE_FAMILIES - set(families) == set()

    assert value(families["tessera_memory_budget_bytes"]) == 64 * 1024**2
    assert value(families["tessera_memory_used_bytes"]) > 0
    assert value(families["tessera_memory_peak_used_bytes"]) > 0
    resident = families["tessera_model_resident_bytes"]
    assert value(resident, model="embed") > 0
    assert value(resident, model="chat") == 0  # every repository model, 0 when not loaded
    state = families["tessera_model_state"]
    assert value(state, model="embed", state="ready") == 1
    assert value(state, model="embed") == 1  # one state at a time
    assert {s.labels["state"] for s in state.samples} == set(MODEL_STATES)
    assert value(families["tessera_model_loads_total"], "tessera_model_loads_total") >= 2
    assert value(families["tessera_model_evictions_total"], "tessera_model_evictions_total") == 0
    assert value(families["tessera_model_load_seconds"], "tessera_model_load_seconds_count") >= 1
    for copies in ("tessera_host_tier_copies_out", "tessera_host_tier_copies_kept"):
        assert value(families[f"{copies}_total"]) == 0  # page-locked copies: CUDA only

    batch = families["tessera_batch_size"]
    assert value(batch, "tessera_batch_size_count", model="embed") > 0
    assert value(batch, "tessera_batch_size_sum", model="embed") == 8
    assert value(families["tessera_batch_duration_seconds"], "tessera_batch_duration_seconds_count")

    requests = families["tessera_requests_total"]
    ok = value(requests, "tessera_requests_total", model="embed", task="embedding", status="200")
    assert ok == 8
    assert value(requests, "tessera_requests_total", tier="none") > 0  # auth is off
    assert value(requests, "tessera_requests_total", model="unknown", status="404") == 1
    assert value(requests, "tessera_requests_total", model="slow", status="503") >= 1

    rejected = families["tessera_rejected_requests_total"]
    assert {s.labels["reason"] for s in rejected.samples if s.name.endswith("_total")} == set(
        REJECT_REASONS
    )
    assert value(rejected, "tessera_rejected_requests_total", reason="queue_full") >= 1
    assert value(rejected, "tessera_rejected_requests_total", reason="rate") == 0

    latency = families["tessera_request_duration_seconds"]
    assert value(latency, "tessera_request_duration_seconds_count", model="embed", tier="none") == 8
    queue = families["tessera_queue_duration_seconds"]
    assert value(queue, "tessera_queue_duration_seconds_count", model="slow") >= 8
    assert value(families["tessera_queue_depth"], model="slow") == 0  # all answered

    target = families["tessera_slo_target_seconds"]
    assert value(target, model="embed") == 1.0
    assert value(target, model="slow") == 0.05
    slo = families["tessera_slo_requests_total"]
    assert value(slo, "tessera_slo_requests_total", model="embed", within="true") == 8
    assert value(slo, "tessera_slo_requests_total", model="slow", within="false") >= 8

    assert value(families["tessera_device_memory_total_bytes"]) > 0
    assert value(families["tessera_process_resident_bytes"]) > 0
    cpu = families["tessera_process_cpu_seconds_total"]
    assert value(cpu, "tessera_process_cpu_seconds_total") > 0


async def test_openmetrics_when_asked(observed: httpx.AsyncClient) -> None:
    r = await observed.get("/metrics", headers={"accept": "application/openmetrics-text"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")


async def test_admin_stats_and_slo(observed: httpx.AsyncClient) -> None:
    await send_traffic(observed)
    stats = (await observed.get("/admin/stats")).json()
    assert stats["window_s"] == 60.0
    models = {m["name"]: m for m in stats["models"]}
    embed = models["embed"]
    assert {"name", "qps", "p50_ms", "p99_ms", "requests", "errors"} <= set(embed)
    assert (embed["requests"], embed["errors"]) == (8, 0)
    assert embed["qps"] > 0
    assert 0 < embed["p50_ms"] <= embed["p99_ms"]
    assert models["slow"]["errors"] >= 1
    assert models["unknown"]["errors"] == 1
    assert [t["tier"] for t in stats["tiers"]] == ["none"]
    assert set(stats["tiers"][0]) == {"tier", "qps", "p50_ms", "p99_ms", "requests"}
    assert stats["tenants"] == []  # auth is off
    rejection = stats["rejections"][0]
    assert set(rejection) == {"time", "tenant", "model", "reason", "status"}
    assert (rejection["model"], rejection["reason"], rejection["status"]) == (
        "slow",
        "queue_full",
        503,
    )
    assert sum(stats["batch_sizes"]["embed"].values()) >= 1
    assert stats["batch_sizes"]["slow"]["1"] >= 8

    slo = (await observed.get("/admin/slo")).json()
    assert (slo["window_s"], slo["objective"]) == (60.0, 0.99)
    by_name = {m["name"]: m for m in slo["models"]}
    assert set(by_name["embed"]) == {
        "name",
        "target_ms",
        "requests",
        "within_target",
        "share_within",
        "p99_ms",
        "ok",
    }
    assert by_name["embed"]["target_ms"] == 1000
    assert (by_name["embed"]["share_within"], by_name["embed"]["ok"]) == (1.0, True)
    assert (by_name["slow"]["share_within"], by_name["slow"]["ok"]) == (0.0, False)
    assert (by_name["chat"]["target_ms"], by_name["chat"]["ok"]) == (None, None)


async def test_metrics_404_when_not_installed(engine: Engine) -> None:
    app = FastAPI()  # the routes alone, without install_observability
    app.state.engine = engine
    app.include_router(router)
    async with make_client(app) as client:
        for path in ("/metrics", "/admin/stats", "/admin/slo"):
            r = await client.get(path)
            assert r.status_code == 404
            assert "not enabled" in r.json()["error"]["message"]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TenantStore]:
    with TenantStore(tmp_path / "tenants") as store:
        store.add_tenant("ops")
        store.add_tenant("acme", tier="vip")
        yield store


@pytest.mark.parametrize("public", [False, True])
async def test_metrics_auth_tiers_and_tenants(
    engine: Engine, store: TenantStore, public: bool
) -> None:
    app = create_app(engine, tenant_store=store, per_tenant_labels=True, metrics_public=public)
    admin = {"authorization": f"Bearer {store.create_key('ops', admin=True).key}"}
    user = {"authorization": f"Bearer {store.create_key('acme').key}"}
    async with make_client(app) as client:
        r = await client.post("/v1/embeddings", json={"model": "embed", "input": "x"}, headers=user)
        assert r.status_code == 200
        r = await client.post("/v1/embeddings", json={"model": "embed", "input": "x"})
        assert r.status_code == 401
        assert (await client.get("/metrics")).status_code == (200 if public else 401)
        assert (await client.get("/metrics", headers=user)).status_code == (200 if public else 403)
        assert (await client.get("/admin/stats", headers=user)).status_code == 403
        r = await client.get("/metrics", headers=admin)
        assert r.status_code == 200
        requests = parse(r.text)["tessera_requests_total"]
        name = "tessera_requests_total"
        assert value(requests, name, tier="vip", tenant="acme", status="200") == 1
        assert value(requests, name, tier="none", tenant="none", status="401") == 1
        rejected = parse(r.text)["tessera_rejected_requests_total"]
        assert value(rejected, "tessera_rejected_requests_total", reason="auth") == 1
        stats = (await client.get("/admin/stats", headers=admin)).json()
        assert stats["tenants"] == [{"tenant": "acme", "requests": 1}]
        assert {t["tier"] for t in stats["tiers"]} == {"vip", "none"}
