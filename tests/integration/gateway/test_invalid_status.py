"""An invalid request is answered with the status its API's own servers
answer it with (``gateway/errors.py``): 400 on OpenAI's, Cohere's, KServe's,
Ollama's and DeepL's routes, whose clients raise their bad-request error for
it (``openai.BadRequestError``, not ``UnprocessableEntityError``); 422 on
TEI's, as TEI answers a body it cannot read, and on tessera's admin routes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest
import pytest_asyncio

NOT_JSON = b"{not json"
JSON = {"content-type": "application/json"}


# One engine for the module (``shared_client``): every request here is refused.
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def oai(shared_client: httpx.AsyncClient) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url="http://tessera/v1", api_key="none", http_client=shared_client, max_retries=0
    ) as oai:
        yield oai


async def test_the_openai_client_raises_bad_request_for_an_invalid_embeddings_request(
    oai: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError, match="dimensions") as invalid:
        await oai.embeddings.create(model="embed", input="x", dimensions=0)  # does not validate
    assert invalid.value.status_code == 400
    assert invalid.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="this model's embeddings have"):
        await oai.embeddings.create(model="embed", input="x", dimensions=10_000)  # the engine's


async def test_the_openai_client_raises_bad_request_for_an_invalid_chat_request(
    oai: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError, match="messages") as invalid:
        await oai.chat.completions.create(model="chat", messages=[])
    assert invalid.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="n"):
        await oai.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "x"}], n=17
        )


@pytest.mark.parametrize(
    ("path", "status", "body"),
    [
        (
            "/v1/embeddings",  # a fast route: the body goes on to FastAPI's validation
            400,
            {"type": "invalid_request_error", "code": 400},
        ),
        ("/v1/chat/completions", 400, {"type": "invalid_request_error", "code": 400}),
        ("/v2/rerank", 400, {"type": "invalid_request_error", "code": 400}),  # Cohere's
        ("/v1/ocr", 400, {"type": "invalid_request_error", "code": 400}),  # tessera's own
        ("/v2/models/embed/infer", 400, None),  # KServe's {"error": MESSAGE}
        ("/api/embed", 400, None),  # Ollama's, the same shape
        ("/tei/embed/embed", 422, "Validation"),  # TEI's, with its error_type
        ("/admin/models", 422, {"type": "invalid_request_error", "code": 422}),
    ],
)
async def test_a_body_that_is_not_json_gets_its_apis_status_and_shape(
    shared_client: httpx.AsyncClient, path: str, status: int, body: object
) -> None:
    r = await shared_client.post(path, content=NOT_JSON, headers=JSON)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    if isinstance(body, dict):
        assert {k: error[k] for k in body} == body
        assert error["message"]
    else:
        assert isinstance(error, str)
        assert error
    if body == "Validation":
        assert r.json()["error_type"] == "Validation"


async def test_deepls_invalid_request_is_its_400_bad_request(
    shared_client: httpx.AsyncClient,
) -> None:
    r = await shared_client.post("/v2/translate", json={"text": ["x"], "target_lang": 5})
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"message"}
