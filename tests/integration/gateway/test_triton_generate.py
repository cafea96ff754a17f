"""Triton's conventions for text generation (``gateway/triton_llm.py``) over
the fake generate model (it says its prompt back, a word a piece): the
generate extension, whole and streamed, and KServe infer's ``text_input``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest


def events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


async def streamed(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with client.stream("POST", "/v2/models/chat/generate_stream", json=body) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        return events([line async for line in stream.aiter_lines()])


async def test_generate_answers_the_text_with_its_parameters(
    shared_client: httpx.AsyncClient,
) -> None:
    body = {"text_input": "one two three", "parameters": {"stream": False, "temperature": 0}}
    r = await shared_client.post("/v2/models/chat/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == {"model_name": "chat", "model_version": "1", "text_output": "one two three "}
    # TensorRT-LLM's form: parameters beside the prompt, empty word lists; the
    # vLLM backend's: numbers as strings; the prompt first where not excluded.
    body = {
        "text_input": "a b",
        "max_tokens": "20",
        "bad_words": [""],
        "stop_words": [""],
        "parameters": {
            "exclude_input_in_output": False,
            "return_finish_reason": True,
            "return_num_input_tokens": True,
            "return_num_output_tokens": "true",
            "top_k": -1,
            "random_seed": 3,
        },
    }
    r = await shared_client.post("/v2/models/chat/versions/1/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "model_name": "chat",
        "model_version": "1",
        "text_output": "a ba b ",
        "finish_reason": "stop",
        "num_input_tokens": 1,
        "num_output_tokens": 2,
    }


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"text_input": "a", "parameters": {"foo": 1}}, 400, "foo: Extra inputs"),
        ({"text_input": "a", "top_k": 5}, 400, "top-k sampling is not served"),
        ({"text_input": "a", "beam_width": 2}, 400, "beam search is not served"),
        ({"text_input": "a", "bad_words": ["x"]}, 400, "banning words is not served"),
        ({"text_input": "a", "stop": "x", "stop_words": ["y"]}, 400, "not both"),
        ({"text_input": "a", "max_tokens": 0}, 400, "max_tokens"),
        ({"text_input": "a", "parameters": {"stream": True}}, 400, "generate_stream"),
        ({"text_input": ""}, 400, "text_input[0] must not be empty"),
        ({"parameters": {}}, 400, "text_input must be a string"),
        ({"text_input": "a", "parameters": [1]}, 400, "parameters must be a JSON object"),
        ([1], 400, "must be a JSON object"),
    ],
)
async def test_bad_generate_requests_say_why_in_kserves_shape(
    shared_client: httpx.AsyncClient, body: object, status: int, says: str
) -> None:
    r = await shared_client.post("/v2/models/chat/generate", json=body)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]


async def test_generate_refuses_what_it_cannot_serve(shared_client: httpx.AsyncClient) -> None:
    r = await shared_client.post("/v2/models/chat/generate", content=b"{not json")
    assert (r.status_code, r.json()) == (400, {"error": "the body is not valid JSON"})
    r = await shared_client.post("/v2/models/embed/generate", json={"text_input": "a"})
    assert r.status_code == 400
    assert "does embedding, not generate" in r.json()["error"]
    r = await shared_client.post("/v2/models/nope/generate", json={"text_input": "a"})
    assert r.status_code == 404
    assert isinstance(r.json()["error"], str)


async def test_generate_stream_sends_pieces_as_they_come(shared_client: httpx.AsyncClient) -> None:
    parameters = {"stream": True, "return_num_output_tokens": True}
    sent = await streamed(shared_client, {"text_input": "a b c", "parameters": parameters})
    assert [event["text_output"] for event in sent] == ["a ", "b ", "c ", ""]
    assert sent[-1]["num_output_tokens"] == 3
    assert all(event["model_name"] == "chat" for event in sent)
    # The prompt first where it is not excluded; nothing after the text without extras.
    parameters = {"stream": True, "exclude_input_in_output": False}
    sent = await streamed(shared_client, {"text_input": "x y", "parameters": parameters})
    assert [event["text_output"] for event in sent] == ["x y", "x ", "y "]
    # Without stream: the whole text in one event, as Triton's backends answer.
    sent = await streamed(shared_client, {"text_input": "x y"})
    assert [event["text_output"] for event in sent] == ["x y "]
    # A request refused before it runs is an HTTP error, not an event.
    r = await shared_client.post(
        "/v2/models/chat/generate_stream", json={"text_input": "a", "top_k": 3}
    )
    assert r.status_code == 400
    assert "top-k" in r.json()["error"]


def tensor(name: str, datatype: str, shape: list[int], data: list[Any]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


async def test_infer_generates_text_output_in_text_inputs_shape(
    shared_client: httpx.AsyncClient,
) -> None:
    body = {
        "inputs": [
            tensor("text_input", "BYTES", [2, 1], [["one two"], ["three"]]),
            tensor("max_tokens", "INT32", [1, 1], [[8]]),
            tensor("exclude_input_in_output", "BOOL", [1], [True]),
            tensor("sampling_parameters", "BYTES", [1], ['{"temperature": "0.5"}']),
        ],
        "parameters": {"top_p": 0.9, "priority": 1},  # priority: Triton's own, not sampling
        "outputs": [{"name": "text_output"}, {"name": "num_output_tokens"}],
    }
    r = await shared_client.post("/v2/models/chat/infer", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"] == [
        tensor("text_output", "BYTES", [2, 1], ["one two ", "three "]),
        tensor("num_output_tokens", "UINT32", [2, 1], [2, 1]),
    ]
    # Without outputs named: the text alone, unless a return_ flag asks for more.
    body = {"inputs": [tensor("text_input", "BYTES", [1], ["hi"])]}
    r = await shared_client.post("/v2/models/chat/infer", json=body)
    assert [o["name"] for o in r.json()["outputs"]] == ["text_output"]
    body["inputs"].append(tensor("return_finish_reason", "BOOL", [1], [True]))
    r = await shared_client.post("/v2/models/chat/infer", json=body)
    assert r.json()["outputs"][1] == tensor("finish_reason", "BYTES", [1], ["stop"])


async def test_infer_streams_a_generation_to_a_caller_that_accepts_events(
    shared_client: httpx.AsyncClient,
) -> None:
    body = {
        "id": "r7",
        "inputs": [
            tensor("text_input", "BYTES", [1, 1], [["a b"]]),
            tensor("stream", "BOOL", [1], [True]),
            tensor("return_finish_reason", "BOOL", [1], [True]),
        ],
    }
    accept = {"accept": "text/event-stream"}
    async with shared_client.stream(
        "POST", "/v2/models/chat/infer", json=body, headers=accept
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        sent = events([line async for line in r.aiter_lines()])
    assert [(e["id"], e["outputs"], e["parameters"]) for e in sent] == [
        ("r7", [tensor("text_output", "BYTES", [1, 1], ["a "])], {"triton_final_response": False}),
        ("r7", [tensor("text_output", "BYTES", [1, 1], ["b "])], {"triton_final_response": False}),
        (
            "r7",
            [tensor("finish_reason", "BYTES", [1, 1], ["stop"])],
            {"triton_final_response": True},
        ),
    ]
    # Not streamed where it cannot be: two prompts, or a caller without the header.
    two = {"inputs": [tensor("text_input", "BYTES", [2], ["a", "b"]), *body["inputs"][1:]]}
    r = await shared_client.post("/v2/models/chat/infer", json=two, headers=accept)
    assert (r.status_code, r.json()["error"]) == (
        400,
        "a streamed generation takes one prompt, not 2",
    )
    r = await shared_client.post("/v2/models/chat/infer", json=body)
    assert r.status_code == 400
    assert "infer answers once" in r.json()["error"]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (tensor("max_tokens", "INT32", [2], [1, 2]), "'max_tokens' holds one value, not 2"),
        (tensor("sampling_parameters", "BYTES", [1], ["[1]"]), "one JSON object"),
        (tensor("sampling_parameters", "BYTES", [1], ["{"]), "one JSON object"),
        (tensor("top_k", "INT32", [1], [40]), "top-k sampling is not served"),
        (tensor("nucleus", "FP32", [1], [0.5]), "nucleus: Extra inputs"),
    ],
)
async def test_bad_generation_infer_requests_say_why(
    shared_client: httpx.AsyncClient, extra: dict[str, Any], says: str
) -> None:
    body = {"inputs": [tensor("text_input", "BYTES", [1], ["hi"]), extra]}
    r = await shared_client.post("/v2/models/chat/infer", json=body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]


async def test_a_generate_models_metadata_and_config_name_its_tensors(
    shared_client: httpx.AsyncClient,
) -> None:
    meta = (await shared_client.get("/v2/models/chat")).json()
    assert meta["inputs"][0] == {"name": "text_input", "datatype": "BYTES", "shape": [-1]}
    assert {"max_tokens", "temperature", "sampling_parameters"} <= {
        i["name"] for i in meta["inputs"]
    }
    assert [o["name"] for o in meta["outputs"]] == [
        "text_output",
        "finish_reason",
        "num_input_tokens",
        "num_output_tokens",
    ]
    config = (await shared_client.get("/v2/models/chat/config")).json()
    assert config["input"][0] == {"name": "text_input", "data_type": "TYPE_STRING", "dims": [-1]}
    assert {"name": "max_tokens", "data_type": "TYPE_INT32", "dims": [1], "optional": True} in (
        config["input"]
    )
