"""The server's own OpenAPI spec, fuzzed by schemathesis against a real server
process over fake models of every task: no input it generates, valid or not,
gets a 5xx, and every error with a body is JSON. Bounded for CI by
``MAX_EXAMPLES`` per operation and mode (about a minute on two cores). KServe
infer reads its raw body, which the spec does not describe: hypothesis throws
malformed headers and tensors at the real route (``kserve_bodies``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis
import hypothesis.strategies as st
import numpy as np
import openai
import pytest
import schemathesis
import tritonclient.http as triton
import yaml
from schemathesis import GenerationMode
from tritonclient.utils import InferenceServerException

from builders import write_fake_repository
from serverproc import Server, start_server, stop_server
from tessera.tenants import TenantStore

MAX_EXAMPLES = 40
MODELS: dict[str, dict[str, Any]] = {
    "embed": {"task": "embedding", "preload": True},
    "rerank": {"task": "rerank"},
    "intent": {"task": "classify"},
    "ocr": {"task": "ocr"},
    "tts": {"task": "tts"},
    "mt": {"task": "translate"},
    "chat": {"task": "generate", "options": {"max_tokens_limit": 256}},
    "strict": {"task": "embedding", "options": {"truncate": False, "max_length": 64}},
}


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("schemathesis")
    with TenantStore(tmp / "data") as store:
        store.add_tenant("fuzz", tier="standard")
        key = store.create_key("fuzz", admin=True).key
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "include_default_models": False,
                "model_repositories": [str(write_fake_repository(tmp / "repo", MODELS))],
                "preload": ["embed"],
            }
        )
    )
    process, server = start_server(tmp, "--config", str(config), key=key)
    try:
        yield server
    finally:
        stop_server(process)
        assert "Traceback" not in server.log_path.read_text(errors="replace")


def fuzz(server: Server, operation: Any, mode: GenerationMode) -> list[str]:
    """Calls of ``operation`` answered 5xx (or a non-JSON error), as curl commands."""
    failures: list[str] = []

    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis.settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        database=None,
        phases=[hypothesis.Phase.generate],
    )
    def call(case: schemathesis.Case) -> None:
        response = case.call(base_url=server.base_url, headers=server.headers, timeout=30)
        error = response.status_code >= 400
        json_body = "application/json" in str(response.headers.get("content-type"))
        if response.status_code >= 500 or (error and response.content and not json_body):
            failures.append(f"{response.status_code} {case.as_curl_command()[:300]}")

    with contextlib.suppress(hypothesis.errors.Unsatisfiable):
        call()  # an operation without inputs has nothing to make invalid
    return failures


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_input_gets_a_server_error(
    fuzzed_server: Server, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.base_url}/openapi.json")
    failures: list[str] = []
    num_operations = 0
    for result in schema.get_all_operations():
        num_operations += 1
        failures += fuzz(fuzzed_server, result.ok(), mode)
    assert num_operations >= 20  # every route of the spec was fuzzed
    assert failures == []


def json_values(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=max_leaves,
    )


def kserve_tensors() -> st.SearchStrategy[Any]:
    """Tensors that are nearly right: each field valid or anything."""
    return st.fixed_dictionaries(
        {},
        optional={
            "name": st.just("TEXT") | json_values(),
            "datatype": st.sampled_from(["BYTES", "FP32"]) | json_values(),
            "shape": st.lists(st.integers(-2, 4), max_size=3) | json_values(),
            "data": st.lists(st.text(max_size=5) | json_values(), max_size=4) | json_values(),
            "parameters": st.fixed_dictionaries({}, optional={"binary_data_size": json_values()})
            | json_values(),
        },
    )


def kserve_bodies() -> st.SearchStrategy[tuple[bytes, str | None]]:
    header = st.fixed_dictionaries(
        {},
        optional={
            "id": json_values(),
            "inputs": st.lists(kserve_tensors(), max_size=2) | json_values(),
            "outputs": st.lists(
                st.fixed_dictionaries(
                    {"name": st.sampled_from(["EMBEDDING", "X"]) | json_values()}
                ),
                max_size=2,
            )
            | json_values(),
            "parameters": json_values(),
        },
    )
    encoded = header.map(lambda h: json.dumps(h).encode())
    raw = st.binary(max_size=64)
    body = st.tuples(encoded, raw).map(lambda p: p[0] + p[1]) | encoded | raw
    length = (
        st.none()
        | st.integers(-5, 200).map(str)
        | st.text(alphabet="0123456789abc-+.e_", min_size=1, max_size=4)
    )
    return st.tuples(body, length)


def test_malformed_kserve_bodies_get_4xx_json_from_the_real_route(fuzzed_server: Server) -> None:
    failures: list[str] = []

    @hypothesis.given(kserve_bodies())
    @hypothesis.settings(
        max_examples=4 * MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        database=None,
    )
    def call(request: tuple[bytes, str | None]) -> None:
        body, length = request
        headers = dict(fuzzed_server.headers)
        if length is not None:
            headers["inference-header-content-length"] = length
        r = httpx.post(
            f"{fuzzed_server.base_url}/v2/models/embed/infer", content=body, headers=headers
        )
        if r.status_code < 400:
            return
        is_json = "application/json" in r.headers["content-type"]
        if r.status_code >= 500 or not is_json or "error" not in r.json():
            failures.append(f"{r.status_code} {body[:200]!r} {length!r} {r.text[:200]}")

    call()
    assert failures == []


def test_openai_client_long_input_is_served_to_the_window_and_strict_cards_refuse_it(
    fuzzed_server: Server,
) -> None:
    with openai.OpenAI(
        base_url=f"{fuzzed_server.base_url}/v1", api_key=fuzzed_server.key, max_retries=0
    ) as client:
        chunk = "word " * 1600  # a 1,600-word RAG chunk, about 2,000 tokens
        served = client.embeddings.create(model="embed", input=[chunk])
        with pytest.raises(openai.APIStatusError) as refused:
            client.embeddings.create(model="strict", input=["short", chunk])
    assert len(served.data) == 1
    assert served.usage.prompt_tokens == 512  # charged to the window, as it ran
    assert refused.value.status_code == 413
    assert "window of 64 tokens" in str(refused.value)
    assert "input[1]" in str(refused.value)


def test_openai_client_gets_bad_request_for_an_invalid_request(fuzzed_server: Server) -> None:
    """OpenAI answers an invalid request 400, which the client raises as
    ``BadRequestError``; so does tessera, on the fast route too. TEI's route
    answers 422, as TEI does."""
    with openai.OpenAI(
        base_url=f"{fuzzed_server.base_url}/v1", api_key=fuzzed_server.key, max_retries=0
    ) as client:
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            client.embeddings.create(model="embed", input="x", dimensions=0)
        with pytest.raises(openai.BadRequestError, match="limit"):
            client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "x"}], max_tokens=300
            )
        with pytest.raises(openai.BadRequestError, match="messages"):
            client.chat.completions.create(model="chat", messages=[])
    headers = {**fuzzed_server.headers, "content-type": "application/json"}
    with httpx.Client(base_url=fuzzed_server.base_url, headers=headers, timeout=30) as http:
        for path in ("/v1/embeddings", "/v1/chat/completions"):
            r = http.post(path, content=b"{not json")
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", 400)
            assert error["message"].startswith("invalid request: ")
        r = http.post("/tei/embed/embed", content=b"{not json")
        assert r.status_code == 422, r.text
        assert r.json()["error_type"] == "Validation"


def test_triton_client_gets_4xx_for_a_shape_that_disagrees_with_its_data(
    fuzzed_server: Server, request: pytest.FixtureRequest
) -> None:
    client = triton.InferenceServerClient(fuzzed_server.base_url.removeprefix("http://"))
    request.addfinalizer(client.close)
    text = triton.InferInput("TEXT", [2], "BYTES")
    text.set_data_from_numpy(np.array([b"a", b"b"], dtype=object), binary_data=False)
    text.set_shape([3])  # the client checks the shape at set_data; the server must too
    with pytest.raises(InferenceServerException) as refused:
        client.infer("embed", [text], headers=fuzzed_server.headers)
    assert "shape [3] (3 elements) but 2 strings" in str(refused.value)
    assert refused.value.status() == "400"  # tritonclient gives the status as a string
    good = triton.InferInput("TEXT", [2], "BYTES")
    good.set_data_from_numpy(np.array([b"a", b"b"], dtype=object))
    result = client.infer("embed", [good], headers=fuzzed_server.headers)
    assert result.as_numpy("EMBEDDING").shape[0] == 2
