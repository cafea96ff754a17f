"""DeepL's translation API over fake translate models: the model is chosen by
its card's direction; JSON and form bodies; DeepL's answers and errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from builders import fake_engine
from tessera.gateway import create_app
from tessera.gateway.context import api_key
from tessera.tenants import TenantStore

MODELS = {
    "en-pt": {"task": "translate", "options": {"direction": "en-pt"}},
    "pt-en": {"task": "translate", "options": {"direction": "pt-en"}},
    "de-en": {"task": "translate", "options": {"direction": "de-en"}},
    "plain-mt": {"task": "translate"},
    "embed": {"task": "embedding"},
}


# One engine for the module: no tenants, so a request leaves no usage behind.
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    async with fake_engine(tmp_path_factory.mktemp("deepl") / "repo", MODELS) as engine:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
            yield client


async def test_the_target_language_picks_the_model(client: httpx.AsyncClient) -> None:
    r = await client.post("/v2/translate", json={"text": ["abc", "de"], "target_lang": "PT-BR"})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "translations": [
            {"detected_source_language": "EN", "text": "cba", "billed_characters": 3},
            {"detected_source_language": "EN", "text": "ed", "billed_characters": 2},
        ]
    }
    form = {"text": ["xy", "z"], "target_lang": "EN-US", "source_lang": "PT"}
    r = await client.post("/v2/translate", data=form)
    assert [t["text"] for t in r.json()["translations"]] == ["yx", "z"]
    assert r.json()["translations"][0]["detected_source_language"] == "PT"
    r = await client.post(
        "/v2/translate", json={"text": ["ab"], "target_lang": "EN", "model": "de-en"}
    )
    assert r.json()["translations"][0]["detected_source_language"] == "DE"


async def test_usage_without_keys_is_no_tenants_none_used_no_limit(
    client: httpx.AsyncClient,
) -> None:
    r = await client.get("/v2/usage")
    assert r.json() == {"character_count": 0, "character_limit": 10**12}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"text": ["a"], "target_lang": "EN-GB"}, "several models translate into en (de, pt)"),
        ({"text": ["a"], "target_lang": "FR"}, "no model translates from any language into fr"),
        ({"text": ["a"], "target_lang": "PT", "source_lang": "DE"}, "from de into pt"),
        ({"text": ["a"], "target_lang": "PT", "model": "embed"}, "does not translate"),
        ({"text": ["a"], "target_lang": "PT", "model": "plain-mt"}, "does not translate"),
        ({"text": [], "target_lang": "PT"}, "text"),
        ({"text": [""], "target_lang": "PT"}, "empty"),
        ({"text": ["a"]}, "target_lang"),
        ({"text": ["a"], "target_lang": "PT", "glossary_id": "g"}, "glossaries"),
        ({"text": ["a"], "target_lang": "PT", "tag_handling": "xml"}, "plain text"),
    ],
)
async def test_errors_read_as_deepls(
    client: httpx.AsyncClient, body: dict[str, object], says: str
) -> None:
    r = await client.post("/v2/translate", json=body)
    assert 400 <= r.status_code < 500, r.text
    assert list(r.json()) == ["message"]
    assert says in r.json()["message"]


async def test_languages_read_and_written(client: httpx.AsyncClient) -> None:
    r = await client.get("/v2/languages")
    assert r.json() == [
        {"language": "DE", "name": "German"},
        {"language": "EN", "name": "English"},
        {"language": "PT", "name": "Portuguese"},
    ]
    targets = (await client.get("/v2/languages", params={"type": "target"})).json()
    assert [t["language"] for t in targets] == ["EN", "PT"]
    assert all(t["supports_formality"] is False for t in targets)
    # DeepL's client sends a GET's type in a form body.
    r = await client.request("GET", "/v2/languages", data={"type": "target"})
    assert r.json() == targets
    assert (await client.get("/v2/languages", params={"type": "x"})).status_code == 400


def test_deepls_key_scheme_is_a_key() -> None:
    assert api_key([(b"authorization", b"DeepL-Auth-Key tsk_1")]) == "tsk_1"
    assert api_key([(b"authorization", b"Bearer tsk_2")]) == "tsk_2"
    assert api_key([(b"authorization", b"Basic abc")]) is None


async def test_a_refused_key_is_403_and_a_used_up_quota_456_as_deepl_answers(
    tmp_path: Path,
) -> None:
    # DeepL's clients act on these: AuthorizationException, QuotaExceededException
    # (a 429 the Python client retried for 16 s before it gave up).
    with TenantStore(tmp_path / "data") as store:
        store.add_tenant("small", daily_units=5)
        key = store.create_key("small").key
        async with fake_engine(tmp_path / "repo", MODELS) as engine:
            app = create_app(engine, tenant_store=store)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                body = {"text": ["abc"], "target_lang": "PT-BR"}
                bad = {"Authorization": "DeepL-Auth-Key tsk_not_a_key"}
                r = await client.post("/v2/translate", json=body, headers=bad)
                assert r.status_code == 403, r.text
                good = {"Authorization": f"DeepL-Auth-Key {key}"}
                r = await client.post("/v2/translate", json=body, headers=good)
                assert r.status_code == 200, r.text  # 3 of its 5 characters
                r = await client.post("/v2/translate", json=body, headers=good)
                assert r.status_code == 456, r.text
                assert "daily quota" in r.json()["message"]
                r = await client.post(  # elsewhere a quota is 429, a key 401
                    "/v1/translate", json={"model": "en-pt", "input": "abc"}, headers=good
                )
                assert r.status_code == 429
