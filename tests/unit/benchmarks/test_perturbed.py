"""Perturbed model sets: distinct, reproducible, reused while intact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file, save_file

from harness.perturbed import RECIPE, WEIGHTS, ModelSet, ensure_models, perturb, sha256_of
from tessera.repository import read_spec

CARD = {"name": "base", "task": "embedding", "runtime": "torch", "adapter": "hf-encoder",
        "source": {"package": "somewhere"}, "preload": True, "latency_target_ms": 200}  # fmt: skip


def make_source(folder: Path) -> Path:
    """A tiny model folder: two float tensors, an integer one, a config and a vocab."""
    folder.mkdir()
    rng = np.random.default_rng(7)
    tensors = {
        "encoder.weight": rng.standard_normal((8, 4), dtype=np.float32),
        "encoder.bias": np.zeros(4, dtype=np.float32),
        "position_ids": np.arange(6, dtype=np.int64).reshape(1, 6),
    }
    save_file(tensors, str(folder / WEIGHTS))
    (folder / "config.json").write_text("{}")
    (folder / "vocab.txt").write_text("[PAD]\nhello\n")
    (folder / "README.md").write_text("the original model's card")
    return folder


def make(
    tmp_path: Path,
    count: int = 3,
    root: str = "root",
    noise: float = 1e-3,
    target_ms: float = 500,
    made: list[tuple[str, bool]] | None = None,
) -> Path:
    """``count`` models under ``tmp_path/root`` from one tiny source; ``made``
    collects (name, whether it was written)."""
    models = ModelSet("base", count, noise=noise, prefix="m", latency_target_ms=target_ms)
    source = tmp_path / "source"
    if not source.exists():
        make_source(source)
    on_model = None if made is None else lambda name, wrote: made.append((name, wrote))
    return ensure_models(models, tmp_path / root, source, CARD, on_model)


def test_every_model_is_a_distinct_loadable_folder(tmp_path: Path) -> None:
    folder = make(tmp_path)
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["m-000", "m-001", "m-002"]
    hashes = {sha256_of(folder / n / WEIGHTS) for n in names}
    assert len(hashes) == 3
    assert sha256_of(tmp_path / "source" / WEIGHTS) not in hashes
    base = load_file(str(tmp_path / "source" / WEIGHTS))
    one, two = (load_file(str(folder / n / WEIGHTS)) for n in names[:2])
    for name in ("encoder.weight", "encoder.bias"):  # every float tensor moves, by about 1e-3
        assert not np.array_equal(one[name], two[name])
        assert 0 < np.abs(one[name] - base[name]).max() < 1e-2
    np.testing.assert_array_equal(one["position_ids"], base["position_ids"])
    assert sorted(p.name for p in (folder / "m-001").iterdir()) == [
        "config.json", WEIGHTS, "model.yaml", RECIPE, "vocab.txt"
    ]  # fmt: skip
    spec = read_spec(folder / "m-001")
    assert (spec.name, spec.latency_target_ms, spec.preload) == ("m-001", 500, False)
    assert spec.resolve_source() == folder / "m-001"


def test_the_same_recipe_makes_the_same_bytes(tmp_path: Path) -> None:
    first, second = make(tmp_path, root="a"), make(tmp_path, root="b")
    for name in ("m-000", "m-002"):
        assert sha256_of(first / name / WEIGHTS) == sha256_of(second / name / WEIGHTS)
    tensors = {"w": np.ones((3, 3), dtype=np.float32)}
    assert np.array_equal(perturb(tensors, 5, 1e-3)["w"], perturb(tensors, 5, 1e-3)["w"])
    assert not np.array_equal(perturb(tensors, 5, 1e-3)["w"], perturb(tensors, 6, 1e-3)["w"])


def test_intact_folders_are_reused_and_damaged_ones_remade(tmp_path: Path) -> None:
    folder = make(tmp_path)
    made: list[tuple[str, bool]] = []
    assert make(tmp_path, made=made) == folder
    assert made == [("m-000", False), ("m-001", False), ("m-002", False)]
    good = sha256_of(folder / "m-001" / WEIGHTS)
    with (folder / "m-001" / WEIGHTS).open("r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\0\0\0")
    made.clear()
    make(tmp_path, made=made)
    assert made == [("m-000", False), ("m-001", True), ("m-002", False)]
    assert sha256_of(folder / "m-001" / WEIGHTS) == good


def test_another_noise_is_another_folder(tmp_path: Path) -> None:
    one = make(tmp_path, count=1)
    other = make(tmp_path, count=1, noise=2e-3)
    assert one != other
    assert sha256_of(one / "m-000" / WEIGHTS) != sha256_of(other / "m-000" / WEIGHTS)


def test_a_card_follows_the_latency_target(tmp_path: Path) -> None:
    folder = make(tmp_path, count=1)
    make(tmp_path, count=1, target_ms=300)
    card = yaml.safe_load((folder / "m-000" / "model.yaml").read_text())
    assert card["latency_target_ms"] == 300


@pytest.mark.parametrize(("count", "last"), [(1, "m-000"), (100, "m-099"), (1500, "m-1499")])
def test_names_are_zero_padded_in_popularity_order(count: int, last: str) -> None:
    names = ModelSet("base", count, prefix="m").names()
    assert (names[0][:3], names[-1], len(set(names))) == ("m-0", last, count)
