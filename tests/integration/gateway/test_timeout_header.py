"""An ``x-request-timeout`` that is not a positive, finite number of seconds
is the request's error, a JSON 400 naming the header (it was ignored: the
request ran without the deadline its caller meant). The real app in-process
over a fake model."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from builders import fake_engine
from tessera.gateway import create_app

TEXT = {"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["a"]}
ROUTES = [
    ("/v1/embeddings", {"model": "embed", "input": "a"}),
    ("/v2/models/embed/infer", {"inputs": [TEXT]}),
    ("/api/embed", {"model": "embed", "input": "a"}),
]


# One engine for the module: every request here is answered alone.
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    root = tmp_path_factory.mktemp("timeout") / "repo"
    async with fake_engine(root, {"embed": {"task": "embedding"}}) as engine:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            yield client


@pytest.mark.parametrize("value", ["nan", "-1", "0", "1e400", "inf", "soon"])
@pytest.mark.parametrize(("path", "body"), ROUTES, ids=[r[0] for r in ROUTES])
async def test_a_bad_timeout_header_is_a_400_naming_it(
    client: httpx.AsyncClient, path: str, body: object, value: str
) -> None:
    r = await client.post(path, json=body, headers={"x-request-timeout": value})
    assert r.status_code == 400, r.text
    assert "x-request-timeout" in r.text
    r.json()


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=[r[0] for r in ROUTES])
async def test_a_good_timeout_header_is_served(
    client: httpx.AsyncClient, path: str, body: object
) -> None:
    r = await client.post(path, json=body, headers={"x-request-timeout": "30"})
    assert r.status_code == 200, r.text
