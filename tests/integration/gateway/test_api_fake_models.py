"""Every API route over fake models: shapes, statuses, batching, residency."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave

import httpx
import numpy as np
import pytest

from harness.fake_models import FAKE_DIMS, fake_embedding
from tessera.engine import Engine
from tessera.gateway import openai_audio
from tessera.gateway.openai_chat import ChatRequest
from tessera.tasks.samples import sample_page


async def test_embeddings_float_and_base64(shared_client: httpx.AsyncClient) -> None:
    r = await shared_client.post("/v1/embeddings", json={"model": "embed", "input": ["a b", "c"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1]
    np.testing.assert_allclose(body["data"][1]["embedding"], fake_embedding("c"), rtol=1e-6)
    r = await shared_client.post(
        "/v1/embeddings", json={"model": "embed", "input": "a b", "encoding_format": "base64"}
    )
    vector = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (FAKE_DIMS,)
    np.testing.assert_allclose(vector, fake_embedding("a b"), rtol=1e-6)


async def test_embeddings_shortened_to_dimensions_stay_unit_vectors(
    shared_client: httpx.AsyncClient,
) -> None:
    r = await shared_client.post(
        "/v1/embeddings", json={"model": "embed", "input": "c", "dimensions": 3}
    )
    assert r.status_code == 200, r.text
    head = fake_embedding("c")[:3]
    np.testing.assert_allclose(
        r.json()["data"][0]["embedding"], head / np.linalg.norm(head), rtol=1e-5
    )
    body = {"model": "embed", "input": "c", "dimensions": FAKE_DIMS}
    r = await shared_client.post("/v1/embeddings", json=body)
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], fake_embedding("c"), rtol=1e-6)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "embed", "input": []}, 400),
        ({"model": "embed", "input": ""}, 400),
        ({"model": "embed", "input": 5}, 400),
        ({"model": "embed"}, 400),
        ({"model": "nope", "input": "x"}, 404),
        ({"model": "mt", "input": "x"}, 400),
        ({"model": "embed", "input": ["x"] * 5}, 413),
        ({"model": "embed", "input": "x", "dimensions": FAKE_DIMS + 1}, 400),
    ],
)
async def test_bad_embedding_requests(
    shared_client: httpx.AsyncClient, body: object, status: int
) -> None:
    r = await shared_client.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"]
    assert "Traceback" not in r.text


@pytest.mark.parametrize("tokens", [[101, 7592, 102], [[101, 7592], [102]]])
async def test_token_ids_as_input_are_refused_with_why(
    shared_client: httpx.AsyncClient, tokens: object
) -> None:
    r = await shared_client.post("/v1/embeddings", json={"model": "embed", "input": tokens})
    assert r.status_code == 400
    assert "send the text" in r.json()["error"]["message"]


async def test_malformed_json_and_oversized_body(shared_client: httpx.AsyncClient) -> None:
    r = await shared_client.post(
        "/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"]
    r = await shared_client.post("/v1/embeddings", json={"model": "embed", "input": "x" * 100_000})
    assert r.status_code == 413
    assert "bytes" in r.json()["error"]["message"]


async def test_rerank_classify_translate(shared_client: httpx.AsyncClient) -> None:
    r = await shared_client.post(
        "/v1/rerank",
        json={
            "model": "rerank",
            "query": "q",
            "documents": ["a", {"text": "b"}, "c"],
            "top_n": 2,
            "return_documents": True,
        },
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 2
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert {"index", "relevance_score", "document"} <= set(results[0])

    r = await shared_client.post(
        "/v1/classify", json={"model": "intent", "input": ["hello", "hey"]}
    )
    assert r.status_code == 200, r.text
    first = r.json()["data"][0]
    assert first["label"] == "label-2"
    assert first["labels"][0]["label"] == first["label"]
    # Cohere's classify: inputs in, its classifications out.
    r = await shared_client.post("/v1/classify", json={"model": "intent", "inputs": ["hello"]})
    assert r.status_code == 200, r.text
    (cohere,) = r.json()["classifications"]
    assert (cohere["input"], cohere["prediction"], cohere["predictions"]) == (
        "hello",
        "label-2",
        ["label-2"],
    )
    assert cohere["labels"] == {"label-2": {"confidence": 0.9}, "other": {"confidence": 0.1}}
    assert (cohere["confidence"], cohere["classification_type"]) == (0.9, "single-label")
    for body, why in (
        ({"model": "intent"}, "one of them"),
        ({"model": "intent", "input": "a", "inputs": ["a"]}, "one of them"),
        ({"model": "intent", "inputs": ["a"], "examples": [{"text": "a", "label": "b"}]}, "few"),
        ({"model": "intent", "inputs": []}, "must not be empty"),
        ({"model": "intent", "input": []}, "input must not be empty"),  # not "input[0]"
    ):
        r = await shared_client.post("/v1/classify", json=body)
        assert r.status_code == 400, r.text
        assert why in r.json()["error"]["message"]

    r = await shared_client.post("/v1/translate", json={"model": "mt", "input": ["abc", "xy"]})
    assert r.json()["data"] == [
        {"index": 0, "translation": "cba"},
        {"index": 1, "translation": "yx"},
    ]


async def test_ocr_json_multipart_and_bad_image(shared_client: httpx.AsyncClient) -> None:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(sample_page(40, 60)[:, :, ::-1]).save(buffer, format="PNG")
    png = buffer.getvalue()
    r = await shared_client.post(
        "/v1/ocr", json={"model": "ocr", "image": base64.b64encode(png).decode()}
    )
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "60x40"
    r = await shared_client.post(
        "/v1/ocr",
        files={"file": ("p.png", png, "image/png")},
        data={"model": "ocr", "mode": "line"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["lines"][0]["box"][2] == [60.0, 40.0]
    r = await shared_client.post(
        "/v1/ocr", json={"model": "ocr", "image": base64.b64encode(b"not an image").decode()}
    )
    assert r.status_code == 415
    r = await shared_client.post("/v1/ocr", json={"model": "ocr", "image": "%%%"})
    assert r.status_code == 400
    # A body that does not validate says where, in one line, as other routes do
    # (it had been pydantic's whole report: the input, a link, several lines).
    for body, says in (
        ({"model": "ocr", "image": "aGk=", "mode": "x"}, "invalid request: mode: "),
        ([1], "invalid request: "),
        ({"image": "aGk="}, "invalid request: model: Field required"),
    ):
        r = await shared_client.post("/v1/ocr", json=body)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(says), message
        assert "\n" not in message
        assert "pydantic" not in message
    r = await shared_client.post(
        "/v1/ocr", files={"file": ("p.png", png)}, data={"model": "ocr", "max_tokens": "abc"}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("invalid request: max_tokens: ")


async def test_speech_returns_wav(shared_client: httpx.AsyncClient) -> None:
    r = await shared_client.post(
        "/v1/audio/speech", json={"model": "tts", "input": "hello", "voice": "x"}
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/wav"
    with wave.open(io.BytesIO(r.content)) as wav:
        assert wav.getframerate() == 22050
        assert wav.getnframes() == 500


async def test_speech_as_server_sent_events(
    shared_client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openai_audio, "SPEECH_EVENT_BYTES", 128)  # the fake's clip: 1,000 bytes
    body = {"model": "tts", "input": "hello", "response_format": "pcm"}
    whole = await shared_client.post("/v1/audio/speech", json=body)
    events = []
    async with shared_client.stream(
        "POST", "/v1/audio/speech", json={**body, "stream_format": "sse"}
    ) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert stream.headers["x-sample-rate"] == "22050"
        async for line in stream.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    *deltas, done = events
    assert len(deltas) == 8
    assert {e["type"] for e in deltas} == {"speech.audio.delta"}
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == whole.content
    assert done == {
        "type": "speech.audio.done",
        "usage": {"input_tokens": 5, "output_tokens": 0, "total_tokens": 5},
    }


@pytest.mark.parametrize(
    ("audio_format", "media_type"), [("mp3", "audio/mpeg"), ("flac", "audio/flac")]
)
async def test_speech_in_openais_other_formats(
    shared_client: httpx.AsyncClient, audio_format: str, media_type: str
) -> None:
    soundfile = pytest.importorskip("soundfile")
    body = {"model": "tts", "input": "hello", "response_format": audio_format}
    r = await shared_client.post("/v1/audio/speech", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == media_type
    info = soundfile.info(io.BytesIO(r.content))
    assert (info.samplerate, info.channels) == (22050, 1)


async def test_speech_in_aac_is_refused_saying_what_is_served(
    shared_client: httpx.AsyncClient,
) -> None:
    body = {"model": "tts", "input": "hello", "response_format": "aac"}
    r = await shared_client.post("/v1/audio/speech", json=body)
    assert r.status_code == 400
    assert "mp3, opus, flac, wav, pcm" in r.json()["error"]["message"]


async def test_chat_plain_and_streaming(shared_client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "one two three"}]
    r = await shared_client.post(
        "/v1/chat/completions", json={"model": "chat", "messages": messages}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "one two three "
    pieces = []
    async with shared_client.stream(
        "POST", "/v1/chat/completions", json={"model": "chat", "messages": messages, "stream": True}
    ) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                pieces.append(delta.get("content", ""))
    assert "".join(pieces) == "one two three "


async def test_legacy_completions_plain_echo_and_several_prompts(
    shared_client: httpx.AsyncClient,
) -> None:
    r = await shared_client.post("/v1/completions", json={"model": "chat", "prompt": "one two"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {"text": "one two ", "index": 0, "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    prompts = ["a b c", "d", "e f"]
    r = await shared_client.post(
        "/v1/completions", json={"model": "chat", "prompt": prompts, "echo": True}
    )
    assert r.status_code == 200, r.text
    texts = [(c["index"], c["text"]) for c in r.json()["choices"]]
    assert texts == [(0, "a b ca b c "), (1, "dd "), (2, "e fe f ")]
    assert r.json()["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(
    ("response_format", "status", "says"),
    [
        ({"type": "text"}, 200, ""),
        ({"type": "json_object"}, 400, "cannot hold an answer to JSON"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}, 400, "JSON"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, 400, "needs a json_schema"),
        ({"type": "xml"}, 400, "type"),
    ],
)
async def test_json_answers_where_the_runtime_cannot_hold_them_say_why(
    shared_client: httpx.AsyncClient, response_format: object, status: int, says: str
) -> None:
    messages = [{"role": "user", "content": "one two"}]
    body = {"model": "chat", "messages": messages, "response_format": response_format}
    r = await shared_client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    if status != 200:
        assert says in r.json()["error"]["message"]


async def chat_refused(
    client: httpx.AsyncClient, extra: dict[str, object], says: str
) -> dict[str, object]:
    """A chat of the fake model with ``extra`` fields: a 400 that ``says``; its body."""
    body = {"model": "chat", "messages": [{"role": "user", "content": "x"}], **extra}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    return body


def nested_schema(levels: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def enum_schema(values: int) -> dict[str, object]:
    return {"type": "string", "enum": [f"v{i}" for i in range(values)]}


def as_format(schema: dict[str, object]) -> dict[str, object]:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }


def as_tool(schema: dict[str, object]) -> dict[str, object]:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (as_format(nested_schema(130)), "nests deeper than 64"),  # a 500 before
        (as_format(enum_schema(5000)), "over 1000 enum values"),  # held the model 25 s
        (as_tool(enum_schema(1001)), "over 1000 enum values"),
        (as_format({"type": "object", "properties": {f"p{i}": {} for i in range(5001)}}), "5000"),
    ],
)
async def test_a_schema_past_openais_bounds_says_why(
    shared_client: httpx.AsyncClient, extra: dict[str, object], says: str
) -> None:
    await chat_refused(shared_client, extra, says)


async def test_a_schema_within_the_bounds_is_taken(shared_client: httpx.AsyncClient) -> None:
    # The fake model cannot hold an answer to JSON: it says so, past the bounds' check.
    await chat_refused(shared_client, as_format(nested_schema(20)), "cannot hold an answer to JSON")
    await chat_refused(shared_client, as_format(enum_schema(1000)), "cannot hold an answer to JSON")


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"logprobs": True}, "does not give them"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "needs logprobs: true"),
    ],
)
async def test_logprobs_where_the_runtime_cannot_give_them_say_why(
    shared_client: httpx.AsyncClient, extra: dict[str, object], says: str
) -> None:
    body = await chat_refused(shared_client, extra, says)
    body["logprobs"] = False
    body.pop("top_logprobs", None)
    r = await shared_client.post("/v1/chat/completions", json=body)
    assert r.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"logit_bias": {"the": 1}}, "token ids"),
        ({"logit_bias": {"-5": 1}}, "token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
    ],
)
async def test_penalties_and_logit_bias_out_of_openais_ranges_say_why(
    shared_client: httpx.AsyncClient, extra: dict[str, object], says: str
) -> None:
    bodies = {
        "/v1/chat/completions": {"model": "chat", "messages": [{"role": "user", "content": "x"}]},
        "/v1/completions": {"model": "chat", "prompt": "x"},
    }
    for path, body in bodies.items():
        r = await shared_client.post(path, json={**body, **extra})
        assert r.status_code == 400, r.text
        assert says in r.json()["error"]["message"]


async def test_penalties_and_logit_bias_in_range_are_taken(
    shared_client: httpx.AsyncClient,
) -> None:
    extra = {"presence_penalty": -2, "frequency_penalty": 2, "logit_bias": {"12": 100, "7": -1}}
    chat = {"model": "chat", "messages": [{"role": "user", "content": "a b"}], **extra}
    r = await shared_client.post("/v1/chat/completions", json=chat)
    assert r.json()["choices"][0]["message"]["content"] == "a b "
    sampling = ChatRequest.model_validate(chat).sampling()
    assert (sampling["presence_penalty"], sampling["frequency_penalty"]) == (-2.0, 2.0)
    assert sampling["logit_bias"] == ((7, -1.0), (12, 100.0))
    r = await shared_client.post("/v1/completions", json={"model": "chat", "prompt": "c", **extra})
    assert r.json()["choices"][0]["text"] == "c "


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"tools": [TOOL]}, "cannot call tools"),
        ({"tools": [TOOL], "tool_choice": "required"}, "cannot call tools"),
        ({"messages": [CALLED, {"role": "tool", "tool_call_id": "c1", "content": "x"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice needs tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "'f'"),
        ({"tools": [TOOL, TOOL]}, "a name of its own"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "name"),
        ({"tools": [{"type": "retrieval"}]}, "type"),
        ({"tools": [TOOL], "response_format": {"type": "json_object"}}, "do not go together"),
        ({"functions": [TOOL["function"]]}, "give them as tools"),
        ({"function_call": "auto"}, "give them as tools"),
    ],
)
async def test_tools_where_they_cannot_be_called_or_do_not_agree_say_why(
    shared_client: httpx.AsyncClient, extra: dict[str, object], says: str
) -> None:
    await chat_refused(shared_client, extra, says)


async def test_tool_choice_none_leaves_the_tools_out(shared_client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "a b"}]
    body = {"model": "chat", "messages": messages, "tools": [TOOL], "tool_choice": "none"}
    r = await shared_client.post("/v1/chat/completions", json=body)
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "a b "}


async def test_n_choices_of_a_chat_and_of_each_prompt(shared_client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "one two"}]
    body = {"model": "chat", "messages": messages, "n": 3}
    r = await shared_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [(c["index"], c["message"]["content"]) for c in choices] == [
        (0, "one two "),
        (1, "one two "),
        (2, "one two "),
    ]
    assert r.json()["usage"]["completion_tokens"] == 6
    # The prompt is counted once, as OpenAI and vLLM count it, not once a choice.
    one = await shared_client.post("/v1/chat/completions", json={**body, "n": 1})
    assert r.json()["usage"]["prompt_tokens"] == one.json()["usage"]["prompt_tokens"] > 0
    body = {"model": "chat", "prompt": ["a", "b c"], "n": 2}
    r = await shared_client.post("/v1/completions", json=body)
    texts = [(c["index"], c["text"]) for c in r.json()["choices"]]
    assert texts == [(0, "a "), (1, "a "), (2, "b c "), (3, "b c ")]
    one = await shared_client.post("/v1/completions", json={**body, "n": 1})
    assert r.json()["usage"]["prompt_tokens"] == one.json()["usage"]["prompt_tokens"] > 0
    r = await shared_client.post(
        "/v1/chat/completions", json={**body, "messages": messages, "n": 17}
    )
    assert r.status_code == 400


async def test_a_streamed_chat_of_n_choices_streams_each_by_index(
    shared_client: httpx.AsyncClient,
) -> None:
    messages = [{"role": "user", "content": "one two three"}]
    body = {"model": "chat", "messages": messages, "n": 2, "stream": True}
    texts: dict[int, str] = {0: "", 1: ""}
    roles, finished = [], {}
    async with shared_client.stream("POST", "/v1/chat/completions", json=body) as stream:
        async for line in stream.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            (choice,) = json.loads(line[6:])["choices"]
            delta = choice["delta"]
            if "role" in delta:
                roles.append(choice["index"])
            texts[choice["index"]] += delta.get("content", "")
            if choice["finish_reason"] is not None:
                finished[choice["index"]] = choice["finish_reason"]
    assert roles == [0, 1]
    assert texts == {0: "one two three ", 1: "one two three "}
    assert finished == {0: "stop", 1: "stop"}


async def test_legacy_completions_stream_each_prompts_pieces_by_index(
    shared_client: httpx.AsyncClient,
) -> None:
    body = {
        "model": "chat",
        "prompt": ["one two three", "four five"],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    texts: dict[int, str] = {0: "", 1: ""}
    finished: dict[int, str] = {}
    events = []
    async with shared_client.stream("POST", "/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        async for line in stream.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    *chunks, usage = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        assert chunk["object"] == "text_completion"
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finished[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "one two three ", 1: "four five "}
    assert finished == {0: "stop", 1: "stop"}
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"model": "chat", "prompt": ""}, 400, "must not be empty"),
        ({"model": "chat", "prompt": []}, 400, "prompt"),
        ({"model": "chat", "prompt": [1, 2, 3]}, 400, "send the text"),
        ({"model": "chat", "prompt": "x", "logprobs": 1}, 400, "does not give them"),
        ({"model": "chat", "prompt": "x", "logprobs": 6}, 400, "less than or equal to 5"),
        ({"model": "chat", "prompt": "x", "logprobs": 1, "echo": True}, 400, "prompt's tokens"),
        ({"model": "chat", "prompt": "x", "suffix": "y"}, 400, "not served"),
        ({"model": "chat", "prompt": "x", "n": 17}, 400, "n"),
        ({"model": "chat", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "embed", "prompt": "x"}, 400, "embed"),
        ({"model": "nope", "prompt": "x"}, 404, "nope"),
    ],
)
async def test_bad_legacy_completions_say_why(
    shared_client: httpx.AsyncClient, body: object, status: int, says: str
) -> None:
    r = await shared_client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"]


async def test_failed_model_is_503_and_others_keep_serving(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/embeddings", json={"model": "broken", "input": "x"})
    assert r.status_code == 503
    assert "broken" in r.json()["error"]["message"]
    r = await client.post("/v1/embeddings", json={"model": "huge", "input": "x"})
    assert r.status_code == 503
    assert "budget" in r.json()["error"]["message"]
    r = await client.post("/v1/embeddings", json={"model": "embed", "input": "x"})
    assert r.status_code == 200


async def test_concurrent_callers_are_batched(client: httpx.AsyncClient, engine: Engine) -> None:
    texts = [f"text {i}" for i in range(8)]
    responses = await asyncio.gather(
        *(client.post("/v1/embeddings", json={"model": "embed", "input": t}) for t in texts)
    )
    for text, response in zip(texts, responses, strict=True):
        np.testing.assert_allclose(
            response.json()["data"][0]["embedding"], fake_embedding(text), rtol=1e-6
        )
    stats = engine.snapshot().model("embed")
    assert stats is not None
    num_batches = stats.num_batches
    assert num_batches >= 1
    assert num_batches < len(texts)


async def test_deadline_and_full_queue(client: httpx.AsyncClient) -> None:
    # "slow" runs one item per batch for 0.1 s; the queue holds 8.
    slow = [
        asyncio.ensure_future(client.post("/v1/embeddings", json={"model": "slow", "input": "x"}))
        for _ in range(12)
    ]
    statuses = sorted(r.status_code for r in await asyncio.gather(*slow))
    assert statuses.count(503) >= 1
    assert statuses.count(200) >= 8
    r = await client.post(
        "/v1/embeddings",
        json={"model": "slow", "input": "x"},
        headers={"x-request-timeout": "0.05"},
    )
    assert r.status_code == 504


async def test_a_timeout_no_clock_can_hold_is_served_and_one_not_a_number_400(
    client: httpx.AsyncClient,
) -> None:
    # Enough batches that the model's waits are predicted (and were overflowed).
    for _ in range(10):
        r = await client.post("/v1/embeddings", json={"model": "embed", "input": "x"})
        assert r.status_code == 200
    for timeout, status in (("1e308", 200), ("inf", 400), ("-1", 400), ("nan", 400)):
        r = await client.post(
            "/v1/embeddings",
            json={"model": "embed", "input": "x"},
            headers={"x-request-timeout": timeout},
        )
        assert r.status_code == status, (timeout, r.text)


async def test_full_queue_sets_retry_after(client: httpx.AsyncClient) -> None:
    slow = [
        asyncio.ensure_future(client.post("/v1/embeddings", json={"model": "slow", "input": "x"}))
        for _ in range(12)
    ]
    refused = [r for r in await asyncio.gather(*slow) if r.status_code == 503]
    assert refused
    assert int(refused[0].headers["retry-after"]) >= 1


async def test_models_residency_and_admin(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models")
    ids = {m["id"] for m in r.json()["data"]}
    assert {"embed", "chat", "ocr"} <= ids
    r = await client.get("/v1/models/chat")
    assert (r.status_code, r.json()["id"], r.json()["object"]) == (200, "chat", "model")
    r = await client.get("/v1/models/nope")
    assert (r.status_code, r.json()["error"]["type"]) == (404, "model_not_found")
    r = await client.post("/admin/models/mt/load")
    assert r.status_code == 200
    body = (await client.get("/admin/residency")).json()
    assert body["budget_bytes"] == 64 * 1024**2
    assert body["used_bytes"] >= 2000
    assert body["loads_total"] >= 2
    models = {m["name"]: m for m in body["models"]}
    assert models["mt"]["state"] == "ready"
    assert {"name", "state", "bytes", "last_used", "loads", "evictions"} <= set(models["mt"])
    r = await client.post("/admin/models/mt/unload")
    assert r.json()["was_loaded"] is True
    body = (await client.get("/admin/residency")).json()
    assert {m["name"]: m for m in body["models"]}["mt"]["state"] == "unloaded"
    assert (await client.post("/admin/models/nope/load")).status_code == 404


async def test_kserve_health_metadata_and_json_infer(shared_client: httpx.AsyncClient) -> None:
    assert (await shared_client.get("/v2/health/live")).status_code == 200
    assert (await shared_client.get("/v2/health/ready")).status_code == 200
    meta = (await shared_client.get("/v2/models/embed")).json()
    assert meta["outputs"][0]["datatype"] == "FP32"
    assert (await shared_client.get("/v2/models/embed/ready")).status_code == 200
    assert (await shared_client.get("/v2/models/embed/versions/1/ready")).status_code == 200
    assert (await shared_client.get("/v2/models/nope/ready")).status_code == 404
    assert (await shared_client.get("/v2/models/embed/versions/999/ready")).status_code == 404
    r = await shared_client.post(
        "/v2/models/embed/infer",
        json={"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}]},
    )
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["shape"] == [2, FAKE_DIMS]
    np.testing.assert_allclose(out["data"][:FAKE_DIMS], fake_embedding("a"), rtol=1e-6)
    r = await shared_client.post("/v2/models/embed/infer", json={"inputs": []})
    assert r.status_code == 400
    assert isinstance(r.json()["error"], str)
    # Only the outputs asked for come back, as Triton answers.
    text = {"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["a"]}
    body = {"inputs": [text], "outputs": [{"name": "SCORE"}]}
    r = await shared_client.post("/v2/models/intent/infer", json=body)
    assert [o["name"] for o in r.json()["outputs"]] == ["SCORE"]
    r = await shared_client.post("/v2/models/intent/infer", json={"inputs": [text]})
    assert [o["name"] for o in r.json()["outputs"]] == ["LABEL", "SCORE"]


async def test_kserve_translate_and_rerank(shared_client: httpx.AsyncClient) -> None:
    texts = {"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": ["abc", "xy"]}
    r = await shared_client.post("/v2/models/mt/infer", json={"inputs": [texts]})
    assert r.status_code == 200, r.text
    assert r.json()["outputs"] == [
        {"name": "TRANSLATION", "datatype": "BYTES", "shape": [2], "data": ["cba", "yx"]}
    ]
    query = {"name": "QUERY", "datatype": "BYTES", "shape": [1], "data": ["abc"]}
    r = await shared_client.post("/v2/models/rerank/infer", json={"inputs": [query, texts]})
    assert r.status_code == 200, r.text
    (scores,) = r.json()["outputs"]
    assert (scores["name"], scores["shape"]) == ("SCORE", [2])
    expected = [float(fake_embedding("abc") @ fake_embedding(d)) for d in ("abc", "xy")]
    np.testing.assert_allclose(scores["data"], expected, rtol=1e-5)
    meta = (await shared_client.get("/v2/models/rerank")).json()
    assert [i["name"] for i in meta["inputs"]] == ["QUERY", "TEXT"]
    for inputs, says in (
        ([texts], "'QUERY' is missing"),
        ([{**query, "shape": [2], "data": ["a", "b"]}, texts], "one query"),
        ([query, {**texts, "shape": [0], "data": []}], "at least one document"),
    ):
        r = await shared_client.post("/v2/models/rerank/infer", json={"inputs": inputs})
        assert r.status_code == 400, r.text
        assert says in r.json()["error"]
    r = await shared_client.post("/v2/models/embed/infer", json={"inputs": [query, texts]})
    assert r.status_code == 400
    assert "takes one input" in r.json()["error"]


async def test_kserve_config_index_and_errors_in_kserve_shape(client: httpx.AsyncClient) -> None:
    config = (await client.get("/v2/models/embed/config")).json()
    assert (config["name"], config["max_batch_size"]) == ("embed", 0)
    assert config["input"] == [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [-1]}]
    assert config["output"] == [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": [-1, -1]}]
    index = (await client.post("/v2/repository/index")).json()
    states = {entry["name"]: entry["state"] for entry in index}
    assert states["embed"] == "READY"  # preloaded
    assert states["mt"] == "UNAVAILABLE"
    ready = (await client.post("/v2/repository/index", json={"ready": True})).json()
    assert "embed" in {e["name"] for e in ready}
    assert {e["state"] for e in ready} == {"READY"}  # Triton's ready: those ready now
    r = await client.post("/v2/repository/index", json={"ready": "yes"})
    assert r.status_code == 400
    # Every error under /v2 reads {"error": MESSAGE}, as tritonclient parses it:
    # a model, a route and a method it does not know, a body that does not validate.
    for method, path in (
        ("GET", "/v2/models/nope/config"),
        ("GET", "/v2/models/nope/stats"),
        ("GET", "/v2/models/embed/infer"),
        ("POST", "/v2/repository/models/embed/delete"),
    ):
        r = await client.request(method, path)
        assert r.status_code in (404, 405), (path, r.text)
        assert isinstance(r.json()["error"], str), (path, r.text)
    r = await client.get("/v1/nope")
    assert r.json()["error"]["code"] == 404  # the OpenAI shape elsewhere
    body = {"model": "embed", "texts": ["x"], "embedding_types": ["int8"]}
    r = await client.post("/v2/embed", json=body)  # Cohere's v2, not KServe's
    assert (r.status_code, r.json()["error"]["code"]) == (400, 400)


def tensor(name: str, texts: list[str]) -> dict[str, object]:
    return {"name": name, "datatype": "BYTES", "shape": [len(texts)], "data": texts}


@pytest.mark.parametrize(
    ("model", "body", "says"),
    [
        # Inputs Triton would answer 400 for, not ignore.
        (
            "rerank",
            {"inputs": [tensor("QUERY", ["q"]), tensor("TEXT", ["d"]), tensor("FOO", ["x"])]},
            "not ['FOO']",
        ),
        ("ocr", {"inputs": [tensor("IMAGE", ["x"]), tensor("FOO", ["x"])]}, "IMAGE alone"),
        # Blank texts, as the HTTP routes refuse them.
        (
            "rerank",
            {"inputs": [tensor("QUERY", [" "]), tensor("TEXT", ["d"])]},
            "query must not be blank",
        ),
        ("intent", {"inputs": [tensor("TEXT", [""])]}, "TEXT[0] must not be an empty string"),
        ("embed", {"inputs": [tensor("TEXT", ["a", " "])]}, "TEXT[1] must not be an empty string"),
        # tritonclient's class_count: an extension not served, not a shape of another's.
        (
            "intent",
            {
                "inputs": [tensor("TEXT", ["hi"])],
                "outputs": [{"name": "LABEL", "parameters": {"classification": 3}}],
            },
            "classification extension is not served",
        ),
    ],
)
async def test_kserve_refuses_what_triton_and_the_http_routes_refuse(
    shared_client: httpx.AsyncClient, model: str, body: dict[str, object], says: str
) -> None:
    r = await shared_client.post(f"/v2/models/{model}/infer", json=body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]


async def test_cohere_embed_in_each_embedding_type(shared_client: httpx.AsyncClient) -> None:
    kinds = ["float", "binary", "ubinary", "base64"]
    body = {"model": "embed", "texts": ["a cat", "a car"], "embedding_types": kinds}
    r = await shared_client.post("/v2/embed", json=body)
    assert r.status_code == 200, r.text
    embeddings = r.json()["embeddings"]
    assert set(embeddings) == set(kinds)
    floats = np.array(embeddings["float"], dtype=np.float32)
    assert floats.shape == (2, FAKE_DIMS)
    unsigned = np.array(embeddings["ubinary"])
    assert unsigned.shape == (2, FAKE_DIMS // 8)
    assert np.array_equal(np.unpackbits(unsigned.astype(np.uint8), axis=1), floats >= 0)
    assert np.array_equal(np.array(embeddings["binary"]), unsigned - 128)
    decoded = [np.frombuffer(base64.b64decode(b), dtype="<f4") for b in embeddings["base64"]]
    assert np.array_equal(np.stack(decoded), floats)
    r = await shared_client.post("/v1/embed", json={**body, "embedding_types": ["uint8"]})
    assert r.status_code == 400
    assert "served are float, binary, ubinary, base64" in r.json()["error"]["message"]


async def test_cohere_embed_output_dimension_shortens_as_openais_dimensions(
    shared_client: httpx.AsyncClient,
) -> None:
    body = {"model": "embed", "texts": ["a b", "c"], "embedding_types": ["float"]}
    full = (await shared_client.post("/v2/embed", json=body)).json()["embeddings"]["float"]
    r = await shared_client.post("/v2/embed", json={**body, "output_dimension": 4})
    assert r.status_code == 200, r.text
    short = np.array(r.json()["embeddings"]["float"])
    assert short.shape == (2, 4)
    expected = np.array(full)[:, :4]
    norms = np.linalg.norm(np.array(full), axis=1)
    if np.allclose(norms, 1.0, atol=1e-3):  # unit rows stay unit rows
        expected = expected / np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, rtol=1e-5, atol=1e-6)
    r = await shared_client.post("/v2/embed", json={**body, "output_dimension": FAKE_DIMS + 1})
    assert r.status_code == 400
    assert f"embeddings have {FAKE_DIMS}" in r.json()["error"]["message"]


async def test_admin_batches_reports_recent_batch_sizes_and_times(
    client: httpx.AsyncClient,
) -> None:
    responses = await asyncio.gather(
        *(
            client.post("/v1/embeddings", json={"model": "embed", "input": f"t{i}"})
            for i in range(6)
        )
    )
    assert [r.status_code for r in responses] == [200] * 6
    models = {m["name"]: m for m in (await client.get("/admin/batches")).json()["models"]}
    embed = models["embed"]
    assert embed["num_requests"] >= 6
    assert embed["num_batches"] >= 1
    assert embed["num_batches"] <= 6
    assert embed["mean_batch_size"] * embed["window"] >= 6
    assert embed["run_s_p99"] >= embed["run_s_p50"] >= 0


async def test_items_run_alone_reserve_room_for_the_largest_not_their_sum(
    client: httpx.AsyncClient, engine: Engine
) -> None:
    # One 72-unit input: ~90 MiB held at once, over the 64 MiB budget (a
    # request of several inputs would be queued as parts). An estimate
    # refuses nothing (the request runs in the room there is, measured); two
    # batches that needed more than the budget refuse the next for good. Six
    # 12-unit inputs where the model runs them one after another: ~15 MiB,
    # one input's.
    inputs = [f"{'x' * 47}{i}" for i in range(6)]
    for name in ("scratch", "scratch-alone"):
        assert (await client.post(f"/admin/models/{name}/load")).status_code == 200
    # (A reading of the resident set may come out lower where freed pages are
    # still resident: then a third or fourth run is the second over the room.)
    statuses = []
    whole = "".join(inputs)
    while len(statuses) < 6 and 413 not in statuses:
        r = await client.post("/v1/embeddings", json={"model": "scratch", "input": whole})
        statuses.append(r.status_code)
    assert statuses[:2] == [200, 200], statuses
    assert statuses[-1] == 413, statuses
    assert "could never run" in r.json()["error"]["message"]
    for _ in range(3):
        alone = await client.post(
            "/v1/embeddings", json={"model": "scratch-alone", "input": inputs}
        )
        assert alone.status_code == 200, alone.text
    assert len(alone.json()["data"]) == 6
    # Its peak was taken per unit of one input (1.25 MiB a unit allocated; the
    # reading may be lower where freed heap still resident takes part of it),
    # not spread over six (about 0.2 MiB).
    stats = engine.snapshot().model("scratch-alone")
    assert stats is not None
    assert stats.activation_bytes_per_unit is not None
    assert stats.activation_bytes_per_unit > 2**19


async def test_batch_over_its_activation_room_runs_in_parts(
    client: httpx.AsyncClient, engine: Engine
) -> None:
    # The model's warm-up measured ~1.25 MiB per work unit; the budget is 64 MiB,
    # so a batch of six 12-unit requests (~90 MiB) cannot reserve its room and
    # runs in parts (of three: ~45 MiB each).
    await client.post("/admin/models/scratch/load")
    text = "x" * 48  # 12 work units
    responses = await asyncio.gather(
        *(
            client.post("/v1/embeddings", json={"model": "scratch", "input": f"{text}{i}"})
            for i in range(6)
        )
    )
    assert [r.status_code for r in responses] == [200] * 6
    stats = engine.snapshot()
    scratch = stats.model("scratch")
    assert scratch is not None
    sizes = [size for size, _ in scratch.recent_batches]
    assert sum(sizes) == 6
    assert max(sizes) <= 3
    assert stats.peak_used_bytes <= stats.budget_bytes
