"""The live page's routes on the real app with a tenant store: the page and its
assets are public, the data behind them is not. (The browser test is
tests/e2e/test_dashboard.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tessera.engine import Engine
from tessera.gateway import create_app
from tessera.tenants import TenantStore


@pytest.fixture
async def client(engine: Engine, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    store = TenantStore(tmp_path / "tenants")
    app = create_app(engine, tenant_store=store)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
        yield client
    store.close()


async def test_page_and_assets_need_no_key(client: httpx.AsyncClient) -> None:
    r = await client.get("/dashboard")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert r.headers["x-request-id"]
    html = r.text
    assert 'data-testid="login-form"' in html
    assert 'href="dashboard/assets/dashboard.css"' in html
    assert 'src="dashboard/assets/dashboard.js"' in html
    css = await client.get("/dashboard/assets/dashboard.css")
    assert css.status_code == 200
    assert css.headers["content-type"].startswith("text/css")
    js = await client.get("/dashboard/assets/dashboard.js")
    assert js.status_code == 200
    assert js.headers["content-type"].startswith("text/javascript")
    assert "admin/residency" in js.text


@pytest.mark.parametrize(
    "path",
    [
        "/dashboard/assets/dashboard.html",
        "/dashboard/assets/nope.js",
        "/dashboard/assets/..%2fapp.py",
    ],
)
async def test_only_the_listed_assets_are_served(client: httpx.AsyncClient, path: str) -> None:
    assert (await client.get(path)).status_code == 404


@pytest.mark.parametrize("path", ["/admin/residency", "/admin/usage", "/dashboardx", "/v1/models"])
async def test_the_data_still_needs_a_key(client: httpx.AsyncClient, path: str) -> None:
    assert (await client.get(path)).status_code == 401
