"""A model a tenant may not use is answered as a model that does not exist,
on every face: the same status and the same body, so that a tenant cannot
enumerate other tenants' model names. The real app in-process over fake
models, with a real tenant store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from builders import fake_engine
from tessera.gateway import create_app
from tessera.tenants import TenantStore

MODELS = {
    "embed": {"task": "embedding", "preload": True},
    "secret": {"task": "embedding"},
    "secret-chat": {"task": "generate"},
}

TEXT = {"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["a"]}
# Each face's request naming model ``m``.
FACES: list[tuple[str, str, Any]] = [
    ("openai", "/v1/embeddings", lambda m: {"model": m, "input": "a"}),
    (
        "openai-chat",
        "/v1/chat/completions",
        lambda m: {"model": m, "messages": [{"role": "user", "content": "a"}]},
    ),
    ("cohere", "/v2/embed", lambda m: {"model": m, "texts": ["a"], "input_type": "search_query"}),
    ("ollama", "/api/embed", lambda m: {"model": m, "input": "a"}),
    ("ollama-load", "/api/generate", lambda m: {"model": m}),
    ("tei", "/tei/{model}/embed", lambda m: {"inputs": "a"}),
    ("kserve", "/v2/models/{model}/infer", lambda m: {"inputs": [TEXT]}),
]


# One app for the module: each request is refused before any model is asked.
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    tmp = tmp_path_factory.mktemp("hidden")
    with TenantStore(tmp / "data") as store:
        store.add_tenant("acme", models=["embed"])
        key = store.create_key("acme").key
        async with fake_engine(tmp / "repo", MODELS) as engine:
            transport = httpx.ASGITransport(app=create_app(engine, tenant_store=store))
            headers = {"authorization": f"Bearer {key}"}
            async with httpx.AsyncClient(
                transport=transport, base_url="http://t", headers=headers
            ) as client:
                yield client


@pytest.mark.parametrize(("face", "path", "body"), FACES, ids=[f[0] for f in FACES])
@pytest.mark.parametrize("hidden", ["secret", "secret-chat", "secret@1"])
async def test_a_hidden_model_is_answered_as_one_that_does_not_exist(
    client: httpx.AsyncClient, face: str, path: str, body: Any, hidden: str
) -> None:
    unknown = "nothing" + hidden.removeprefix("secret")
    answers = []
    for model in (hidden, unknown):
        r = await client.post(path.format(model=model), json=body(model))
        answers.append((r.status_code, r.text.replace(model.partition("@")[0], "MODEL")))
    assert answers[0] == answers[1]
    assert answers[0][0] == 404, answers
