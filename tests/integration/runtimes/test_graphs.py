"""The GPU paths of the text encoders that run on the CPU too: the bucketed
forward (padding, the additive mask, cutting back, the fallbacks) with an
eager runner in place of a CUDA graph, and the precision check, on the
packaged MiniLM. The CUDA graphs themselves are tests/gpu/test_cuda.py's."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import contextlib
import copy
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from builders import replay_like
from tessera.errors import ModelUnavailableError
from tessera.repository import default_repository_path, read_spec
from tessera.runtimes.base import SharedComponents, standalone_context
from tessera.runtimes.forward import device_options, encoder_variant, graphs_path
from tessera.runtimes.graph_runner import Runner, Step, eager_runner, static_inputs
from tessera.runtimes.graphs import (
    BATCH_BUCKETS,
    LENGTH_BUCKETS,
    GraphForward,
    GraphsHold,
    SharedGraphs,
)
from tessera.runtimes.hf import SentenceEncoder, encoder_key
from tessera.runtimes.hostcopy import gather_block
from tessera.runtimes.memory import torch_module_bytes
from tessera.runtimes.padding import Inputs, PackedInputs, host_inputs
from tessera.runtimes.precision import CHECK_TEXTS, reduce_precision
from tessera.runtimes.registry import get_loader
from tessera.runtimes.template import by_dtype, copy_weights, same_layout, weight_tensors
from tessera.tasks.types import TextInput

pytestmark = pytest.mark.slow

MODEL = default_repository_path() / "all-minilm-l6-v2"
OUTPUT = "last_hidden_state"


@pytest.fixture(scope="module")
def encoder() -> Iterator[SentenceEncoder]:
    spec = read_spec(MODEL)
    found = SentenceEncoder.from_folder(spec.resolve_source(), "cpu")
    yield found
    found.close()


def forward_of(encoder: SentenceEncoder, make_runner: Any = eager_runner) -> GraphForward:
    return GraphForward(
        encoder.model,
        "last_hidden_state",
        encoder.tokenizer.pad_token_id,
        make_runner,
        input_keys=encoder.tokenizer.model_input_names,
    )


def plain(encoder: SentenceEncoder, batch: Any) -> torch.Tensor:
    with torch.inference_mode():
        hidden: torch.Tensor = encoder.model(**batch).last_hidden_state
    return hidden


@pytest.mark.parametrize(
    "texts",
    [
        ["one"],  # batch 1, length 3: bucket (1, 16)
        ["a short one", "and a somewhat longer sentence than the first"],  # (2, 16)
        [f"sentence number {i} " * (i + 1) for i in range(5)],  # (8, 32): rows padded too
        ["word " * 40, "x"],  # length 42: bucket 64
        [f"text {i}" for i in range(20)],  # (32, 16)
    ],
)
def test_a_bucket_gives_the_plain_forwards_vectors(
    encoder: SentenceEncoder, texts: list[str]
) -> None:
    graphs = forward_of(encoder)
    batch = encoder.tokenize(texts, 256)
    graphs(batch)  # the first use runs eager; the second builds the bucket
    got = graphs(batch)
    want = plain(encoder, batch)
    assert got.shape == want.shape
    real = batch["attention_mask"].bool()
    assert torch.allclose(got[real], want[real], atol=1e-4)  # the padded positions differ
    assert graphs.num_runners == 1


def test_larger_batches_and_longer_texts_run_eager(encoder: SentenceEncoder) -> None:
    built: list[tuple[int, ...]] = []

    def counting(step: Step, example: Inputs) -> Runner:
        built.append(tuple(example["input_ids"].shape))
        return eager_runner(step, example)

    graphs = forward_of(encoder, counting)
    wide = encoder.tokenize(["word " * 100], 256)  # 102 tokens: over 64
    many = encoder.tokenize(["x"] * 33, 256)  # 33 rows: over 32
    assert torch.allclose(graphs(wide), plain(encoder, wide), atol=1e-5)
    assert torch.allclose(graphs(many), plain(encoder, many), atol=1e-5)
    assert built == []


def test_a_bucket_that_cannot_be_built_runs_eager_and_is_not_tried_again(
    encoder: SentenceEncoder,
) -> None:
    tries = []

    def failing(step: Step, example: Inputs) -> Runner:
        tries.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = forward_of(encoder, failing)
    batch = encoder.tokenize(["hello there"], 256)
    for _ in range(4):
        assert torch.allclose(graphs(batch), plain(encoder, batch), atol=1e-5)
    assert tries == [1]
    assert graphs.num_runners == 0


def test_prepare_builds_every_bucket_and_reset_drops_them(encoder: SentenceEncoder) -> None:
    graphs = forward_of(encoder)
    graphs.prepare("cpu")
    assert graphs.num_runners == len(BATCH_BUCKETS) * len(LENGTH_BUCKETS) == 6 * 3
    graphs.reset()
    assert graphs.num_runners == 0
    batch = encoder.tokenize(["back again"], 256)
    assert torch.allclose(graphs(batch), plain(encoder, batch), atol=1e-4)
    assert graphs.num_runners == 0  # one use: eager
    assert torch.allclose(graphs(batch), plain(encoder, batch), atol=1e-4)
    assert graphs.num_runners == 1  # built again on the second


def test_vectors_through_the_buckets_match_the_encoders(encoder: SentenceEncoder) -> None:
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "Nothing alike."]
    want = encoder.encode(texts)
    shared = SharedComponents()
    hold = GraphsHold.acquire(
        shared, encoder.model, encoder.tokenizer, OUTPUT, make_runner=eager_runner
    )
    with graphs_of(encoder, hold):
        got = encoder.encode(texts)
    assert np.allclose(got, want, atol=1e-5)


@contextlib.contextmanager
def graphs_of(encoder: SentenceEncoder, hold: GraphsHold) -> Iterator[None]:
    """``encoder`` on the path through ``hold``'s graphs for a while, then
    back on its own (the hold released)."""
    own = encoder.path
    encoder.path = graphs_path(encoder.model, encoder.tokenizer, "cpu", hold)
    try:
        yield
    finally:
        encoder.path = own
        hold.release(parked=False)


def other_weights(encoder: SentenceEncoder) -> Any:
    """A copy of the encoder's model with other weights: a fine-tune, as far
    as shapes go, numbered as the GPU check numbers its copies."""
    other = copy.deepcopy(encoder.model)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(1.02)
    other.config.tessera_gpu_check_copy = 7  # a key of the copy's: it shapes nothing
    return other


def forward(model: Any, batch: Any) -> torch.Tensor:
    with torch.inference_mode():
        hidden: torch.Tensor = model(**batch).last_hidden_state
    return hidden


def test_one_architectures_graphs_run_each_model_with_its_own_weights(
    encoder: SentenceEncoder,
) -> None:
    other = other_weights(encoder)
    shared = SharedGraphs.of(encoder.model, encoder.tokenizer, OUTPUT, eager_runner)
    shared.prepare("cpu")
    batch = encoder.tokenize(["a sentence", "and another, longer one"], 256)
    real = batch["attention_mask"].bool()
    mine, theirs = forward(encoder.model, batch), forward(other, batch)
    assert not torch.allclose(mine[real], theirs[real], atol=1e-3)  # the weights differ
    for model, want in ((encoder.model, mine), (encoder.model, mine), (other, theirs)):
        assert torch.allclose(shared(model, batch)[real], want[real], atol=1e-4)
    assert torch.allclose(shared(encoder.model, batch)[real], mine[real], atol=1e-4)
    assert shared.template.num_copies == 3  # the first model's, the other's, the first's again
    wide = encoder.tokenize(["word " * 100], 256)  # outside the buckets: its own forward
    assert torch.allclose(shared(other, wide), forward(other, wide), atol=1e-5)
    assert shared.template.num_copies == 3


def test_models_gathered_into_one_block_go_into_the_template_as_one_copy(
    encoder: SentenceEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As GraphsHold.acquire leaves each model on CUDA: every tensor a view of
    # one block laid out as the host tier's restore lays it, values and tied
    # weights kept; a model so gathered goes into the template (gathered too)
    # as one copy of its block, never the fused copy a dtype.
    from tessera.runtimes import template as template_module

    mine, other = copy.deepcopy(encoder.model), other_weights(encoder)
    batch = encoder.tokenize(["a sentence", "and another, longer one"], 256)
    real = batch["attention_mask"].bool()
    want = {id(m): forward(m, batch) for m in (mine, other)}
    for model in (mine, other):
        tensors = weight_tensors(model)
        block = gather_block(tensors)
        assert {t.untyped_storage().data_ptr() for t in tensors} == {block.data_ptr()}
        assert gather_block(tensors) is not None
        assert gather_block(tensors).data_ptr() == block.data_ptr()  # gathered once
        assert torch.equal(forward(model, batch), want[id(model)])
    assert same_layout(weight_tensors(mine), weight_tensors(other))

    def fused(*args: Any) -> None:
        raise AssertionError("a gathered model's weights went in tensor by tensor")

    monkeypatch.setattr(template_module, "copy_weights", fused)
    shared = SharedGraphs.of(mine, encoder.tokenizer, OUTPUT, eager_runner)
    shared.prepare("cpu")
    # The template is one block as large as a model's (a deep copy alone
    # copied the block once a buffer).
    assert torch_module_bytes(shared.template.module) == block.nbytes()
    with torch.inference_mode():  # the first copy in as a worker makes it, the next outside
        assert torch.allclose(shared(other, batch)[real], want[id(other)][real], atol=1e-4)
    for model in (mine, other):
        assert torch.allclose(shared(model, batch)[real], want[id(model)][real], atol=1e-4)
    assert shared.template.num_copies == 3
    ungathered = other_weights(encoder)  # not one block: a fused copy a dtype
    with pytest.raises(AssertionError, match="tensor by tensor"):
        shared(ungathered, batch)


def test_host_inputs_are_one_block_in_the_order_the_tokenizer_names_them() -> None:
    # What a graph's runner copies in one call where its static inputs are
    # packed alike (CudaGraphRunners): the padded ids, the mask and zeros
    # for the token types, rows of one int64 block in the tokenizer's order.
    ids = [np.array([5, 6, 7], dtype=np.int32), np.array([8], dtype=np.int32)]
    keys = ("input_ids", "token_type_ids", "attention_mask")
    inputs = host_inputs(ids, 4, 5, 1, keys)
    assert isinstance(inputs, PackedInputs)
    assert tuple(inputs) == keys
    assert inputs.block.shape == (3, 4, 5)
    assert inputs.block.dtype == torch.int64
    for row, key in enumerate(keys):
        assert inputs[key].data_ptr() == inputs.block[row].data_ptr()
    want_ids = [[5, 6, 7, 1, 1], [8, 1, 1, 1, 1], [1] * 5, [1] * 5]
    want_mask = [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0] * 5, [0] * 5]
    assert inputs["input_ids"].tolist() == want_ids
    assert inputs["attention_mask"].tolist() == want_mask
    assert not inputs["token_type_ids"].any()
    without_types = host_inputs(ids, 2, 3, 0, ("input_ids", "attention_mask"))
    assert tuple(without_types) == ("input_ids", "attention_mask")
    static, packed = static_inputs(dict(inputs))
    assert packed is not None
    assert torch.equal(packed, inputs.block)
    assert tuple(static) == keys
    assert static["input_ids"].data_ptr() == packed[0].data_ptr()


def test_weights_are_copied_in_one_group_a_dtype(encoder: SentenceEncoder) -> None:
    # MiniLM's weights and its int64 buffers (position and token type ids):
    # two groups, each one fused copy (a list of mixed dtypes is a copy a tensor on CUDA).
    template = copy.deepcopy(encoder.model)
    other = other_weights(encoder)
    into, source = by_dtype(weight_tensors(template)), by_dtype(weight_tensors(other))
    assert len(into) == len(source) >= 2
    assert [{t.dtype for t in group} for group in into] == [{g[0].dtype} for g in into]
    assert sum(map(len, into)) == len(weight_tensors(template))
    assert not torch.equal(into[0][0], source[0][0])
    copy_weights(into, source)
    for mine, theirs in zip(weight_tensors(template), weight_tensors(other), strict=True):
        assert torch.equal(mine, theirs)


def test_an_architectures_graphs_are_one_shared_component(encoder: SentenceEncoder) -> None:
    shared = SharedComponents()
    other = other_weights(encoder)
    first = GraphsHold.acquire(
        shared, encoder.model, encoder.tokenizer, OUTPUT, make_runner=eager_runner
    )
    second = GraphsHold.acquire(shared, other, encoder.tokenizer, OUTPUT, make_runner=eager_runner)
    assert second.key == first.key
    assert second.graphs is first.graphs
    assert shared.keys() == [first.key]
    assert first.num_bytes >= torch_module_bytes(encoder.model)  # the template's weights
    first.park()
    assert not first.graphs.in_host_tier  # the other model still uses them on the device
    second.park()
    assert first.graphs.in_host_tier  # the last has left: the template waits in the host tier
    assert first.graphs.graphs.num_runners == 0
    second.unpark()
    batch = encoder.tokenize(["back again"], 256)
    assert torch.allclose(second.graphs(other, batch), forward(other, batch), atol=1e-4)
    second.release(parked=False)
    first.release(parked=True)
    assert shared.keys() == []


def test_reduced_precision_is_kept_only_within_the_cosine_bar() -> None:
    spec = read_spec(MODEL)
    encoder = SentenceEncoder.from_folder(spec.resolve_source(), "cpu")
    batch = encoder.tokenize(list(CHECK_TEXTS), 256)
    cosine = reduce_precision(encoder.model, batch, "bfloat16", "last_hidden_state", 0.99)
    assert 0.99 <= cosine < 1.0
    assert next(encoder.model.parameters()).dtype == torch.bfloat16
    encoder.model.float()
    refused = reduce_precision(encoder.model, batch, "bfloat16", "last_hidden_state", 1.01)
    assert refused < 1.01
    assert next(encoder.model.parameters()).dtype == torch.float32  # back, as it was
    encoder.close()


def test_a_card_asking_for_bfloat16_loads_and_answers_close_to_float32(tmp_path: Path) -> None:
    spec = read_spec(MODEL)
    bf16 = replace(spec, options={**spec.options, "dtype": "bfloat16"})
    loader = get_loader(spec.adapter)
    ctx = standalone_context(threads=1)
    full = loader.load(spec, ctx)
    half = loader.load(bf16, ctx)
    assert ctx.shared.keys() == [
        encoder_key(spec.resolve_source(), "cpu"),
        encoder_key(spec.resolve_source(), "cpu", bf16),
    ]
    items = [TextInput(t) for t in CHECK_TEXTS]
    for a, b in zip(full.run(items), half.run(items), strict=True):
        assert float(np.dot(a, b)) > 0.99  # both unit vectors
    assert half.memory().total_bytes < 0.6 * full.memory().total_bytes
    full.unload()
    half.unload()


def test_device_options_are_checked() -> None:
    spec = read_spec(MODEL)
    assert encoder_variant(spec) == ""
    eager = replace(spec, options={**spec.options, "cuda_graphs": False})
    assert encoder_variant(eager) == ":auto:eager"
    with pytest.raises(ModelUnavailableError, match="dtype must be one of"):
        device_options(replace(spec, options={**spec.options, "dtype": "int4"}))
    with pytest.raises(ModelUnavailableError, match="cuda_graphs must be true or false"):
        device_options(replace(spec, options={**spec.options, "cuda_graphs": "yes"}))


def ids_of(encoder: SentenceEncoder, texts: list[str]) -> list[np.ndarray]:
    """Texts tokenised as a gateway tokenises them ahead (``runtimes.tokens``)."""
    rows = encoder.tokenizer(texts, truncation=True, max_length=256)["input_ids"]
    return [np.array(row, dtype=np.int32) for row in rows]


@pytest.mark.parametrize(
    "texts",
    [
        ["one"],  # (1, 16)
        ["a short one", "and a somewhat longer sentence than the first"],  # (2, 16)
        [f"sentence number {i} " * (i + 1) for i in range(5)],  # (8, 32): rows padded too
        ["word " * 40, "x"],  # (2, 64)
        [f"text {i}" for i in range(20)],  # (32, 16)
    ],
)
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_texts_tokenised_ahead_leave_the_graph_as_the_encoders_vectors(
    encoder: SentenceEncoder, texts: list[str], pooling: Any
) -> None:
    ids = ids_of(encoder, texts)
    want = encoder.encode(texts, pooling=pooling)
    raw = encoder.encode(texts, pooling=pooling, normalize=False)
    shared = SharedComponents()
    hold = GraphsHold.acquire(
        shared, encoder.model, encoder.tokenizer, OUTPUT, capture=False, make_runner=replay_like
    )
    with graphs_of(encoder, hold):
        graphs = hold.graphs.graphs
        first = encoder.encode_ids(ids, pooling=pooling)  # eager, padded to the bucket
        assert graphs.num_runners == 0
        second = encoder.encode_ids(ids, pooling=pooling)  # built, replayed
        assert graphs.num_runners == 1
        unscaled = encoder.encode_ids(ids, pooling=pooling, normalize=False)
    assert np.allclose(first, want, atol=1e-5)
    assert np.allclose(second, want, atol=1e-5)
    assert np.allclose(unscaled, raw, atol=1e-4)
    assert second.dtype == np.float32
    assert second.shape == (len(texts), encoder.dim)


def test_graph_vectors_are_the_callers_not_the_next_replays(encoder: SentenceEncoder) -> None:
    texts = [["first text"], ["an altogether different second"]]
    shared = SharedGraphs.of(encoder.model, encoder.tokenizer, OUTPUT, replay_like)
    shared.prepare("cpu")
    try:
        got: list[np.ndarray] = []
        for each in texts:
            vectors = shared.vectors(encoder.model, ids_of(encoder, each), "mean")
            assert vectors is not None
            got.append(vectors.numpy())  # on the CPU the same memory as the tensor
        for each, vectors in zip(texts, got, strict=True):
            want = encoder.encode(each, normalize=False)
            assert np.allclose(vectors, want, atol=1e-5)
    finally:
        shared.close()


def test_a_threads_own_input_block_gives_the_same_vectors_batch_after_batch(
    encoder: SentenceEncoder,
) -> None:
    # A batch run alone pads its ids into its thread's own block for the
    # bucket, made once (page-locked on CUDA), where a new block was three
    # torch calls: the same vectors, a longer text's padding never left in a
    # shorter one's, one block a thread and bucket.
    texts = [["a much longer first sentence, with more words in it"], ["short"], ["mid one"]]
    shared = SharedGraphs.of(encoder.model, encoder.tokenizer, OUTPUT, replay_like)
    shared.prepare("cpu")
    graphs = shared.graphs
    try:
        for each in [*texts, *texts]:
            ids = ids_of(encoder, each)
            own = shared.vectors(encoder.model, ids, "mean", reuse=True)
            fresh = shared.vectors(encoder.model, ids, "mean")
            assert own is not None
            assert fresh is not None
            assert torch.equal(own, fresh)
            assert np.allclose(own.numpy(), encoder.encode(each, normalize=False), atol=1e-5)
        ids = ids_of(encoder, ["short"])
        first, again = graphs.padded_ids(ids, reuse=True), graphs.padded_ids(ids, reuse=True)
        assert first is not None
        assert again is not None
        assert first.inputs is again.inputs
        assert graphs.padded_ids(ids) is not None
        assert graphs.padded_ids(ids).inputs is not first.inputs  # type: ignore[union-attr]
        other: list[Any] = []
        thread = threading.Thread(target=lambda: other.append(graphs.padded_ids(ids, reuse=True)))
        thread.start()
        thread.join()
        assert other[0].inputs is not first.inputs
    finally:
        shared.close()


def test_a_failed_replay_leaves_its_threads_block_unused(encoder: SentenceEncoder) -> None:
    # A copy in from the block may still be on its way when the replay fails:
    # the thread's next batch pads into a new block.
    def failing(step: Any, example: Any) -> Any:
        def run(inputs: Any) -> Any:
            raise RuntimeError("replay failed")

        return run

    graphs = GraphForward(
        encoder.model, OUTPUT, encoder.tokenizer.pad_token_id, failing,
        input_keys=encoder.tokenizer.model_input_names,
    )  # fmt: skip
    graphs.prepare("cpu")
    ids = ids_of(encoder, ["hello"])
    padded = graphs.padded_ids(ids, reuse=True)
    assert padded is not None
    with pytest.raises(RuntimeError, match="replay failed"):
        graphs.replay_vectors(padded, "mean")
    after = graphs.padded_ids(ids, reuse=True)
    assert after is not None
    assert after.inputs is not padded.inputs


def test_one_architectures_graphs_pool_each_models_vectors(encoder: SentenceEncoder) -> None:
    other = other_weights(encoder)
    texts = ["a sentence", "and another, longer one"]
    ids = ids_of(encoder, texts)
    batch = encoder.tokenize(texts, 256)
    mask = batch["attention_mask"].unsqueeze(-1).float()
    shared = SharedGraphs.of(encoder.model, encoder.tokenizer, OUTPUT, replay_like)
    shared.prepare("cpu")
    try:
        for model in (encoder.model, other, encoder.model):
            hidden = forward(model, batch)
            want = (hidden * mask).sum(dim=1) / mask.sum(dim=1)
            got, first = shared.vectors(model, ids, "mean"), shared.vectors(model, ids, "cls")
            assert got is not None
            assert first is not None
            assert torch.allclose(got, want, atol=1e-5)
            assert torch.allclose(first, hidden[:, 0], atol=1e-5)
        assert shared.template.num_copies == 3  # the first model's, the other's, the first's again
        many = ids_of(encoder, ["x"] * 33)  # over the buckets: the caller's own path
        assert shared.vectors(other, many, "mean") is None
        assert shared.template.num_copies == 3
    finally:
        shared.close()


def test_graphs_of_logits_give_no_vectors(encoder: SentenceEncoder) -> None:
    graphs = GraphForward(
        encoder.model, "logits", encoder.tokenizer.pad_token_id, replay_like, input_keys=()
    )
    assert not graphs.makes_vectors
    assert graphs.padded_ids(ids_of(encoder, ["hello"])) is None
