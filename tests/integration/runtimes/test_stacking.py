"""Batching across models (``runtimes/stacking.py``) on the CPU: tiny BERTs
of one architecture with different weights, their forwards run together
from several threads at once, and what each gets is what its own forward
gives; through the loader, cards saying ``stack: true``."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from tessera.errors import ModelUnavailableError
from tessera.repository import read_spec
from tessera.runtimes.base import standalone_context
from tessera.runtimes.graphs import stack_option
from tessera.runtimes.hf import SentenceEncoder
from tessera.runtimes.registry import get_loader
from tessera.runtimes.stacking import StackGroup, group_for, signature
from tessera.tasks.types import TextInput

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "a", "dog", "on", "mat"]


def tiny_bert(folder: Path, seed: int, hidden: int = 32) -> Path:
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
    )
    BertModel(config, add_pooling_layer=False).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> list[SentenceEncoder]:
    root = tmp_path_factory.mktemp("stack")
    return [SentenceEncoder.from_folder(tiny_bert(root / f"m{i}", i), "cpu") for i in range(3)]


TEXTS = [["the cat sat"], ["a dog", "the cat sat on the mat"], ["mat"] * 3]


def own(encoder: SentenceEncoder, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        hidden: torch.Tensor = encoder.model(**batch).last_hidden_state
    return hidden


def same_real_positions(got: torch.Tensor, want: torch.Tensor, batch: Any) -> bool:
    real = batch["attention_mask"].bool()
    return got.shape == want.shape and torch.allclose(got[real], want[real], atol=1e-5)


def test_one_stacked_forward_gives_each_model_its_own_answer(
    encoders: list[SentenceEncoder],
) -> None:
    assert len({signature(e.model, "cpu") for e in encoders}) == 1
    group = StackGroup("test", 4)
    batches = [e.tokenize(t, 64) for e, t in zip(encoders, TEXTS, strict=True)]
    got = group.stacked([e.model for e in encoders], batches)
    for encoder, batch, hidden in zip(encoders, batches, got, strict=True):
        assert same_real_positions(hidden, own(encoder, batch), batch)


def test_forwards_from_many_threads_are_combined_and_each_answered(
    encoders: list[SentenceEncoder],
) -> None:
    group = StackGroup("test", 4)
    started = threading.Barrier(9)
    jobs = [(encoders[i % 3], TEXTS[i % 3]) for i in range(9)]

    def call(job: tuple[SentenceEncoder, list[str]]) -> bool:
        encoder, texts = job
        batch = encoder.tokenize(texts, 64)
        started.wait()
        hidden = group.forward(encoder.model, batch, lambda b: own(encoder, b))
        return same_real_positions(hidden, own(encoder, batch), batch)

    with ThreadPoolExecutor(9) as pool:
        assert all(pool.map(call, jobs))
    assert group.num_rounds >= 1  # nine at once: some waited and were stacked
    assert group.num_stacked >= 2


def test_a_forward_alone_runs_its_own_forward(encoders: list[SentenceEncoder]) -> None:
    group = StackGroup("test", 4)
    solo_calls = []

    def solo(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        solo_calls.append(1)
        return own(encoders[0], batch)

    batch = encoders[0].tokenize(["the cat"], 64)
    assert same_real_positions(group.forward(encoders[0].model, batch, solo), solo(batch), batch)
    assert len(solo_calls) == 2
    assert group.num_rounds == 0


def test_a_failed_round_fails_its_calls_and_the_group_goes_on(
    encoders: list[SentenceEncoder],
) -> None:
    group = StackGroup("test", 4)
    batch = encoders[0].tokenize(["the cat"], 64)

    def broken(_: Mapping[str, torch.Tensor]) -> torch.Tensor:
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        group.forward(encoders[0].model, batch, broken)
    again = group.forward(encoders[0].model, batch, lambda b: own(encoders[0], b))
    assert same_real_positions(again, own(encoders[0], batch), batch)


def test_another_architecture_is_another_group(tmp_path: Path) -> None:
    wide = SentenceEncoder.from_folder(tiny_bert(tmp_path / "wide", 0, hidden=48), "cpu")
    narrow = SentenceEncoder.from_folder(tiny_bert(tmp_path / "narrow", 0), "cpu")
    assert group_for(wide.model, "cpu", 4) is not group_for(narrow.model, "cpu", 4)
    assert group_for(narrow.model, "cpu", 4) is group_for(narrow.model, "cpu", 4)
    assert group_for(narrow.model, "cpu", 4) is not group_for(narrow.model, "cpu", 8)


def card(root: Path, name: str, weights: Path, stack: object) -> Path:
    folder = root / name
    folder.mkdir()
    raw = {
        "name": name,
        "task": "embedding",
        "runtime": "torch",
        "adapter": "hf-encoder",
        "source": {"path": str(weights)},
        "options": {"stack": stack},
    }
    (folder / "model.yaml").write_text(yaml.safe_dump(raw))
    return folder


def test_cards_saying_stack_run_together_and_answer_as_alone(tmp_path: Path) -> None:
    weights = [tiny_bert(tmp_path / f"w{i}", 10 + i) for i in range(2)]
    cards = [card(tmp_path, f"tenant-{i}", w, True) for i, w in enumerate(weights)]
    plain = [card(tmp_path, f"plain-{i}", w, False) for i, w in enumerate(weights)]
    ctx = standalone_context(threads=1)
    stacked = [get_loader("hf-encoder").load(read_spec(c), ctx) for c in cards]
    alone = [get_loader("hf-encoder").load(read_spec(c), ctx) for c in plain]
    items = [TextInput("the cat sat on the mat"), TextInput("a dog")]
    started = threading.Barrier(8)

    def call(i: int) -> list[Any]:
        started.wait()
        outputs: list[Any] = stacked[i % 2].run(items)
        return outputs

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(8)))
    for i, outputs in enumerate(results):
        want = alone[i % 2].run(items)
        assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(outputs, want, strict=True))
    for model in stacked + alone:
        model.unload()


@pytest.mark.parametrize(("value", "models"), [(True, 16), (False, 0), (4, 4)])
def test_the_stack_option(tmp_path: Path, value: object, models: int) -> None:
    spec = read_spec(card(tmp_path, "m", tmp_path, value))
    assert stack_option(spec) == models


@pytest.mark.parametrize("value", [1, "yes", 2.5])
def test_a_bad_stack_option_is_refused(tmp_path: Path, value: object) -> None:
    spec = read_spec(card(tmp_path, "m", tmp_path, value))
    with pytest.raises(ModelUnavailableError, match="option stack"):
        stack_option(spec)
