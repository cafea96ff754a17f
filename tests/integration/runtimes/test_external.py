"""The external runtime's supervision against ``tests/fakes/fake_vllm.py``: a
real engine process per model on loopback (vLLM's endpoints, a fake model),
loaded with the runtime's own loader, outside the engine."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from fakes import write_fake_vllm_model
from tessera.device import CpuDevice
from tessera.errors import ModelUnavailableError
from tessera.repository import read_spec
from tessera.runtimes.base import standalone_context
from tessera.runtimes.external import NVML_METHOD, RSS_METHOD, ExternalModel
from tessera.runtimes.registry import get_loader
from tessera.tasks.types import ChatInput, ChatMessage
from tessera.units import parse_bytes

WEIGHTS = 48 * 2**20  # the fake's --weights-mib default


def chat(max_tokens: int = 4, on_text: Callable[[str], None] | None = None) -> ChatInput:
    messages = (ChatMessage("user", "Hello there"),)
    return ChatInput(messages=messages, max_tokens=max_tokens, on_text=on_text)


def load(repository: Path, name: str, **options: object) -> ExternalModel:
    spec = read_spec(write_fake_vllm_model(repository, name, **options))  # type: ignore[arg-type]
    model = get_loader(spec.adapter).load(spec, standalone_context(threads=1))
    assert isinstance(model, ExternalModel)
    return model


def group(model: ExternalModel) -> list[psutil.Process]:
    """The engine's process group: the process and its children."""
    assert model.pid is not None
    parent = psutil.Process(model.pid)
    return [parent, *parent.children(recursive=True)]


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def model(tmp_path: Path) -> Iterator[ExternalModel]:
    model = load(tmp_path, "fake-a", args=("--engine-core-child",))
    processes = group(model)
    yield model
    model.unload()
    # SIGKILL's delivery to the group is asynchronous: a member may still be
    # dying when unload returns (make test saw one on a loaded machine).
    psutil.wait_procs([p for p in processes if not gone(p)], timeout=10)
    assert all(gone(p) for p in processes), "the engine's group outlived its unload"


def test_the_vllm_command_line_carries_the_slice_the_window_and_sleep_mode(
    model: ExternalModel,
) -> None:
    parent, child = group(model)
    argv = parent.cmdline()
    fraction = float(argv[argv.index("--gpu-memory-utilization") + 1])
    exact = parse_bytes("256MiB") / CpuDevice().total_bytes()
    assert exact - 1e-6 <= fraction <= exact  # rounded down: within the slice
    # max_batch_size x 1 batch at once, twice over for batches that step past it
    assert argv[argv.index("--max-num-seqs") + 1] == "8"
    assert argv[argv.index("--served-model-name") + 1] == "fake-a"
    assert "--enable-sleep-mode" in argv
    assert model.api_key not in " ".join(argv)  # in its environment, not on ps's screen
    assert os.getpgid(child.pid) == os.getpgid(parent.pid) == parent.pid


def test_streams_and_exports_the_engine_metrics(model: ExternalModel) -> None:
    pieces: list[str] = []
    first, second = model.run([chat(5, on_text=pieces.append), chat(3)])
    assert (first.text, first.finish_reason, first.completion_tokens) == (
        "w0 w1 w2 w3 w4", "length", 5,
    )  # fmt: skip
    assert "".join(pieces) == first.text
    assert second.completion_tokens == 3
    metrics = model.engine_metrics()
    # The ready probe ("Hi": 5 tokens in the fake, 1 out), then the batch's.
    assert metrics["generation_tokens"] == 1 + 5 + 3
    assert metrics["prompt_tokens"] == 5 + first.prompt_tokens + second.prompt_tokens
    assert (metrics["requests_running"], metrics["sleeping"], metrics["restarts"]) == (0, 0, 0)
    report = model.memory()
    assert report.method in (RSS_METHOD, NVML_METHOD)
    assert report.own_bytes > WEIGHTS


def test_a_raw_prompt_goes_to_the_engines_completions(model: ExternalModel) -> None:
    pieces: list[str] = []
    item = ChatInput(messages=(), prompt="a b c", max_tokens=3, on_text=pieces.append)
    (output,) = model.run([item])
    assert (output.text, output.completion_tokens) == ("w0 w1 w2", 3)
    assert output.prompt_tokens == 3  # the prompt's words: no chat template around them
    assert "".join(pieces) == output.text


