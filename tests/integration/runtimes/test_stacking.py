"""Batching across models (``runtimes/stacking.py``) on the CPU: tiny BERTs
of one architecture with different weights, their forwards run together
from several threads at once, and what each gets is what its own forward
gives; through the loader, cards saying ``stack: true``."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import copy
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from builders import replay_like
from tessera.errors import ModelUnavailableError
from tessera.repository import read_spec
from tessera.runtimes.base import SharedComponents, standalone_context
from tessera.runtimes.forward import graphs_path, stack_option
from tessera.runtimes.graphs import GraphsHold, SharedGraphs, StackedRounds, Stacking
from tessera.runtimes.hf import SentenceEncoder
from tessera.runtimes.hostcopy import gather_block
from tessera.runtimes.padding import stacked_inputs
from tessera.runtimes.registry import get_loader
from tessera.runtimes.stacking import (
    STACK_ROWS,
    Rendezvous,
    StackedGraphs,
    StackGroup,
    group_for,
)
from tessera.runtimes.template import signature, weight_tensors
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


# --- stacked rounds through an architecture's graphs --------------------------------

OUTPUT = "last_hidden_state"
HANG_GUARD_S = 30.0


def ids_of(encoder: SentenceEncoder, texts: list[str]) -> list[np.ndarray]:
    """Texts tokenised as a gateway tokenises them ahead (``runtimes.tokens``)."""
    rows = encoder.tokenizer(texts, truncation=True, max_length=64)["input_ids"]
    return [np.array(row, dtype=np.int32) for row in rows]


def stacked_graphs(
    encoder: SentenceEncoder, max_models: int = 4, make_runner: Any = replay_like
) -> SharedGraphs:
    """The architecture's graphs with stacked rounds, a graph's ways stood in
    on the CPU (``builders.replay_like``), every bucket built."""
    shared = SharedGraphs.of(
        encoder.model,
        encoder.tokenizer,
        OUTPUT,
        make_runner,
        Stacking(max_models, StackedGraphs),
    )
    shared.prepare("cpu")
    return shared


def rounds_of(stacked: StackedRounds | None) -> StackedGraphs:
    assert isinstance(stacked, StackedGraphs)
    return stacked


def one_round(
    stacked: StackedGraphs,
    calls: list[tuple[SentenceEncoder, list[str]]],
    pooling: str = "mean",
    shared: SharedGraphs | None = None,
) -> list[np.ndarray]:
    """``calls`` answered in one stacked round: a first call leads a round of
    its own whose forward waits until the others queue behind it; they are
    the next round. Each call's own forward (a round of one, a failed
    bucket's) is through ``shared``'s graphs, or gives nothing."""
    ready = threading.Event()
    first_model = calls[0][0].model

    def first_solo() -> torch.Tensor | None:
        assert ready.wait(HANG_GUARD_S)
        return None

    with ThreadPoolExecutor(len(calls) + 1) as pool:
        leader = pool.submit(
            stacked.round_vectors, first_model, ids_of(calls[0][0], ["x"]), "mean", first_solo
        )
        while stacked.rounds.num_waiting:  # the leader has begun
            pass

        def solo(model: Any, ids: list[np.ndarray]) -> Any:
            return lambda: shared.vectors(model, ids, pooling) if shared is not None else None

        futures = []
        for e, texts in calls:
            ids = ids_of(e, texts)
            futures.append(
                pool.submit(stacked.round_vectors, e.model, ids, pooling, solo(e.model, ids))
            )
        deadline = time.monotonic() + HANG_GUARD_S
        while stacked.rounds.num_waiting < len(calls) and time.monotonic() < deadline:
            time.sleep(0.001)
        ready.set()
        assert leader.result() is None
        return [f.result() for f in futures]


def own_vectors(encoder: SentenceEncoder, texts: list[str], pooling: str = "mean") -> np.ndarray:
    return encoder.encode(texts, pooling=pooling, normalize=False, max_length=64)  # type: ignore[arg-type]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_a_stacked_round_gives_each_model_its_own_vectors(
    encoders: list[SentenceEncoder], pooling: str
) -> None:
    shared = stacked_graphs(encoders[0])
    stacked = rounds_of(shared.stacked)
    try:
        calls = list(zip(encoders, TEXTS, strict=True))
        got = one_round(stacked, calls, pooling)
        assert stacked.num_rounds == 1
        assert stacked.num_stacked == 3
        for (encoder, texts), vectors in zip(calls, got, strict=True):
            np.testing.assert_allclose(vectors, own_vectors(encoder, texts, pooling), atol=1e-5)
        # Each round's vectors are its callers', not overwritten by the next replay.
        again = one_round(stacked, calls[::-1], pooling)
        for (encoder, texts), vectors in zip(calls[::-1], again, strict=True):
            np.testing.assert_allclose(vectors, own_vectors(encoder, texts, pooling), atol=1e-5)
        np.testing.assert_allclose(got[0], own_vectors(encoders[0], TEXTS[0], pooling), atol=1e-5)
    finally:
        shared.close()


def test_a_model_finds_its_weights_in_the_slot_it_had(encoders: list[SentenceEncoder]) -> None:
    shared = stacked_graphs(encoders[0])
    stacked = rounds_of(shared.stacked)
    try:
        first = [(encoders[0], ["the cat"]), (encoders[1], ["a dog"])]
        one_round(stacked, first)
        assert stacked.num_copies == 2
        one_round(stacked, first[::-1])  # both in their slots already
        assert stacked.num_copies == 2
        got = one_round(stacked, [(encoders[2], ["mat"]), (encoders[0], ["the cat"])])
        assert stacked.num_copies == 3  # the new one only, into a slot not in use
        np.testing.assert_allclose(got[0], own_vectors(encoders[2], ["mat"]), atol=1e-5)
        np.testing.assert_allclose(got[1], own_vectors(encoders[0], ["the cat"]), atol=1e-5)
    finally:
        shared.close()


def test_gathered_models_go_into_a_slot_as_one_copy(
    encoders: list[SentenceEncoder], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As GraphsHold.acquire leaves each model on CUDA: one block, laid out as
    # the host tier lays it; such a model goes into a slot as one copy.
    from tessera.runtimes import stacking as stacking_module

    models = [copy.deepcopy(e.model) for e in encoders[:2]]
    for model in models:
        gather_block(weight_tensors(model))
    gathered = [copy.copy(e) for e in encoders[:2]]
    for encoder, model in zip(gathered, models, strict=True):
        encoder.model = model

    def fused(*args: Any) -> None:
        raise AssertionError("a gathered model's weights went in tensor by tensor")

    monkeypatch.setattr(stacking_module, "copy_weights", fused)
    shared = stacked_graphs(gathered[0])
    stacked = rounds_of(shared.stacked)
    try:
        calls = [(gathered[0], ["the cat sat"]), (gathered[1], ["a dog", "on the mat"])]
        got = one_round(stacked, calls)
        for (encoder, texts), vectors in zip(calls, got, strict=True):
            np.testing.assert_allclose(vectors, own_vectors(encoder, texts), atol=1e-5)
        with pytest.raises(AssertionError, match="tensor by tensor"):
            one_round(stacked, [(encoders[2], ["mat"]), (gathered[0], ["x"])])
    finally:
        shared.close()


def test_batches_too_big_for_a_round_and_rounds_of_one_run_alone(
    encoders: list[SentenceEncoder],
) -> None:
    shared = stacked_graphs(encoders[0])
    stacked = rounds_of(shared.stacked)
    encoder = encoders[1]
    try:
        for texts in (["the cat"], ["a dog"] * (STACK_ROWS[-1] + 1), ["the cat " * 40]):
            ids = ids_of(encoder, texts)
            got = stacked.round_vectors(
                encoder.model,
                ids,
                "mean",
                lambda ids=ids: shared.vectors(encoder.model, ids, "mean"),
            )
            assert got is not None
            np.testing.assert_allclose(got, own_vectors(encoder, texts), atol=1e-5)
        assert stacked.num_rounds == 0
        assert stacked.num_copies == 0
    finally:
        shared.close()


def test_a_round_whose_graph_failed_to_build_runs_each_batch_alone(
    encoders: list[SentenceEncoder],
) -> None:
    def no_stacked_graphs(step: Any, example: Any) -> Any:
        if example["input_ids"].dim() == 3:  # (models, rows, columns): a stacked bucket
            raise RuntimeError("operation not permitted when stream is capturing")
        return replay_like(step, example)

    shared = stacked_graphs(encoders[0], make_runner=no_stacked_graphs)
    stacked = rounds_of(shared.stacked)
    try:
        assert stacked.runners.num_runners == 0
        calls = [(encoders[0], ["the cat"]), (encoders[1], ["a dog", "on the mat"])]
        got = one_round(stacked, calls, shared=shared)
        for (encoder, texts), vectors in zip(calls, got, strict=True):
            np.testing.assert_allclose(vectors, own_vectors(encoder, texts), atol=1e-5)
        assert stacked.num_rounds == 0  # not an eager vmap of every slot: each alone
        assert stacked.num_copies == 0
    finally:
        shared.close()


def test_stacked_slots_leave_the_device_with_the_graphs_and_come_back_empty(
    encoders: list[SentenceEncoder],
) -> None:
    shared = stacked_graphs(encoders[0])
    stacked = rounds_of(shared.stacked)
    try:
        assert shared.num_bytes == encoders[0].num_bytes + stacked.num_bytes
        assert stacked.num_bytes == 4 * stacked.slot_bytes
        calls = [(encoders[0], ["the cat"]), (encoders[1], ["a dog"])]
        one_round(stacked, calls)
        assert stacked.runners.num_runners > 0
        stacked.offload()
        assert stacked.num_bytes == 0
        assert stacked.runners.num_runners == 0
        stacked.restore()
        assert stacked.num_bytes == 4 * stacked.slot_bytes
        got = one_round(stacked, calls)  # copied in again: the slots were emptied
        assert stacked.num_copies == 4
        for (encoder, texts), vectors in zip(calls, got, strict=True):
            np.testing.assert_allclose(vectors, own_vectors(encoder, texts), atol=1e-5)
    finally:
        shared.close()


def test_stacked_inputs_put_each_batch_in_its_slot_and_pad_the_rest() -> None:
    groups = [
        [np.array([5, 6, 7], dtype=np.int32)],
        [np.array([8], dtype=np.int32), np.array([9, 10], dtype=np.int32)],
    ]
    keys = ("input_ids", "token_type_ids", "attention_mask")
    packed = stacked_inputs(groups, 3, 2, 4, 1, keys)
    assert list(packed) == list(keys)  # the tokenizer's order, one block
    assert tuple(packed.block.shape) == (3, 3, 2, 4)
    assert packed["input_ids"].tolist() == [
        [[5, 6, 7, 1], [1, 1, 1, 1]],  # a batch of one in rows of two: a padded row
        [[8, 1, 1, 1], [9, 10, 1, 1]],
        [[1, 1, 1, 1], [1, 1, 1, 1]],  # a slot of no batch: all padding
    ]
    assert packed["attention_mask"].tolist() == [
        [[1, 1, 1, 0], [0, 0, 0, 0]],
        [[1, 0, 0, 0], [1, 1, 0, 0]],
        [[0, 0, 0, 0], [0, 0, 0, 0]],
    ]
    assert not packed["token_type_ids"].any()


def test_the_next_round_is_launched_before_this_one_finishes() -> None:
    # A round's leader hands the lead on between launching and finishing:
    # the first round's finish waits for the second round's launch.
    launched_second = threading.Event()
    order: list[str] = []

    def launch(items: list[str]) -> Any:
        order.append(f"launch {items}")
        if items == ["b"]:
            launched_second.set()

        def finish() -> list[str]:
            if items == ["a"]:
                assert launched_second.wait(HANG_GUARD_S)
            order.append(f"finish {items}")
            return [f"done {item}" for item in items]

        return finish

    rounds: Rendezvous[str] = Rendezvous(4, launch)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(rounds.submit, "a")
        while not order:
            time.sleep(0.001)
        second = pool.submit(rounds.submit, "b")
        assert first.result() == "done a"
        assert second.result() == "done b"
    assert order == ["launch ['a']", "launch ['b']", "finish ['b']", "finish ['a']"]


def test_a_failed_finish_fails_its_round_and_the_rounds_go_on() -> None:
    def launch(items: list[str]) -> Any:
        def finish() -> list[str]:
            if "bad" in items:
                raise RuntimeError("CUDA error: an illegal memory access")
            return list(items)

        return finish

    rounds: Rendezvous[str] = Rendezvous(4, launch)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        rounds.submit("bad")
    assert rounds.submit("good") == "good"


def test_encoders_with_stacked_graphs_answer_texts_tokenised_ahead(
    encoders: list[SentenceEncoder],
) -> None:
    shared = SharedComponents()
    holds = [
        GraphsHold.acquire(
            shared,
            e.model,
            e.tokenizer,
            OUTPUT,
            make_runner=replay_like,
            stacking=Stacking(4, StackedGraphs),
        )
        for e in encoders
    ]
    assert len({hold.key for hold in holds}) == 1  # one component, its slots counted in it
    stacked = rounds_of(holds[0].graphs.stacked)
    assert holds[0].num_bytes >= encoders[0].num_bytes + stacked.num_bytes
    views = [copy.copy(e) for e in encoders]
    for view, hold in zip(views, holds, strict=True):
        view.path = graphs_path(view.model, view.tokenizer, "cpu", hold)
    started = threading.Barrier(9, timeout=HANG_GUARD_S)

    def call(i: int) -> bool:
        encoder, texts = views[i % 3], TEXTS[i % 3]
        ids = ids_of(encoder, texts)
        started.wait()
        got = encoder.encode_ids(ids)
        return bool(np.allclose(got, encoder.encode(texts, max_length=64), atol=1e-5))

    try:
        with ThreadPoolExecutor(9) as pool:
            assert all(pool.map(call, range(9)))
    finally:
        for hold in holds:
            hold.release(parked=False)
