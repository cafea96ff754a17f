"""What each tenant costs, through the real app over fake models: each
request's device-seconds in a header and its audit row, split out of shared
batches by work units; memory held over time in rows of its own; sums that
add up to what the engine measured."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from builders import fake_engine
from tessera.engine import Engine
from tessera.gateway import create_app
from tessera.gateway.app import record_memory
from tessera.tenants import AuditLog, TenantStore

MODELS = {
    # A batch's run grows with its work, as a real model's does.
    "embed": {
        "task": "embedding",
        "preload": True,
        "options": {"unit_s": 0.0005},
        "batching": {"max_batch_size": 64, "max_wait_ms": 20},
    },
}
SHORT = ["a few words of text"] * 4
LONG = ["a few words of text " * 4] * 4  # four times as long


@pytest.fixture
async def served(
    tmp_path: Path,
) -> AsyncIterator[tuple[Engine, AuditLog, dict[str, httpx.AsyncClient]]]:
    with TenantStore(tmp_path / "data") as store:
        keys = {}
        for name in ("three", "one", "long"):
            store.add_tenant(name)
            keys[name] = store.create_key(name).key
        audit = AuditLog(tmp_path / "data")
        async with fake_engine(tmp_path / "repo", MODELS) as engine:
            app = create_app(engine, tenant_store=store, audit_log=audit)
            transport = httpx.ASGITransport(app=app)
            clients = {
                name: httpx.AsyncClient(
                    transport=transport,
                    base_url="http://t",
                    headers={"authorization": f"Bearer {key}"},
                )
                for name, key in keys.items()
            }
            try:
                yield engine, audit, clients
            finally:
                for client in clients.values():
                    await client.aclose()
        audit.close_sync()


async def test_device_time_is_split_by_work_and_adds_up(
    served: tuple[Engine, AuditLog, dict[str, httpx.AsyncClient]],
) -> None:
    engine, audit, clients = served

    async def embed(tenant: str, texts: list[str]) -> float:
        r = await clients[tenant].post("/v1/embeddings", json={"model": "embed", "input": texts})
        assert r.status_code == 200, r.text
        return float(r.headers["x-device-seconds"])

    headers: dict[str, float] = {"three": 0.0, "one": 0.0, "long": 0.0}
    for _ in range(8):  # rounds of three, one and long sent together: shared batches
        sends = [("three", SHORT)] * 3 + [("one", SHORT), ("long", LONG)]
        seconds = await asyncio.gather(*(embed(t, texts) for t, texts in sends))
        for (tenant, _), s in zip(sends, seconds, strict=True):
            headers[tenant] += s
    await audit.flush()
    usage = {row["tenant"]: row for row in audit.usage(since=time.time() - 3600)}
    audited = {t: usage[t]["device_s"] for t in headers}
    assert audited == pytest.approx(headers, rel=1e-4)  # the header is what is audited
    assert audited["three"] / audited["one"] == pytest.approx(3.0, rel=0.1)
    assert audited["long"] / audited["one"] == pytest.approx(4.0, rel=0.2)  # per request
    # Every batch's run time is someone's, and nobody's twice.
    assert sum(audited.values()) == pytest.approx(engine.costs.device_s, rel=1e-6)
    snapshot = {c.tenant: c.device_s for c in engine.snapshot().tenant_costs}
    assert snapshot == pytest.approx(audited, rel=1e-6)


async def test_memory_goes_to_the_tenants_that_used_the_model(
    served: tuple[Engine, AuditLog, dict[str, httpx.AsyncClient]],
) -> None:
    engine, audit, clients = served
    record_memory(engine, engine.costs, audit)
    await asyncio.sleep(0.1)
    record_memory(engine, engine.costs, audit)  # held, and nobody has used it yet
    began = time.monotonic()
    for _ in range(3):
        await clients["three"].post("/v1/embeddings", json={"model": "embed", "input": SHORT})
    await clients["one"].post("/v1/embeddings", json={"model": "embed", "input": SHORT})
    record_memory(engine, engine.costs, audit)
    await asyncio.sleep(0.2)
    record_memory(engine, engine.costs, audit)
    held_s = time.monotonic() - began
    await audit.flush()
    usage = {row["tenant"]: row for row in audit.usage(since=time.time() - 3600)}
    assert usage[""]["byte_s"] > 0  # preloaded, before anyone used it: nobody's
    assert usage[""]["requests"] == 0
    # Shared as the model's use in the window: the device time each spent on it.
    memory_ratio = usage["three"]["byte_s"] / usage["one"]["byte_s"]
    assert memory_ratio == pytest.approx(usage["three"]["device_s"] / usage["one"]["device_s"])
    assert memory_ratio == pytest.approx(3.0, rel=0.5)
    held = next(m.bytes for m in engine.snapshot().models if m.name == "embed")
    attributed = usage["three"]["byte_s"] + usage["one"]["byte_s"]
    assert attributed == pytest.approx(held * held_s, rel=0.25)
    assert "long" not in usage
