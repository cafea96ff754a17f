"""TEI's API over fake models: a model per base URL under ``/tei/{model}``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest
import pytest_asyncio

from builders import fake_engine
from harness.fake_models import FAKE_DIMS, fake_embedding
from tessera.gateway import create_app
from tessera.repository import default_repository_path, read_spec
from tessera.runtimes.tokens import tokenizer_file


async def test_embed_a_text_or_a_list_normalized_or_not(shared_client: httpx.AsyncClient) -> None:
    r = await shared_client.post("/tei/embed/embed", json={"inputs": "a b"})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json(), [fake_embedding("a b")], rtol=1e-6)
    r = await shared_client.post(
        "/tei/embed/embed", json={"inputs": ["a", "b"], "normalize": False}
    )
    np.testing.assert_allclose(r.json(), [fake_embedding("a"), fake_embedding("b")], rtol=1e-6)
    r = await shared_client.post("/tei/embed/embed", json={"inputs": "c", "dimensions": 3})
    head = fake_embedding("c")[:3]
    np.testing.assert_allclose(r.json(), [head / np.linalg.norm(head)], rtol=1e-5)
    r = await shared_client.post("/tei/embed/embed", json={"inputs": "c", "truncate": True})
    assert np.asarray(r.json()).shape == (1, FAKE_DIMS)


async def test_rerank_gives_each_texts_index_and_score_best_first(
    shared_client: httpx.AsyncClient,
) -> None:
    texts = ["a", "b", "c"]
    body = {"query": "q", "texts": texts, "return_text": True}
    r = await shared_client.post("/tei/rerank/rerank", json=body)
    assert r.status_code == 200, r.text
    ranks = r.json()
    expected = [float(fake_embedding("q") @ fake_embedding(t)) for t in texts]
    assert sorted(rank["index"] for rank in ranks) == [0, 1, 2]
    assert [rank["score"] for rank in ranks] == sorted(expected, reverse=True)
    assert all(rank["text"] == texts[rank["index"]] for rank in ranks)
    r = await shared_client.post("/tei/rerank/rerank", json={"query": "q", "texts": texts})
    assert all("text" not in rank for rank in r.json())


async def test_predict_a_text_or_a_batch(shared_client: httpx.AsyncClient) -> None:
    r = await shared_client.post("/tei/intent/predict", json={"inputs": "hello"})
    assert r.status_code == 200, r.text
    assert r.json() == [{"score": 0.9, "label": "label-2"}, {"score": 0.1, "label": "other"}]
    r = await shared_client.post("/tei/intent/predict", json={"inputs": [["hello"], ["hey"]]})
    assert [labels[0]["label"] for labels in r.json()] == ["label-2", "label-0"]
    r = await shared_client.post("/tei/intent/predict", json={"inputs": ["hello"]})
    assert r.json()[0]["label"] == "label-2"  # one text in a list: one input, as TEI reads it


async def test_the_root_route_is_the_models_tasks(shared_client: httpx.AsyncClient) -> None:
    r = await shared_client.post("/tei/embed", json={"inputs": "a b"})
    np.testing.assert_allclose(r.json(), [fake_embedding("a b")], rtol=1e-6)
    r = await shared_client.post("/tei/rerank/", json={"query": "q", "texts": ["a"]})
    assert r.json()[0]["index"] == 0
    r = await shared_client.post("/tei/intent/invocations", json={"inputs": "hello"})
    assert r.json()[0]["label"] == "label-2"


async def test_info_and_health(shared_client: httpx.AsyncClient) -> None:
    r = await shared_client.get("/tei/embed/info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["model_id"] == "embed"
    assert "embedding" in info["model_type"]
    assert info["max_client_batch_size"] >= 1
    assert "reranker" in (await shared_client.get("/tei/rerank/info")).json()["model_type"]
    assert (await shared_client.get("/tei/intent/health")).status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "says"),
    [
        ("POST", "/tei/intent/predict", {"inputs": ["a", "b"]}, 422, "text pairs"),
        ("POST", "/tei/intent/predict", {"inputs": [["a", "b", "c"]]}, 422, "a batch of"),
        ("POST", "/tei/intent/predict", {"inputs": "a", "raw_scores": True}, 422, "raw scores"),
        (
            "POST",
            "/tei/rerank/rerank",
            {"query": "q", "texts": ["a"], "raw_scores": True},
            422,
            "raw",
        ),
        ("POST", "/tei/embed/embed", {"inputs": "a", "prompt_name": "query"}, 422, "prompts"),
        ("POST", "/tei/embed/embed", {"inputs": ["x"] * 5}, 413, "at most 4"),
        ("POST", "/tei/embed/embed", {"inputs": [""]}, 422, "empty"),
        ("POST", "/tei/rerank/rerank", {"query": " ", "texts": ["a"]}, 422, "blank"),
        ("POST", "/tei/embed/rerank", {"query": "q", "texts": ["a"]}, 400, "embedding"),
        ("POST", "/tei/embed", {"texts": ["a"]}, 422, "inputs"),
        ("POST", "/tei/chat", {"inputs": "a"}, 400, "not a TEI task"),
        ("GET", "/tei/chat/info", None, 400, "not a TEI task"),
        ("GET", "/tei/nope/health", None, 404, "nope"),
    ],
)
async def test_errors_read_as_teis(
    shared_client: httpx.AsyncClient,
    method: str,
    path: str,
    body: object,
    status: int,
    says: str,
) -> None:
    r = await shared_client.request(method, path, json=body)
    assert r.status_code == status, r.text
    error = r.json()
    assert set(error) == {"error", "error_type"}
    assert says in error["error"]
    assert error["error_type"] == "Validation"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def minilm_client(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[httpx.AsyncClient]:
    """The app over a fake embedding model reading MiniLM's ``tokenizer.json``
    (one for the module: tokenizing and decoding leave nothing behind)."""
    path = tokenizer_file(read_spec(default_repository_path() / "all-minilm-l6-v2"))
    assert path is not None
    models = {"tok": {"task": "embedding", "options": {"tokenizer": str(path.parent)}}}
    async with fake_engine(tmp_path_factory.mktemp("tok") / "repo", models) as engine:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
            yield client


async def test_tokenize_as_tei_does(minilm_client: httpx.AsyncClient) -> None:
    r = await minilm_client.post("/tei/tok/tokenize", json={"inputs": "Hello world"})
    assert r.status_code == 200, r.text
    assert r.json() == [
        [
            {"id": 101, "special": True, "text": "[CLS]", "start": None, "stop": None},
            {"id": 7592, "special": False, "text": "Hello", "start": 0, "stop": 5},
            {"id": 2088, "special": False, "text": "world", "start": 6, "stop": 11},
            {"id": 102, "special": True, "text": "[SEP]", "start": None, "stop": None},
        ]
    ]
    long = " ".join(["word"] * 600)  # past the model's window: not truncated here
    body = {"inputs": ["a", long], "add_special_tokens": False}
    a, many = (await minilm_client.post("/tei/tok/tokenize", json=body)).json()
    assert [t["text"] for t in a] == ["a"]
    assert len(many) == 600


async def test_decode_as_tei_does(minilm_client: httpx.AsyncClient) -> None:
    r = await minilm_client.post("/tei/tok/decode", json={"ids": [101, 7592, 2088, 102]})
    assert r.json() == ["hello world"]
    body = {"ids": [[101, 7592, 102], [2088]], "skip_special_tokens": False}
    assert (await minilm_client.post("/tei/tok/decode", json=body)).json() == [
        "[CLS] hello [SEP]",
        "world",
    ]
    r = await minilm_client.post("/tei/tok/decode", json={"ids": [7592, 10**9]})
    assert r.status_code == 422
    assert r.json()["error_type"] == "Validation"


async def test_a_model_without_a_tokenizer_says_so(shared_client: httpx.AsyncClient) -> None:
    r = await shared_client.post("/tei/embed/tokenize", json={"inputs": "a"})
    assert r.status_code == 422
    assert "no tokenizer.json" in r.json()["error"]
