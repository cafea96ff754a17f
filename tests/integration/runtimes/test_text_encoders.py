"""Text encoder adapters: the default MiniLM descriptors on their real packaged
weights, and generic Hugging Face / ONNX folders built in-process from tiny
random-weight BERTs. Everything loads from local files; nothing reaches a hub.
"""

from __future__ import annotations

import os
import shutil

# Before transformers is first imported: the loaders pass local_files_only,
# and these make any stray hub call fail instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tessera.errors import InvalidInputError, ModelUnavailableError
from tessera.repository import default_repository_path, read_spec
from tessera.runtimes.base import LoadContext, LoadedModel, SharedComponents, standalone_context
from tessera.runtimes.registry import get_loader
from tessera.tasks.types import ClassifyOutput, RerankInput, TextInput

pytestmark = pytest.mark.slow

MODELS = default_repository_path()
RELATED = ("A man is eating food.", "A man is eating a piece of bread.")
UNRELATED = "The new movie is awesome."


class CountingShared(SharedComponents):
    """Shared components that count how often each key's factory ran."""

    def __init__(self) -> None:
        super().__init__()
        self.builds: Counter[str] = Counter()

    def acquire(self, key: str, factory: Callable[[], Any], on_free: Any = None) -> Any:
        def counted() -> Any:
            self.builds[key] += 1
            return factory()

        return super().acquire(key, counted, on_free)


def make_context() -> LoadContext:
    return replace(standalone_context(threads=1), shared=CountingShared())


def load(folder: Path, ctx: LoadContext) -> LoadedModel:
    spec = read_spec(folder)
    return get_loader(spec.adapter).load(spec, ctx)


def texts(*values: str) -> list[TextInput]:
    return [TextInput(v) for v in values]


# --- the default descriptors on real weights ---------------------------------------


@pytest.fixture(scope="module")
def ctx() -> Iterator[LoadContext]:
    ctx = make_context()
    yield ctx
    assert ctx.shared.keys() == [], "a shared component outlived every model using it"


@pytest.fixture(scope="module")
def minilm(ctx: LoadContext) -> Iterator[LoadedModel]:
    model = load(MODELS / "all-minilm-l6-v2", ctx)
    yield model
    model.unload()


@pytest.fixture(scope="module")
def minilm_int8(ctx: LoadContext) -> Iterator[LoadedModel]:
    model = load(MODELS / "all-minilm-l6-v2-int8", ctx)
    yield model
    model.unload()


@pytest.fixture(scope="module")
def rerank(ctx: LoadContext) -> Iterator[LoadedModel]:
    model = load(MODELS / "minilm-rerank", ctx)
    yield model
    model.unload()


@pytest.fixture(scope="module")
def intent(ctx: LoadContext) -> Iterator[LoadedModel]:
    model = load(MODELS / "intent-minilm", ctx)
    yield model
    model.unload()


def test_minilm_embeds_unit_vectors_that_rank_related_sentences_closer(
    minilm: LoadedModel,
) -> None:
    first, second, other = minilm.run(texts(*RELATED, UNRELATED))

    for vector in (first, second, other):
        assert vector.shape == (384,)
        assert vector.dtype == np.float32
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
    assert float(first @ second) > 0.5
    assert float(first @ second) > float(first @ other) + 0.4


def test_minilm_int8_onnx_agrees_with_fp32(minilm: LoadedModel, minilm_int8: LoadedModel) -> None:
    items = texts(*RELATED, UNRELATED, "Where is the nearest train station?")

    fp32 = np.stack(minilm.run(items))
    int8 = np.stack(minilm_int8.run(items))

    assert int8.shape == fp32.shape
    assert np.all((fp32 * int8).sum(axis=1) > 0.99)
    report = minilm_int8.memory()
    assert report.own_bytes >= 22_000_000  # at least the file
    assert report.shared_bytes == {}


