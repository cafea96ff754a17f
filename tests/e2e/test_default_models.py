"""Acceptance: the real server, real default models, real clients, every task."""

from __future__ import annotations

import base64
import io
import json
import queue
import time
import wave
from collections.abc import Iterator
from typing import Any

import cohere
import deepl
import httpx
import numpy as np
import ollama
import openai
import pydantic
import pytest
import soundfile
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from builders import WEATHER_TOOL
from serverproc import Server
from tessera.tasks.samples import sample_page

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def oai(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=server.key, max_retries=0
    ) as client:  # its pooled connections closed, not left to the collector
        yield client


def cosine(a: list[float], b: list[float]) -> float:
    x, y = np.asarray(a), np.asarray(b)
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


def test_openai_client_embeddings(oai: openai.OpenAI) -> None:
    response = oai.embeddings.create(
        model="all-minilm-l6-v2",
        input=["A man is eating food.", "A man is eating a meal.", "The stock market fell."],
    )
    vectors = [d.embedding for d in response.data]
    assert len(vectors[0]) == 384
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.3
    int8 = oai.embeddings.create(model="all-minilm-l6-v2-int8", input="A man is eating food.")
    assert cosine(int8.data[0].embedding, vectors[0]) > 0.99


def test_openai_client_chat_plain_and_streaming(oai: openai.OpenAI) -> None:
    # At Q4_1 (llama.cpp) "What is the capital of France?" is a near tie of "The" and "L'".
    messages = [{"role": "user", "content": "Which city is the capital of France?"}]
    response = oai.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=16, temperature=0
    )
    text = response.choices[0].message.content or ""
    assert "Paris" in text
    assert response.usage is not None
    assert response.usage.completion_tokens > 0
    stream = oai.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=16, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces) == text
    # Asked for, the usage comes in a last chunk of no choices.
    chunks = list(
        oai.chat.completions.create(
            model="smollm2-135m",
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage == response.usage
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_openai_client_logprobs_plain_and_streamed(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Which city is the capital of France?"}]
    asked = {"max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    response = oai.chat.completions.create(model="smollm2-135m", messages=messages, **asked)
    choice = response.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.content
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    stream_chunks = [
        chunk.choices[0]
        for chunk in oai.chat.completions.create(
            model="smollm2-135m", messages=messages, stream=True, **asked
        )
        if chunk.choices
    ]
    streamed = [
        token for chunk in stream_chunks if chunk.logprobs for token in chunk.logprobs.content or []
    ]
    assert [t.token for t in streamed] == [t.token for t in choice.logprobs.content]
    with_logprobs = [chunk for chunk in stream_chunks if chunk.logprobs]
    assert len(with_logprobs) > 1  # each with its piece, not all with the last chunk
    # logprobs alone, no alternatives asked for: each token's own.
    alone = oai.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=3, temperature=0, logprobs=True
    ).choices[0]
    assert alone.logprobs is not None
    assert alone.logprobs.content
    assert [t.token for t in alone.logprobs.content] == [
        t.token for t in choice.logprobs.content[:3]
    ]
    assert all(t.top_logprobs == [] for t in alone.logprobs.content)


def test_openai_client_json_answers(oai: openai.OpenAI) -> None:
    response = oai.chat.completions.create(
        model="smollm2-135m",
        messages=[
            {
                "role": "user",
                "content": "Which city is the capital of France? Answer in JSON with the key city.",
            }
        ],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert json.loads(response.choices[0].message.content or "")["city"] == "Paris"


def test_openai_client_tool_calls(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    response = oai.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=128,  # room for the JSON and its whitespace (one call: ~47 tokens)
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or ()
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert list(json.loads(call.function.arguments)) == ["city"]


class City(pydantic.BaseModel):
    city: str


def test_openai_client_responses_whole_streamed_parsed_and_calling(oai: openai.OpenAI) -> None:
    ask: dict[str, Any] = {
        "model": "smollm2-135m",
        "input": "Which city is the capital of France?",
        "max_output_tokens": 16,
        "temperature": 0,
    }
    response = oai.responses.create(**ask)
    assert "Paris" in response.output_text
    assert response.usage is not None
    assert response.usage.output_tokens > 0
    with oai.responses.stream(**ask) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == response.output_text
    assert len(deltas) > 2
    # Each token's log probability, asked for with include.
    scored = oai.responses.create(
        **{**ask, "max_output_tokens": 4},
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    (message,) = scored.output
    assert message.type == "message"
    (part,) = message.content
    assert part.type == "output_text"
    assert part.logprobs
    assert "".join(t.token for t in part.logprobs) == part.text
    assert all(len(t.top_logprobs) == 2 for t in part.logprobs)
    # JSON of a schema, read back by the client (text.format json_schema).
    parsed = oai.responses.parse(
        **{**ask, "max_output_tokens": 64, "input": f"{ask['input']} Answer in JSON."},
        text_format=City,
    )
    assert parsed.output_parsed is not None
    assert parsed.output_parsed.city == "Paris"
    # A call (the Responses API's flat tool form), and the answer to its output.
    function = WEATHER_TOOL["function"]
    called = oai.responses.create(
        **{**ask, "input": "What is the weather in Paris?", "max_output_tokens": 128},
        tools=[{"type": "function", **function, "strict": True}],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    (call,) = called.output
    assert call.type == "function_call"
    assert call.name == "get_weather"
    assert list(json.loads(call.arguments)) == ["city"]


def test_openai_client_legacy_completions(oai: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    response = oai.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=6, temperature=0
    )
    text = response.choices[0].text
    assert text.startswith(" Paris")
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (5, 6)
    assert response.choices[0].finish_reason == "length"
    stream = oai.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == text
    # Each token's logprob and its likeliest alternatives, in the legacy form.
    scored = oai.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=6, temperature=0, logprobs=2
    ).choices[0]
    assert scored.text == text
    assert scored.logprobs is not None
    tokens = scored.logprobs.tokens or []
    assert "".join(tokens) == text
    assert scored.logprobs.text_offset == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert all(lp <= 0 for lp in scored.logprobs.token_logprobs or [])
    tops = scored.logprobs.top_logprobs or []
    assert [len(top) for top in tops] == [2] * len(tokens)
    assert all(token in top for token, top in zip(tokens, tops, strict=True))  # greedy
    streamed = [
        chunk.choices[0].logprobs
        for chunk in oai.completions.create(
            model="smollm2-135m",
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            logprobs=2,
            stream=True,
        )
        if chunk.choices and chunk.choices[0].logprobs
    ]
    assert len(streamed) > 1  # with their pieces, not all with the last chunk
    assert [token for s in streamed for token in s.tokens or []] == tokens
    assert [at for s in streamed for at in s.text_offset or []] == scored.logprobs.text_offset


def test_openai_client_models(oai: openai.OpenAI) -> None:
    listed = {m.id for m in oai.models.list().data}
    assert "all-minilm-l6-v2" in listed
    assert oai.models.retrieve("all-minilm-l6-v2").id == "all-minilm-l6-v2"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_tritonclient_infer_embedding(server: Server, request: pytest.FixtureRequest) -> None:
    client = triton_http.InferenceServerClient(url=f"127.0.0.1:{server.port}")
    request.addfinalizer(client.close)
    headers = server.headers
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("all-minilm-l6-v2", headers=headers)
    texts = np.array([b"hello world", b"good morning"], dtype=object)
    tensor = triton_http.InferInput("TEXT", [2], "BYTES")
    tensor.set_data_from_numpy(texts)
    result = client.infer(
        "all-minilm-l6-v2",
        [tensor],
        outputs=[triton_http.InferRequestedOutput("EMBEDDING")],
        headers=headers,
    )
    embeddings = result.as_numpy("EMBEDDING")
    assert embeddings is not None
    assert embeddings.shape == (2, 384)
    assert embeddings.dtype == np.float32
    metadata = client.get_model_metadata("all-minilm-l6-v2", headers=headers)
    assert metadata["outputs"][0]["datatype"] == "FP32"
    config = client.get_model_config("all-minilm-l6-v2", headers=headers)
    assert config["output"][0]["data_type"] == "TYPE_FP32"
    index = client.get_model_repository_index(headers=headers)
    assert "all-minilm-l6-v2" in {entry["name"] for entry in index}
    # Translation and reranking over the same protocol.
    translated = client.infer("bergamot-en-pt", [tensor], headers=headers).as_numpy("TRANSLATION")
    assert translated is not None
    assert "mundo" in translated[0].decode().lower()
    query = triton_http.InferInput("QUERY", [1], "BYTES")
    query.set_data_from_numpy(np.array([b"Good morning to you"], dtype=object))
    scores = client.infer("minilm-rerank", [query, tensor], headers=headers).as_numpy("SCORE")
    assert scores is not None
    assert scores[1] > scores[0]  # "good morning" is the document that answers
    # Triton's statistics: this test's request is among those counted.
    (stats,) = client.get_inference_statistics("all-minilm-l6-v2", headers=headers)["model_stats"]
    assert stats["inference_stats"]["success"]["count"] >= 1
    assert stats["inference_count"] >= 2
    assert stats["inference_stats"]["compute_infer"]["ns"] > 0
    with pytest.raises(InferenceServerException, match="not found"):
        client.get_model_config("no-such-model", headers=headers)


def test_triton_llm_tensors_and_the_generate_extension(
    server: Server, oai: openai.OpenAI, request: pytest.FixtureRequest
) -> None:
    prompt = "The capital of France is"
    expected = (
        oai.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=6, temperature=0)
        .choices[0]
        .text
    )
    client = triton_http.InferenceServerClient(url=f"127.0.0.1:{server.port}")
    request.addfinalizer(client.close)
    text = triton_http.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[prompt.encode()]], dtype=object))
    tokens = triton_http.InferInput("max_tokens", [1, 1], "INT32")
    tokens.set_data_from_numpy(np.array([[6]], dtype=np.int32))  # binary data, tritonclient's way
    result = client.infer(
        "smollm2-135m", [text, tokens], parameters={"temperature": 0}, headers=server.headers
    )
    assert result.as_numpy("text_output").tolist() == [[expected.encode()]]
    body = {"text_input": prompt, "parameters": {"max_tokens": 6, "return_finish_reason": True}}
    url = f"{server.base_url}/v2/models/smollm2-135m/generate"
    whole = httpx.post(url, json=body, headers=server.headers).json()
    assert (whole["text_output"], whole["finish_reason"]) == (expected, "length")
    body["parameters"]["stream"] = True
    with httpx.stream("POST", f"{url}_stream", json=body, headers=server.headers) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data:")]
    assert len(events) > 2  # a piece an event, then the finish reason
    assert "".join(event["text_output"] for event in events) == expected
    assert events[-1]["finish_reason"] == "length"
    # Streamed over gRPC, as Triton's decoupled LLM backends answer tritonclient.
    import tritonclient.grpc as triton_grpc

    streaming = triton_grpc.InferenceServerClient(url=f"127.0.0.1:{server.grpc_port}")
    request.addfinalizer(streaming.close)
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    streaming.start_stream(
        callback=lambda result, error: got.put((result, error)),
        headers={"authorization": f"Bearer {server.key}"},
    )
    inputs = []
    for name, datatype, value in (
        ("text_input", "BYTES", np.array([prompt.encode()], dtype=object)),
        ("max_tokens", "INT32", np.array([6], dtype=np.int32)),
        ("stream", "BOOL", np.array([True])),
    ):
        tensor = triton_grpc.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    streaming.async_stream_infer("smollm2-135m", inputs, enable_empty_final_response=True)
    pieces: list[bytes] = []
    while True:
        result, error = got.get(timeout=60)
        assert error is None, error
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
        pieces.extend(result.as_numpy("text_output").tolist())
    streaming.stop_stream()
    assert len(pieces) > 1
    assert b"".join(pieces).decode() == expected


def test_tritonclient_over_grpc(server: Server, request: pytest.FixtureRequest) -> None:
    import tritonclient.grpc as triton_grpc

    client = triton_grpc.InferenceServerClient(url=f"127.0.0.1:{server.grpc_port}")
    request.addfinalizer(client.close)
    headers = {"authorization": f"Bearer {server.key}"}  # gRPC metadata keys are lower case
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.get_server_metadata().name == "tessera"
    assert client.is_model_ready("all-minilm-l6-v2", headers=headers)
    texts = np.array([b"hello world", b"good morning"], dtype=object)
    tensor = triton_grpc.InferInput("TEXT", [2], "BYTES")
    tensor.set_data_from_numpy(texts)
    result = client.infer("all-minilm-l6-v2", [tensor], headers=headers)
    embeddings = result.as_numpy("EMBEDDING")
    assert embeddings is not None
    assert embeddings.shape == (2, 384)
    # The same vectors as over HTTP.
    over_http = httpx.post(
        f"{server.base_url}/v1/embeddings",
        json={"model": "all-minilm-l6-v2", "input": ["hello world", "good morning"]},
        headers=server.headers,
    ).json()["data"]
    np.testing.assert_allclose(embeddings, [d["embedding"] for d in over_http], atol=1e-5)
    metadata = client.get_model_metadata("all-minilm-l6-v2", headers=headers)
    assert (metadata.inputs[0].datatype, metadata.outputs[0].datatype) == ("BYTES", "FP32")
    config = client.get_model_config("all-minilm-l6-v2", headers=headers).config
    assert config.output[0].data_type == triton_grpc.model_config_pb2.TYPE_FP32
    index = client.get_model_repository_index(headers=headers)
    assert "all-minilm-l6-v2" in {model.name for model in index.models}
    with pytest.raises(InferenceServerException, match="not found") as missing:
        client.infer("no-such-model", [tensor], headers=headers)
    assert missing.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as no_key:
        client.infer("all-minilm-l6-v2", [tensor])
    assert no_key.value.status() == "StatusCode.UNAUTHENTICATED"
    wrong = triton_grpc.InferInput("TEXT", [2], "BYTES")
    wrong.set_data_from_numpy(texts)
    wrong.set_shape([3])  # three elements declared, two sent
    with pytest.raises(InferenceServerException) as bad:
        client.infer("all-minilm-l6-v2", [wrong], headers=headers)
    assert bad.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "shape" in str(bad.value.message())


def test_rerank_puts_relevant_document_first(server: Server) -> None:
    r = httpx.post(
        f"{server.base_url}/v1/rerank",
        json={
            "model": "minilm-rerank",
            "query": "How many people live in Berlin?",
            "documents": [
                "Berlin is known for its museums.",
                "Berlin has a population of 3.5 million people.",
                "Paris is the capital of France.",
            ],
            "top_n": 2,
            "return_documents": True,
        },
        timeout=60,
        headers=server.headers,
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert results[0]["index"] == 1
    assert results[0]["document"]["text"].startswith("Berlin has")


def test_cohere_clients_rerank_and_embed(
    server: Server, oai: openai.OpenAI, request: pytest.FixtureRequest
) -> None:
    documents = [
        "Berlin is known for its museums.",
        "Berlin has a population of 3.5 million people.",
        "Paris is the capital of France.",
    ]
    query = "How many people live in Berlin?"
    http = httpx.Client(timeout=60)  # closed at the end, not left to the collector
    request.addfinalizer(http.close)
    v1 = cohere.Client(api_key=server.key, base_url=server.base_url, httpx_client=http)
    v2 = cohere.ClientV2(api_key=server.key, base_url=server.base_url, httpx_client=http)
    first = v1.rerank(
        model="minilm-rerank", query=query, documents=documents, top_n=2, return_documents=True
    )
    assert [r.index for r in first.results] == [1, 0]
    assert first.results[0].document is not None
    assert first.results[0].document.text == documents[1]
    second = v2.rerank(model="minilm-rerank", query=query, documents=documents)
    assert [(r.index, r.relevance_score) for r in second.results] == [
        (r.index, r.relevance_score)
        for r in v1.rerank(model="minilm-rerank", query=query, documents=documents).results
    ]
    reference = oai.embeddings.create(model="all-minilm-l6-v2", input=documents[0]).data[0]
    plain = v1.embed(model="all-minilm-l6-v2", texts=[documents[0]], input_type="search_document")
    assert isinstance(plain.embeddings, list)
    by_type = v2.embed(
        model="all-minilm-l6-v2",
        texts=[documents[0]],
        input_type="search_document",
        embedding_types=["float"],
    )
    assert by_type.embeddings.float_ is not None
    for vector in (plain.embeddings[0], by_type.embeddings.float_[0]):
        assert cosine(vector, reference.embedding) > 0.9999
    with pytest.raises(cohere.errors.BadRequestError):
        v2.embed(
            model="all-minilm-l6-v2",
            texts=["x"],
            input_type="search_document",
            embedding_types=["int8"],
        )
    packed = v2.embed(
        model="all-minilm-l6-v2",
        texts=[documents[0]],
        input_type="search_document",
        embedding_types=["float", "ubinary", "binary", "base64"],
    ).embeddings
    assert packed.float_ is not None
    assert packed.ubinary is not None
    assert packed.binary is not None
    assert packed.base64 is not None
    bits = np.array(packed.float_[0]) >= 0  # the same vector's: no bit flips near zero
    assert np.array_equal(np.unpackbits(np.array(packed.ubinary[0], dtype=np.uint8)), bits)
    assert [b + 128 for b in packed.binary[0]] == packed.ubinary[0]
    from_base64 = np.frombuffer(base64.b64decode(packed.base64[0]), dtype="<f4")
    assert cosine(from_base64.tolist(), reference.embedding) > 0.9999
    asked = ["I want to talk to a human agent", "What is your refund policy?"]
    classified = v2.classify(model="intent-minilm", inputs=asked).classifications
    own = httpx.post(
        f"{server.base_url}/v1/classify",
        json={"model": "intent-minilm", "input": asked, "top_k": 100},
        headers=server.headers,
        timeout=60,
    ).json()["data"]
    for mine, theirs in zip(own, classified, strict=True):
        assert theirs.prediction == mine["label"]
        assert theirs.confidence == pytest.approx(mine["score"])
        assert {label: value.confidence for label, value in theirs.labels.items()} == {
            ls["label"]: pytest.approx(ls["score"]) for ls in mine["labels"]
        }


def test_huggingface_inference_client_over_tei(
    server: Server,
    oai: openai.OpenAI,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    from huggingface_hub import InferenceClient, constants

    # The client's own offline switch (set for the whole suite) blocks every
    # URL, loopback included: the server it calls still runs offline.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    text = "The cat sat on the mat."
    embedder = InferenceClient(model=f"{server.base_url}/tei/all-minilm-l6-v2", token=server.key)
    request.addfinalizer(embedder.close)
    vector = embedder.feature_extraction(text)
    assert vector.shape == (1, 384)
    reference = oai.embeddings.create(model="all-minilm-l6-v2", input=text).data[0].embedding
    assert cosine(list(vector[0]), reference) > 0.9999
    question = "I want to reset my password"
    classifier = InferenceClient(model=f"{server.base_url}/tei/intent-minilm", token=server.key)
    request.addfinalizer(classifier.close)
    # TEI answers one text with a flat list of labels, best first, and the
    # client reads the first item of its answer: the best label, as from TEI.
    top = classifier.text_classification(question)
    body = {"model": "intent-minilm", "input": question}
    classified = httpx.post(f"{server.base_url}/v1/classify", json=body, headers=server.headers)
    assert top.label == classified.json()["data"][0]["label"]
    # TEI's rerank: Cohere's shape's scores, best first.
    texts = ["Paris is in France.", "Berlin has 3.5 million people."]
    query = "How many people live in Berlin?"
    tei = httpx.post(
        f"{server.base_url}/tei/minilm-rerank/rerank",
        json={"query": query, "texts": texts},
        headers=server.headers,
    )
    cohere_body = {"model": "minilm-rerank", "query": query, "documents": texts}
    scores = httpx.post(f"{server.base_url}/v1/rerank", json=cohere_body, headers=server.headers)
    assert [(r["index"], r["relevance_score"]) for r in scores.json()["results"]] == [
        (r["index"], r["score"]) for r in tei.json()
    ]
    assert tei.json()[0]["index"] == 1


def test_classify_intent(server: Server) -> None:
    r = httpx.post(
        f"{server.base_url}/v1/classify",
        json={"model": "intent-minilm", "input": ["I want to talk to a human agent"], "top_k": 3},
        timeout=60,
        headers=server.headers,
    )
    assert r.status_code == 200, r.text
    result = r.json()["data"][0]
    assert result["label"]
    assert len(result["labels"]) == 3
    assert result["labels"][0]["score"] >= result["labels"][1]["score"]


def _png(array: np.ndarray) -> bytes:  # type: ignore[type-arg]
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array[:, :, ::-1]).save(buffer, format="PNG")
    return buffer.getvalue()


def _ocr_json(server: Server, page: np.ndarray[Any, Any]) -> httpx.Response:
    """``page`` read by the OCR route, sent as base64 in JSON."""
    return httpx.post(
        f"{server.base_url}/v1/ocr",
        json={"model": "pp-ocrv6", "image": base64.b64encode(_png(page)).decode()},
        timeout=120,
        headers=server.headers,
    )


def test_ocr_page_json_and_line_multipart(server: Server) -> None:
    page = sample_page()
    r = _ocr_json(server, page)
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Total" in body["text"]
    assert "Receipt" in body["text"]
    assert all(len(line["box"]) == 4 for line in body["lines"])
    line = page[30:90, :400]
    r = httpx.post(
        f"{server.base_url}/v1/ocr",
        files={"file": ("line.png", _png(line), "image/png")},
        data={"model": "pp-ocrv6", "mode": "line"},
        timeout=120,
        headers=server.headers,
    )
    assert r.status_code == 200, r.text
    assert "Total" in r.json()["text"]


def test_tritonclient_reads_pages_and_speaks(
    server: Server, request: pytest.FixtureRequest
) -> None:
    client = triton_http.InferenceServerClient(url=f"127.0.0.1:{server.port}")
    request.addfinalizer(client.close)
    page = sample_page()
    over_http = _ocr_json(server, page).json()
    # An image file, and the same page as RGB pixels: the OCR route's answer both ways.
    image = triton_http.InferInput("IMAGE", [1], "BYTES")
    image.set_data_from_numpy(np.array([_png(page)], dtype=object))
    pixels = triton_http.InferInput("IMAGE", [*page.shape], "UINT8")
    pixels.set_data_from_numpy(np.ascontiguousarray(page[:, :, ::-1]))
    for tensor in (image, pixels):
        result = client.infer("pp-ocrv6", [tensor], headers=server.headers, timeout=120)
        assert result.as_numpy("TEXT").tolist() == [over_http["text"].encode()]
        boxes = result.as_numpy("LINE_BOX")
        assert boxes.shape == (len(over_http["lines"]), 4, 2)
        np.testing.assert_allclose(boxes[0], over_http["lines"][0]["box"], atol=1e-3)
    text = triton_http.InferInput("TEXT", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hello from tessera."], dtype=object))
    spoken = client.infer("piper-joe", [text], headers=server.headers)
    assert spoken.as_numpy("SAMPLE_RATE").tolist() == [22050]
    samples = spoken.as_numpy("AUDIO")
    assert samples.dtype == np.int16
    assert 0.5 < len(samples) / 22050 < 10
    assert np.abs(samples).max() > 1000  # speech, not silence


def test_speech_wav_and_mp3(oai: openai.OpenAI) -> None:
    response = oai.audio.speech.create(
        model="piper-joe", voice="joe", input="Hello from tessera.", response_format="wav"
    )
    with wave.open(io.BytesIO(response.content)) as wav:
        assert wav.getframerate() == 22050
        assert wav.getsampwidth() == 2
        seconds = wav.getnframes() / wav.getframerate()
    assert 0.5 < seconds < 10
    # OpenAI's own default, mp3, as its client asks for it.
    mp3 = oai.audio.speech.create(
        model="piper-joe", voice="joe", input="Hello from tessera.", response_format="mp3"
    )
    info = soundfile.info(io.BytesIO(mp3.content))
    assert info.format == "MP3"
    assert abs(info.duration - seconds) < 0.2
    # OpenAI's server-sent events, as its client asks for them: the same clip.
    sse = oai.audio.speech.create(
        model="piper-joe",
        voice="joe",
        input="Hello from tessera.",
        response_format="wav",
        stream_format="sse",
    )
    events = [json.loads(line[6:]) for line in sse.text.splitlines() if line.startswith("data: ")]
    clip = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    with wave.open(io.BytesIO(clip)) as wav:
        assert abs(wav.getnframes() / wav.getframerate() - seconds) < 0.2
    assert events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["input_tokens"] == len("Hello from tessera.")


def test_translate_both_directions(server: Server) -> None:
    r = httpx.post(
        f"{server.base_url}/v1/translate",
        json={
            "model": "bergamot-en-pt",
            "input": ["The cat is on the table.", "The book is in the car."],
        },
        timeout=60,
        headers=server.headers,
    )
    assert r.status_code == 200, r.text
    first, second = (d["translation"] for d in r.json()["data"])
    assert "gato" in first.lower()
    assert "não" not in second.lower()
    r = httpx.post(
        f"{server.base_url}/v1/translate",
        json={"model": "bergamot-pt-en", "input": "O gato está na mesa."},
        timeout=60,
        headers=server.headers,
    )
    assert "cat" in r.json()["data"][0]["translation"].lower()


def test_deepl_client_translates_both_directions(
    server: Server, request: pytest.FixtureRequest
) -> None:
    translator = deepl.Translator(server.key, server_url=server.base_url)
    request.addfinalizer(translator.close)  # its pooled connections, not left to the collector
    to_pt = translator.translate_text(
        ["The cat is on the table.", "The book is in the car."], target_lang="PT-BR"
    )
    assert isinstance(to_pt, list)
    assert "gato" in to_pt[0].text.lower()
    assert (to_pt[0].detected_source_lang, to_pt[0].billed_characters) == ("EN", 24)
    to_en = translator.translate_text("O gato está na mesa.", target_lang="EN-US")
    assert not isinstance(to_en, list)
    assert "cat" in to_en.text.lower()
    assert to_en.detected_source_lang == "PT"
    assert {lang.code for lang in translator.get_target_languages()} == {"EN", "PT"}
    with pytest.raises(deepl.DeepLException, match="no model translates"):
        translator.translate_text("Bonjour", target_lang="FR")
    # The key's tenant's units today (audit rows are written every half second):
    # at least these translations' characters, under no daily limit.
    translated = 24 + len("The book is in the car.") + len("O gato está na mesa.")
    deadline = time.monotonic() + 10
    while (usage := translator.get_usage()).character.count < translated:
        assert time.monotonic() < deadline, usage
        time.sleep(0.2)
    assert usage.character.limit == 10**12


def test_ollama_client_embeds_and_chats(
    server: Server, oai: openai.OpenAI, request: pytest.FixtureRequest
) -> None:
    client = ollama.Client(host=server.base_url, headers=server.headers)
    request.addfinalizer(client.close)
    text = "The cat sat on the mat."
    embedded = client.embed(model="all-minilm-l6-v2", input=[text])
    reference = oai.embeddings.create(model="all-minilm-l6-v2", input=text).data[0].embedding
    assert cosine(list(embedded.embeddings[0]), reference) > 0.9999
    question = [{"role": "user", "content": "Which city is the capital of France?"}]
    answer = client.chat(model="smollm2-135m", messages=question, options={"num_predict": 16})
    assert "Paris" in (answer.message.content or "")
    assert answer.done_reason == "stop"
    streamed = client.chat(
        model="smollm2-135m", messages=question, options={"num_predict": 16}, stream=True
    )
    parts = [part.message.content or "" for part in streamed]
    assert "".join(parts) == answer.message.content
    assert len(parts) > 2
    continued = client.generate(
        model="smollm2-135m",
        prompt="The capital of France is",
        raw=True,
        options={"num_predict": 4},
    )
    assert "Paris" in continued.response
    assert "smollm2-135m" in {m.model for m in client.list().models}
    assert {"completion", "tools"} <= set(client.show("smollm2-135m").capabilities or ())
    assert client.pull("smollm2-135m").status == "success"  # served here: nothing to fetch
    with pytest.raises(ollama.ResponseError) as missing:
        client.embed(model="no-such-model", input="x")
    assert missing.value.status_code == 404


def test_bad_input_gets_json_errors(server: Server, oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="no-such-model", input="x")
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model="bergamot-en-pt", input="x")
    r = httpx.post(
        f"{server.base_url}/v1/ocr",
        json={"model": "pp-ocrv6", "image": base64.b64encode(b"GIF89a broken").decode()},
        headers=server.headers,
    )
    assert r.status_code == 415
    assert r.json()["error"]["message"]


def test_residency_shows_what_is_loaded(server: Server) -> None:
    body = httpx.get(f"{server.base_url}/admin/residency", headers=server.headers).json()
    assert body["budget_bytes"] == 3 * 1024**3
    assert 0 < body["used_bytes"] <= body["budget_bytes"]
    models = {m["name"]: m for m in body["models"]}
    assert models["all-minilm-l6-v2"]["state"] == "ready"
    assert models["all-minilm-l6-v2"]["weights_bytes"] > 80_000_000
    assert sum(m["bytes"] for m in models.values()) <= body["used_bytes"]
