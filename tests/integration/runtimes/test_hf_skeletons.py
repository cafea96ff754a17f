"""Hugging Face models built from the skeleton of their config
(``runtimes/hf_skeletons.py``): what ``from_pretrained`` makes, bit for bit,
with the weights mapped from the folder's file, and ``from_pretrained``
wherever the folder does not hold exactly the skeleton's tensors."""

from __future__ import annotations

import os

# Before transformers is first imported: local folders only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tessera.runtimes import hf_skeletons
from tessera.runtimes.filemap import mapped_spans
from tessera.runtimes.hf_skeletons import load_pretrained

pytestmark = pytest.mark.slow


def tiny_bert(folder: Path, seed: int, model_class: str = "BertModel", **config: Any) -> Path:
    """A tiny BERT (hidden 16, 2 layers) of weights drawn from ``seed``, saved as safetensors."""
    import torch
    import transformers
    from transformers import BertConfig

    torch.manual_seed(seed)
    bert = BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        **config,
    )
    getattr(transformers, model_class)(bert).eval().save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def no_skeletons() -> Iterator[None]:
    hf_skeletons._skeletons.clear()
    yield
    hf_skeletons._skeletons.clear()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The folders loaded through ``from_pretrained``."""
    seen: list[Path] = []
    real = hf_skeletons._from_pretrained

    def counted(auto_class: Any, folder: Path) -> Any:
        seen.append(folder)
        return real(auto_class, folder)

    monkeypatch.setattr(hf_skeletons, "_from_pretrained", counted)
    return seen


def same_tensors(a: Any, b: Any) -> bool:
    import torch

    left, right = a.state_dict(), b.state_dict()
    return bool(left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left))


@pytest.mark.parametrize("auto", ["AutoModel", "AutoModelForSequenceClassification"])
def test_a_second_folder_of_a_config_is_built_from_its_skeleton(
    tmp_path: Path, calls: list[Path], auto: str
) -> None:
    import transformers

    auto_class = getattr(transformers, auto)
    model_class = "BertModel" if auto == "AutoModel" else "BertForSequenceClassification"
    first, second = (tiny_bert(tmp_path / f"m{i}", seed=i, model_class=model_class) for i in (1, 2))
    load_pretrained(auto_class, first)
    built = load_pretrained(auto_class, second)
    assert calls == [first]  # the second: no from_pretrained
    reference = auto_class.from_pretrained(str(second), local_files_only=True).eval()
    assert same_tensors(built, reference)
    assert not built.training
    assert built.name_or_path == str(second)
    storages = [t.untyped_storage() for t in built.parameters()]
    assert all(span is not None for span in mapped_spans(storages))  # mapped from the file


def test_a_folder_whose_tensors_differ_loads_through_from_pretrained(
    tmp_path: Path, calls: list[Path]
) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel

    first, second = tiny_bert(tmp_path / "a", seed=1), tiny_bert(tmp_path / "b", seed=2)
    weights = second / hf_skeletons.WEIGHTS
    state = load_file(str(weights))
    state.pop(sorted(state)[0])  # a tensor missing: the checkpoint is not the config's whole
    save_file(state, str(weights), metadata={"format": "pt"})
    load_pretrained(AutoModel, first)
    load_pretrained(AutoModel, second)
    assert calls == [first, second]


def test_a_config_whose_build_differs_keeps_no_skeleton(
    tmp_path: Path, calls: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModel

    real = hf_skeletons._from_skeleton

    def scaled(skeleton: Any, weights: Path) -> Any:
        model = real(skeleton, weights)
        if model is not None:
            next(model.parameters()).data.mul_(2.0)  # a loading that converts weights
        return model

    monkeypatch.setattr(hf_skeletons, "_from_skeleton", scaled)
    folders = [tiny_bert(tmp_path / f"m{i}", seed=i) for i in range(3)]
    for folder in folders:
        load_pretrained(AutoModel, folder)
    assert calls == folders  # checked once, then from_pretrained every time