def test_minilm_int8_keeps_its_int8_weights_with_the_same_answers(
    ctx: LoadContext, minilm_int8: LoadedModel
) -> None:
    # Served rewritten (runtimes.onnx_quant) against the graph as it is, which
    # onnxruntime folds to fp32: the same weights, so the same answers.
    spec = read_spec(MODELS / "all-minilm-l6-v2-int8")
    as_is = replace(spec, options={**spec.options, "run_quantised": False})
    folded = get_loader(spec.adapter).load(as_is, ctx)
    try:
        items = texts(
            *RELATED, UNRELATED, *[f"Sentence number {i} about trains." for i in range(8)]
        )
        want = np.stack(folded.run(items))
        got = np.stack(minilm_int8.run(items))
        assert np.all((want * got).sum(axis=1) > 0.9999)
        quantised, fp32 = minilm_int8.memory(), folded.memory()
    finally:
        folded.unload()
    assert "int8 rewrite" in (quantised.method or "")
    assert "int8" not in (fp32.method or "")
    assert quantised.own_bytes < 50_000_000 < 80_000_000 < fp32.own_bytes
    assert get_loader(spec.adapter).estimate_bytes(spec) < 50_000_000
    assert get_loader(spec.adapter).estimate_bytes(as_is) > 80_000_000

    bad = replace(spec, options={**spec.options, "run_quantised": "yes"})
    with pytest.raises(ModelUnavailableError, match="run_quantised"):
        get_loader(spec.adapter).load(bad, ctx)


def test_bi_encoder_rerank_puts_the_relevant_document_first(rerank: LoadedModel) -> None:
    query = "How do I bake bread at home?"
    documents = [
        "The stock market fell sharply on Monday.",
        "Mix flour, water, yeast and salt, let the dough rise, then bake it in a hot oven.",
        "Cats sleep for most of the day.",
    ]

    scores = rerank.run([RerankInput(query, d) for d in documents])

    assert all(isinstance(s, float) for s in scores)
    assert int(np.argmax(scores)) == 1
    assert scores[1] > 0.4


def test_intent_has_157_labels_and_finds_obvious_intents(intent: LoadedModel) -> None:
    labels = intent.labels  # type: ignore[attr-defined]
    assert len(labels) == len(set(labels)) == 157
    assert {"connect_to_human", "follow_up", "translate", "oos"} <= set(labels)

    # Sentences from the package's own docs and CLINC150's style.
    human, translate = intent.run(
        texts("i want a real person to help me from here", "how would you say fly in italian")
    )

    assert isinstance(human, ClassifyOutput)
    assert len(human.labels) == 5
    assert human.labels[0].label == "connect_to_human"
    assert translate.labels[0].label == "translate"
    scores = [s.score for s in human.labels]
    assert scores == sorted(scores, reverse=True)
    assert 0.5 < scores[0] <= 1.0


def test_encoder_is_acquired_once_and_freed_with_its_last_user() -> None:
    ctx = make_context()
    names = ["all-minilm-l6-v2", "minilm-rerank", "intent-minilm"]
    models = [load(MODELS / name, ctx) for name in names]

    (key,) = ctx.shared.keys()
    assert key.startswith("hf-encoder:")
    assert key.endswith(":cpu")
    assert ctx.shared.builds == {key: 1}  # type: ignore[attr-defined]
    for model in models:
        report = model.memory()
        assert list(report.shared_bytes) == [key]
        assert report.shared_bytes[key] > 80_000_000  # 22.7M fp32 parameters
    assert models[0].memory().own_bytes == models[1].memory().own_bytes == 0
    assert 0 < models[2].memory().own_bytes < 2_000_000  # the sklearn head
    encoder = models[0].encoder  # type: ignore[attr-defined]
    assert models[2].encoder is encoder  # type: ignore[attr-defined]

    for model in models[:-1]:
        model.unload()
        assert ctx.shared.keys() == [key]
    models[-1].unload()
    assert ctx.shared.keys() == []
    assert encoder.model is None  # freed, not merely forgotten
    with pytest.raises(ModelUnavailableError):
        models[0].run(texts("after unload"))


def test_models_sharing_an_encoder_run_concurrently(
    minilm: LoadedModel, rerank: LoadedModel
) -> None:
    # Two models on one encoder run batches on two worker threads at once.
    items = texts(*RELATED, UNRELATED)
    pairs = [RerankInput(RELATED[0], d) for d in (RELATED[1], UNRELATED)]
    expected_vectors, expected_scores = minilm.run(items), rerank.run(pairs)

    with ThreadPoolExecutor(max_workers=4) as pool:
        vectors = [pool.submit(minilm.run, items) for _ in range(3)]
        scores = [pool.submit(rerank.run, pairs) for _ in range(3)]
        for future in vectors:
            assert np.allclose(np.stack(future.result()), np.stack(expected_vectors), atol=1e-5)
        for future in scores:
            assert future.result() == pytest.approx(expected_scores, abs=1e-5)