def test_logprobs_come_back_a_token_each(model: ExternalModel) -> None:
    (output,) = model.run([dataclasses.replace(chat(3), logprobs=2)])
    assert output.logprobs is not None
    assert [t["token"] for t in output.logprobs] == ["w0 ", "w1 ", "w2"]
    assert [len(t["top_logprobs"]) for t in output.logprobs] == [2, 2, 2]
    assert model.run([chat(2)])[0].logprobs is None
    # Streamed, each piece's tokens' logprobs are told just before the piece.
    told: list[tuple[str, object]] = []
    streamed = dataclasses.replace(
        chat(3, on_text=lambda piece: told.append(("text", piece))),
        logprobs=1,
        on_logprobs=lambda tokens: told.append(("logprobs", [t["token"] for t in tokens])),
    )
    (output,) = model.run([streamed])
    assert told == [
        ("logprobs", ["w0 "]),
        ("text", "w0 "),
        ("logprobs", ["w1 "]),
        ("text", "w1 "),
        ("logprobs", ["w2"]),
        ("text", "w2"),
    ]
    # A completion's come in the legacy form (vLLM's), read into the same fields.
    prompt = ChatInput(messages=(), prompt="a b", max_tokens=2, logprobs=3)
    (completed,) = model.run([prompt])

    def scored(token: str, logprob: float) -> dict[str, object]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    assert completed.logprobs == tuple(
        {
            **scored(token, -0.5),
            "top_logprobs": [scored(token, -0.5), scored("x0", -1.0), scored("x1", -2.0)],
        }
        for token in ("w0 ", "w1")
    )


def test_sleep_frees_the_weights_and_keeps_the_process_and_wake_brings_them_back(
    model: ExternalModel,
) -> None:
    pid, awake = model.pid, model.memory().own_bytes
    assert model.sleep()
    asleep = model.memory().own_bytes
    assert awake - asleep > 0.9 * WEIGHTS
    assert model.pid == pid
    assert model.engine_metrics()["sleeping"] == 1
    model.wake()
    assert model.memory().own_bytes - asleep > 0.9 * WEIGHTS
    (output,) = model.run([chat(2)])
    assert output.text == "w0 w1"
    assert (model.pid, model.engine_metrics()["sleeping"]) == (pid, 0)


def test_a_crash_is_503_at_once_its_group_is_killed_and_the_engine_restarts(
    model: ExternalModel,
) -> None:
    parent, child = group(model)
    os.kill(parent.pid, signal.SIGKILL)
    with pytest.raises(ModelUnavailableError, match="SIGKILL") as raised:
        model.run([chat(4)])
    assert raised.value.retry_after_s is not None
    assert raised.value.retry_after_s >= 1
    assert gone(parent)
    psutil.wait_procs([child], timeout=10)
    assert gone(child), "the engine core child outlived its parent's crash"
    (output,) = model.run([chat(2)])
    assert output.text == "w0 w1"
    assert model.pid != parent.pid
    assert model.engine_metrics()["restarts"] == 1


def test_a_hung_engine_is_killed_after_its_deadline_and_restarted(tmp_path: Path) -> None:
    model = load(tmp_path, "fake-hung", idle_timeout_s=1, args=("--token-delay-s", "0.05"))
    try:
        hung = psutil.Process(model.pid)
        started: list[str] = []

        def stop_engine(piece: str) -> None:
            if not started:
                started.append(piece)
                hung.suspend()  # SIGSTOP: alive, connected, silent

        with pytest.raises(ModelUnavailableError, match=r"hung .* was killed"):
            model.run([chat(100, on_text=stop_engine)])
        assert gone(hung)
        (output,) = model.run([chat(2)])
        assert output.completion_tokens == 2
    finally:
        model.unload()


def test_ready_is_a_completion_that_answers_not_a_live_port(tmp_path: Path) -> None:
    # The fake listens at once (/health 200) but answers chats 503 for 1.5 s.
    started = time.monotonic()
    model = load(tmp_path, "fake-warming", args=("--chat-ready-after-s", "1.5"))
    try:
        assert time.monotonic() - started >= 1.5
        (output,) = model.run([chat(2)])  # the first batch is served at once
        assert output.text == "w0 w1"
    finally:
        model.unload()


def test_vllm_engines_start_one_after_another(tmp_path: Path) -> None:
    """Each measures the card's free memory at launch: the second starts only
    once the first answers (each fake's port opens 1 s after its start)."""
    specs = [
        read_spec(write_fake_vllm_model(tmp_path, name, args=("--load-delay-s", "1")))
        for name in ("fake-x", "fake-y")
    ]
    with ThreadPoolExecutor(len(specs)) as pool:
        loads = [
            pool.submit(get_loader(s.adapter).load, s, standalone_context(threads=1)) for s in specs
        ]
        models = [f.result() for f in loads]
    try:
        pids = [m.pid for m in models if isinstance(m, ExternalModel) and m.pid is not None]
        first, second = sorted(psutil.Process(pid).create_time() for pid in pids)
        assert second - first >= 1.0
    finally:
        for model in models:
            model.unload()


def test_an_engine_that_exits_at_start_is_the_models_error(tmp_path: Path) -> None:
    with pytest.raises(ModelUnavailableError, match="exited with status 2"):
        load(tmp_path, "fake-bad", args=("--no-such-option",))


def test_a_vllm_model_needs_its_slice(tmp_path: Path) -> None:
    folder = write_fake_vllm_model(tmp_path, "fake-no-slice")
    card = (folder / "model.yaml").read_text().replace("max_bytes: 256MiB", "{}")
    (folder / "model.yaml").write_text(card.replace("memory:\n  {}", "memory: {}"))
    spec = read_spec(folder)
    with pytest.raises(ModelUnavailableError, match=r"memory\.max_bytes"):
        get_loader(spec.adapter).estimate_bytes(spec)
