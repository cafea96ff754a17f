"""Triton's model repository extension, loads and unloads
(``gateway/kserve_repository.py``), for admin keys only (over gRPC:
``test_grpc_kserve.py``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tessera.engine import Engine
from tessera.gateway import create_app
from tessera.tenants import TenantStore


async def states(client: httpx.AsyncClient) -> dict[str, str]:
    index = (await client.post("/v2/repository/index")).json()
    return {entry["name"]: entry["state"] for entry in index}


async def test_load_makes_a_model_resident_and_unload_evicts_it(
    client: httpx.AsyncClient,
) -> None:
    assert "model_repository" in (await client.get("/v2")).json()["extensions"]
    assert (await states(client))["mt"] == "UNAVAILABLE"
    r = await client.post("/v2/repository/models/mt/load", content=b"{}")
    assert (r.status_code, r.json()) == (200, {})
    assert (await states(client))["mt"] == "READY"
    body = {"parameters": {"unload_dependents": False}}  # tritonclient's unload_model body
    r = await client.post("/v2/repository/models/mt/unload", json=body)
    assert r.status_code == 200, r.text
    assert (await states(client))["mt"] == "UNAVAILABLE"
    # Unloaded, it is still served: its next request loads it again.
    text = {"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["ab"]}
    r = await client.post("/v2/models/mt/infer", json={"inputs": [text]})
    assert r.json()["outputs"][0]["data"] == ["ba"]


@pytest.mark.parametrize(
    ("action", "body", "status", "says"),
    [
        ("load", {"parameters": {"config": "{}"}}, 400, "load takes no parameters"),
        ("load", {"parameters": {"file:1/model.onnx": "AAAA"}}, 400, "card"),
        ("unload", {"parameters": {"force": True}}, 400, "unload_dependents alone"),
        ("load", {"model": "mt"}, 400, "empty"),
        ("load", [1], 400, "empty"),
        ("load", {"parameters": 3}, 400, "parameters must be a JSON object"),
    ],
)
async def test_what_a_load_or_unload_cannot_take_says_why(
    shared_client: httpx.AsyncClient, action: str, body: object, status: int, says: str
) -> None:
    r = await shared_client.post(f"/v2/repository/models/mt/{action}", json=body)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]


async def test_unknown_or_failing_models_are_errors_in_kserves_shape(
    shared_client: httpx.AsyncClient,
) -> None:
    r = await shared_client.post("/v2/repository/models/nope/load")
    assert (r.status_code, r.json()) == (404, {"error": "model 'nope' not found"})
    r = await shared_client.post("/v2/repository/models/nope/unload")
    assert r.status_code == 404
    r = await shared_client.post("/v2/repository/models/broken/load")
    assert r.status_code == 503
    assert isinstance(r.json()["error"], str)
    r = await shared_client.post("/v2/repository/models/mt/load", content=b"{nope")
    assert (r.status_code, r.json()) == (400, {"error": "the body is not valid JSON"})


async def test_loads_and_unloads_need_an_admin_key(engine: Engine, tmp_path: Path) -> None:
    with TenantStore(tmp_path / "tenants") as store:
        store.add_tenant("ops")
        store.add_tenant("acme")
        admin = {"authorization": f"Bearer {store.create_key('ops', admin=True).key}"}
        user = {"authorization": f"Bearer {store.create_key('acme').key}"}
        app = create_app(engine, tenant_store=store)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
            for action in ("load", "unload"):
                path = f"/v2/repository/models/mt/{action}"
                r = await client.post(path, headers=user)
                assert (r.status_code, r.json()) == (
                    403,
                    {"error": "this route needs an admin key"},
                )
                assert (await client.post(path, headers=admin)).status_code == 200