def test_text_models_refuse_items_of_another_task(minilm: LoadedModel, rerank: LoadedModel) -> None:
    with pytest.raises(InvalidInputError):
        minilm.run([RerankInput("q", "d")])
    with pytest.raises(InvalidInputError):
        rerank.run(texts("not a pair"))
    assert minilm.run([]) == []


# --- generic folders: tiny random-weight BERTs ----------------------------------------

WORDS = "the a cat dog sat on mat ran in park sun is hot cold what where who"
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS.split(" ")]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
SENTENCES = ["the cat sat on the mat", "a dog ran", "where is the sun", "hot"]


def tiny_folder(folder: Path, model_class: str, **config: Any) -> Path:
    """Save a tiny BERT (hidden 32, 2 layers) and a WordPiece tokenizer into ``folder``."""
    import torch
    import transformers
    from transformers import BertConfig, BertTokenizerFast

    folder.mkdir(parents=True)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    torch.manual_seed(0)
    bert_config = BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        **config,
    )
    getattr(transformers, model_class)(bert_config).eval().save_pretrained(folder)
    return folder


def tiny_spec(folder: Path, task: str, adapter: str, source: Path, **options: Any) -> Path:
    """A model folder whose model.yaml points at ``source``."""
    folder.mkdir(parents=True)
    raw = {
        "name": folder.name,
        "task": task,
        "runtime": "onnx" if adapter.startswith("onnx") else "torch",
        "adapter": adapter,
        "source": {"path": str(source)},
        "options": options,
    }
    (folder / "model.yaml").write_text(yaml.safe_dump(raw))
    return folder


