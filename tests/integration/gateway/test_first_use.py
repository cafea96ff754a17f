"""What a new user meets first, on the real app over fake models: a model of
Triton-style version folders is listed on every face that lists models, a
card's misspelt key is a 422 that names it, and a JSON body is read whatever
its content type."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import yaml

from builders import fake_engine, write_fake_repository
from tessera.engine import Engine
from tessera.gateway import create_app

MODELS = {
    "plain": {"task": "embedding"},
    "chat": {"task": "generate"},
    "rerank": {"task": "rerank"},
}


@contextlib.asynccontextmanager
async def served(tmp: Path) -> AsyncIterator[tuple[Engine, httpx.AsyncClient]]:
    """An engine over ``MODELS`` and ``ver``, and a client of its app."""
    root = tmp / "repo"
    # ``ver`` is served from its version folder 1 (where the fake needs no weights).
    write_fake_repository(root, {"ver": {"task": "embedding", "preload": True}})
    (root / "ver" / "1").mkdir()
    async with fake_engine(root, MODELS) as engine:
        app = create_app(engine, model_roots=[tmp])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
            yield engine, client


@pytest.fixture
async def served_here(tmp_path: Path) -> AsyncIterator[tuple[Engine, httpx.AsyncClient]]:
    async with served(tmp_path) as both:
        yield both


@pytest.fixture
def engine(served_here: tuple[Engine, httpx.AsyncClient]) -> Engine:
    return served_here[0]


@pytest.fixture
def client(served_here: tuple[Engine, httpx.AsyncClient]) -> httpx.AsyncClient:
    return served_here[1]


# One app for the module's requests that leave nothing behind (the bodies read).
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_client(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[httpx.AsyncClient]:
    async with served(tmp_path_factory.mktemp("bodies")) as (_, client):
        yield client


async def test_a_model_of_version_folders_is_listed_on_every_face(
    engine: Engine, client: httpx.AsyncClient
) -> None:
    assert engine.versions("ver")[0].key == "ver@1"
    listed = (await client.get("/v1/models")).json()["data"]
    assert [m["id"] for m in listed] == ["chat", "plain", "rerank", "ver"]
    one = await client.get("/v1/models/ver")
    assert one.status_code == 200, one.text
    assert (one.json()["id"], one.json()["state"]) == ("ver", "ready")
    assert (await client.get("/v1/models/ver@1")).json()["id"] == "ver@1"
    assert (await client.get("/v1/models/ver@2")).status_code == 404

    index = (await client.post("/v2/repository/index")).json()
    assert {"name": "ver", "version": "1", "state": "READY"} in index
    assert [m["name"] for m in index] == ["chat", "plain", "rerank", "ver"]
    ready = (await client.post("/v2/repository/index", json={"ready": True})).json()
    assert [m["name"] for m in ready] == ["ver"]
    metadata = (await client.get("/v2/models/ver")).json()
    assert (metadata["name"], metadata["versions"]) == ("ver", ["1"])

    tags = {m["name"]: m for m in (await client.get("/api/tags")).json()["models"]}
    assert sorted(tags) == ["chat", "plain", "rerank", "ver"]
    assert tags["ver"]["size"] == 1000  # measured, as a model without version folders


async def test_a_cards_misspelt_key_is_a_422_naming_it(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    folder = tmp_path / "repo" / "typo"
    folder.mkdir()
    card = {
        "task": "embedding",
        "runtime": "torch",
        "adapter": "fake",
        "batching": {"max_bach_size": 4},
    }
    (folder / "model.yaml").write_text(yaml.safe_dump(card))
    response = await client.post("/admin/models", json={"path": str(folder)})
    assert response.status_code == 422, response.text
    message = response.json()["error"]["message"]
    assert "batching: unknown key 'max_bach_size'; did you mean 'max_batch_size'?" in message

    card = {
        "task": "embedding",
        "runtime": "torch",
        "adapter": "hf-encoder",
        "options": {"poolin": 1},
    }
    (folder / "model.yaml").write_text(yaml.safe_dump(card))
    response = await client.post("/admin/models", json={"path": str(folder)})
    assert response.status_code == 422, response.text
    assert "did you mean 'pooling'?" in response.json()["error"]["message"]
    assert (await client.get("/v1/models/typo")).status_code == 404


ROUTES = [
    ("/v1/embeddings", {"model": "plain", "input": "hi"}),
    ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": "chat", "prompt": "hi"}),
    ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["a", "b"]}),
    ("/v2/embed", {"model": "plain", "texts": ["hi"], "input_type": "search_query"}),
    ("/tei/plain/embed", {"inputs": "hi"}),
    ("/api/embed", {"model": "plain", "input": "hi"}),
]


@pytest.mark.parametrize(("path", "body"), ROUTES)
@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "application/json"]
)
async def test_a_json_body_is_read_whatever_its_content_type(
    shared_client: httpx.AsyncClient, path: str, body: dict[str, object], content_type: str | None
) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    response = await shared_client.post(path, content=json.dumps(body).encode(), headers=headers)
    assert response.status_code == 200, response.text


async def test_a_body_that_is_not_json_is_still_refused(shared_client: httpx.AsyncClient) -> None:
    response = await shared_client.post(
        "/v1/embeddings", content=b"model=plain&input=hi", headers={"content-type": "text/plain"}
    )
    assert response.status_code == 400, response.text