def export_onnx(source: Path, target: Path, output: str) -> Path:
    """Export a tiny HF model's ``output`` (last_hidden_state or logits) to ``target``."""
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    auto = AutoModel if output == "last_hidden_state" else AutoModelForSequenceClassification
    model = auto.from_pretrained(str(source), local_files_only=True)

    class Graph(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            )
            return getattr(out, output)

    # The exporter restores the wrapper's training mode on every submodule:
    # a wrapper left in training mode would put dropout back into the model.
    graph = Graph().eval()
    ids = torch.tensor([[2, 5, 6, 3, 0], [2, 7, 8, 9, 3]])
    # Trace with padding so that the attention-mask path is in the graph.
    mask = (ids != 0).long()
    names = ["input_ids", "attention_mask", "token_type_ids"]
    target.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # the legacy exporter's deprecation and tracer notes
        warnings.simplefilter("ignore")
        torch.onnx.export(
            graph,
            (ids, mask, torch.zeros_like(ids)),
            str(target),
            input_names=names,
            output_names=[output],
            dynamic_axes={name: {0: "batch", 1: "sequence"} for name in names}
            | {output: {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    return target


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_folder(tmp_path_factory.mktemp("hf") / "encoder", "BertModel")


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_folder(
        tmp_path_factory.mktemp("hf") / "classifier",
        "BertForSequenceClassification",
        num_labels=3,
        id2label=LABELS,
        label2id={v: k for k, v in LABELS.items()},
    )


@pytest.fixture(scope="module")
def tiny_cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_folder(
        tmp_path_factory.mktemp("hf") / "cross-encoder",
        "BertForSequenceClassification",
        num_labels=1,
    )


def reference_logits(folder: Path, first: list[str], second: list[str] | None = None) -> Any:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), local_files_only=True)
    with torch.inference_mode():
        batch = tokenizer(first, second, padding=True, return_tensors="pt")
        return model.eval()(**batch).logits.numpy()


def test_hf_encoder_pools_any_folder(tiny_encoder: Path, tmp_path: Path) -> None:
    ctx = standalone_context()
    mean = load(tiny_spec(tmp_path / "mean", "embedding", "hf-encoder", tiny_encoder), ctx)
    cls_spec = tiny_spec(
        tmp_path / "cls", "embedding", "hf-encoder", tiny_encoder, pooling="cls", normalize=False
    )
    cls = load(cls_spec, ctx)

    batch = np.stack(mean.run(texts(*SENTENCES)))
    alone = mean.run(texts(SENTENCES[1]))[0]
    raw = np.stack(cls.run(texts(*SENTENCES)))

    assert batch.shape == (4, 32)
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    # Padding does not leak into the mean: a short text pools the same alone or padded.
    assert np.allclose(batch[1], alone, atol=1e-5)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    assert list(mean.memory().shared_bytes) == list(cls.memory().shared_bytes)
    assert len(ctx.shared.keys()) == 1  # two models, one encoder
    mean.unload()
    cls.unload()
    assert ctx.shared.keys() == []


def test_hf_sequence_classifier_labels_from_config(tiny_classifier: Path, tmp_path: Path) -> None:
    spec_dir = tiny_spec(
        tmp_path / "clf", "classify", "hf-sequence-classifier", tiny_classifier, top_k=3
    )
    model = load(spec_dir, standalone_context())

    outputs = model.run(texts(*SENTENCES))

    expected = np.exp(reference_logits(tiny_classifier, SENTENCES))
    expected /= expected.sum(axis=1, keepdims=True)
    for output, probs in zip(outputs, expected, strict=True):
        assert {s.label for s in output.labels} == set(LABELS.values())
        assert output.labels[0].label == LABELS[int(np.argmax(probs))]
        by_label = {s.label: s.score for s in output.labels}
        assert [by_label[LABELS[i]] for i in range(3)] == pytest.approx(probs.tolist(), abs=1e-5)
    assert model.memory().own_bytes > 0
    assert model.memory().method == "torch tensors"
    model.unload()


def test_hf_cross_encoder_scores_pairs_with_sigmoid(
    tiny_cross_encoder: Path, tmp_path: Path
) -> None:
    spec_dir = tiny_spec(tmp_path / "ce", "rerank", "hf-sequence-classifier", tiny_cross_encoder)
    model = load(spec_dir, standalone_context())
    queries = ["what is hot"] * 3
    documents = ["the sun is hot", "a cat sat on the mat", "cold"]

    scores = model.run([RerankInput(q, d) for q, d in zip(queries, documents, strict=True)])

    logits = reference_logits(tiny_cross_encoder, queries, documents)[:, 0]
    assert scores == pytest.approx((1 / (1 + np.exp(-logits))).tolist(), abs=1e-5)
    model.unload()


def test_onnx_encoder_matches_the_torch_encoder(tiny_encoder: Path, tmp_path: Path) -> None:
    onnx_path = export_onnx(tiny_encoder, tmp_path / "onnx" / "model.onnx", "last_hidden_state")
    ctx = standalone_context()
    torch_model = load(tiny_spec(tmp_path / "torch", "embedding", "hf-encoder", tiny_encoder), ctx)
    onnx_spec = tiny_spec(
        tmp_path / "ort", "embedding", "onnx-encoder", onnx_path, tokenizer=str(tiny_encoder)
    )
    onnx_model = load(onnx_spec, ctx)

    expected = np.stack(torch_model.run(texts(*SENTENCES)))
    got = np.stack(onnx_model.run(texts(*SENTENCES)))

    assert np.allclose(got, expected, atol=1e-5)
    report = onnx_model.memory()
    assert report.own_bytes >= onnx_path.stat().st_size
    assert report.shared_bytes == {}
    assert report.method == "rss delta (load + warm-up)"  # an fp32 graph: nothing rewritten
    onnx_model.unload()
    torch_model.unload()


def test_an_int8_rewrite_onnxruntime_rejects_loads_the_graph_as_it_is(
    tiny_encoder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tessera.runtimes.onnx as onnx_runtime
    from tessera.runtimes.onnx_quant import ServedGraph

    onnx_path = export_onnx(tiny_encoder, tmp_path / "onnx" / "model.onnx", "last_hidden_state")
    spec_dir = tiny_spec(
        tmp_path / "ort", "embedding", "onnx-encoder", onnx_path, tokenizer=str(tiny_encoder)
    )
    expected = np.stack(load(spec_dir, standalone_context()).run(texts(*SENTENCES)))
    monkeypatch.setattr(
        onnx_runtime, "served_graph", lambda *_: ServedGraph(b"not a graph", "int8 rewrite")
    )

    model = load(spec_dir, standalone_context())

    assert np.array_equal(np.stack(model.run(texts(*SENTENCES))), expected)
    assert model.memory().method == "rss delta (load + warm-up); original graph (rewrite rejected)"
    model.unload()


def test_onnx_sequence_classifier_classifies_and_reranks(
    tiny_classifier: Path, tiny_cross_encoder: Path, tmp_path: Path
) -> None:
    ctx = standalone_context()
    classifier_onnx = export_onnx(tiny_classifier, tmp_path / "clf" / "model.onnx", "logits")
    (tmp_path / "clf" / "config.json").write_text((tiny_classifier / "config.json").read_text())
    cross_onnx = export_onnx(tiny_cross_encoder, tmp_path / "ce" / "model.onnx", "logits")
    adapter = "onnx-sequence-classifier"
    # A folder source (model.onnx inside, labels from the config.json beside it)...
    classifier = load(
        tiny_spec(
            tmp_path / "spec-clf",
            "classify",
            adapter,
            classifier_onnx.parent,
            tokenizer=str(tiny_classifier),
            top_k=2,
        ),
        ctx,
    )
    # ...a file source with labels given as an option, and a cross-encoder without labels.
    relabelled = load(
        tiny_spec(
            tmp_path / "spec-labels",
            "classify",
            adapter,
            classifier_onnx,
            tokenizer=str(tiny_classifier),
            labels=["bad", "meh", "good"],
        ),
        ctx,
    )
    cross = load(
        tiny_spec(
            tmp_path / "spec-ce", "rerank", adapter, cross_onnx, tokenizer=str(tiny_cross_encoder)
        ),
        ctx,
    )

    logits = reference_logits(tiny_classifier, SENTENCES)
    outputs = classifier.run(texts(*SENTENCES))
    renamed = relabelled.run(texts(*SENTENCES))
    pairs = [RerankInput("what is hot", d) for d in SENTENCES]
    scores = cross.run(pairs)

    for output, renamed_output, row in zip(outputs, renamed, logits, strict=True):
        assert len(output.labels) == 2
        assert output.labels[0].label == LABELS[int(np.argmax(row))]
        assert renamed_output.labels[0].label == ["bad", "meh", "good"][int(np.argmax(row))]
    cross_logits = reference_logits(tiny_cross_encoder, ["what is hot"] * 4, SENTENCES)[:, 0]
    assert scores == pytest.approx((1 / (1 + np.exp(-cross_logits))).tolist(), abs=1e-5)
    for model in (classifier, relabelled, cross):
        model.unload()


def test_a_copied_encoder_folder_is_loaded_once(tiny_encoder: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(tiny_encoder, tmp_path / "copy-of-encoder")
    ctx = standalone_context()
    first = load(tiny_spec(tmp_path / "first", "embedding", "hf-encoder", tiny_encoder), ctx)
    second = load(tiny_spec(tmp_path / "second", "embedding", "hf-encoder", copy), ctx)
    assert len(ctx.shared.keys()) == 1  # same bytes under two paths: one encoder
    assert first.memory().shared_bytes == second.memory().shared_bytes
    assert np.allclose(first.run(texts("a copy"))[0], second.run(texts("a copy"))[0])
    first.unload()
    second.unload()
    assert ctx.shared.keys() == []


def test_fine_tunes_of_one_base_share_one_tokenizer(tiny_encoder: Path, tmp_path: Path) -> None:
    """Two folders with other weights but the same tokenizer files: two encoders,
    one tokenizer (built once), whose calls from many threads at once each
    take its one lock; a folder with another vocabulary gets its own."""
    import torch
    from transformers import AutoModel

    tuned = shutil.copytree(tiny_encoder, tmp_path / "fine-tuned")
    model = AutoModel.from_pretrained(str(tiny_encoder), local_files_only=True)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01)
    model.save_pretrained(tuned)
    other = shutil.copytree(tiny_encoder, tmp_path / "other-vocabulary")
    (other / "tokenizer.json").unlink()
    (other / "vocab.txt").write_text("\n".join([*VOCAB, "extra"]) + "\n")
    ctx = standalone_context()
    spec_folders = [
        tiny_spec(tmp_path / name, "embedding", "hf-encoder", source)
        for name, source in (("base", tiny_encoder), ("tuned", tuned), ("other", other))
    ]
    base, tune, apart = (load(folder, ctx) for folder in spec_folders)
    assert len(ctx.shared.keys()) == 3  # three encoders: their weights differ
    encoders = [m.encoder for m in (base, tune, apart)]  # type: ignore[attr-defined]
    assert encoders[0].tokenizer is encoders[1].tokenizer
    assert encoders[2].tokenizer is not encoders[0].tokenizer
    assert not np.allclose(base.run(texts("a copy"))[0], tune.run(texts("a copy"))[0])
    with ThreadPoolExecutor(8) as pool:
        runs = [pool.submit(m.run, texts(*SENTENCES)) for m in (base, tune) * 16]
        assert all(len(run.result()) == len(SENTENCES) for run in runs)
    for model_ in (base, tune, apart):
        model_.unload()
