"""Many distinct models of one architecture, made from a packaged one.

Model ``i`` of a set is the packaged model with every floating-point tensor
moved by ``noise * N(0, 1)``, drawn from a generator seeded with ``i``: the
same bytes on every machine and every run, and no two models alike, so that
nothing (tessera's shared-weights folding, a page cache) can hold two of them
as one. Each is a real model folder that tessera and transformers both load::

    ~/.cache/tessera/bench-models/all-minilm-l6-v2-noise0.001/
      minilm-000/
        model.yaml              # the packaged card, renamed, its source this folder
        model.safetensors       # the perturbed weights
        config.json, tokenizer.json, vocab.txt, ...
        perturbed.json          # the recipe and the weights' SHA-256

A folder is written once (into a temporary name, renamed when complete) and
reused while its ``perturbed.json`` matches the recipe and its weights still
hash to what it records.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from safetensors.numpy import load_file, save_file

from tessera.repository import default_repository_path, read_spec

WEIGHTS = "model.safetensors"
RECIPE = "perturbed.json"
# What transformers needs beside the weights: the config and the tokenizer's files.
_KEPT = ("config.json", "tokenizer", "special_tokens", "vocab", "merges", "added_tokens")
_HASH_CHUNK = 8 << 20


def bench_models_dir() -> Path:
    """``$TESSERA_BENCH_MODELS`` or ``~/.cache/tessera/bench-models``."""
    raw = os.environ.get("TESSERA_BENCH_MODELS") or "~/.cache/tessera/bench-models"
    return Path(raw).expanduser()


@dataclass(frozen=True)
class ModelSet:
    """``count`` perturbed copies of the packaged model ``base``, named
    ``PREFIX-000`` and on, each with ``latency_target_ms`` on its card."""

    base: str
    count: int
    noise: float = 1e-3
    prefix: str = "model"
    latency_target_ms: float | None = None

    def names(self) -> list[str]:
        width = max(3, len(str(self.count - 1)))
        return [f"{self.prefix}-{i:0{width}d}" for i in range(self.count)]

    def folder(self, root: Path) -> Path:
        """Where this set's models live under ``root`` (one folder per base and noise:
        model ``i`` is the same whatever the count)."""
        return root / f"{self.base}-noise{self.noise:g}"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def perturb(tensors: dict[str, np.ndarray], seed: int, noise: float) -> dict[str, np.ndarray]:
    """Every floating-point tensor plus ``noise * N(0, 1)``, drawn in name order
    from a generator seeded with ``seed``; others (position ids) as they are."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(tensors):
        tensor = tensors[name]
        if np.issubdtype(tensor.dtype, np.floating):
            step = rng.standard_normal(tensor.shape, dtype=np.float32) * np.float32(noise)
            tensor = (tensor + step.astype(tensor.dtype)).astype(tensor.dtype)
        out[name] = np.ascontiguousarray(tensor)
    return out


def _recipe(models: ModelSet, index: int, base_sha256: str) -> dict[str, object]:
    return {"base_sha256": base_sha256, "seed": index, "noise": models.noise}


def _card(card: dict[str, object], models: ModelSet, name: str, index: int) -> dict[str, object]:
    """The packaged card as model ``name``'s: its weights in its own folder, loaded on
    demand, with the set's latency target."""
    out = dict(card)
    out["name"] = name
    out["source"] = {"path": "."}
    out["preload"] = False
    out["description"] = (
        f"{models.base} with every floating-point tensor moved by {models.noise:g} x N(0, 1),"
        f" seed {index}: one of {models.count} distinct models for benchmarks."
    )
    if models.latency_target_ms is not None:
        out["latency_target_ms"] = models.latency_target_ms
    return out


def _intact(folder: Path, recipe: dict[str, object]) -> bool:
    """The folder was made by ``recipe`` and its weights hash to what it records."""
    try:
        written = json.loads((folder / RECIPE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if written.get("recipe") != recipe or not (folder / "model.yaml").is_file():
        return False
    return bool(sha256_of(folder / WEIGHTS) == written.get("weights_sha256"))


def _write(
    target: Path, source: Path, card: dict[str, object], recipe: dict[str, object], noise: float
) -> None:
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name.startswith(_KEPT):
            shutil.copyfile(path, partial / path.name)
    tensors = perturb(load_file(str(source / WEIGHTS)), int(str(recipe["seed"])), noise)
    save_file(tensors, str(partial / WEIGHTS), metadata={"format": "pt"})
    (partial / "model.yaml").write_text(yaml.safe_dump(card, sort_keys=False), encoding="utf-8")
    written = {"recipe": recipe, "weights_sha256": sha256_of(partial / WEIGHTS)}
    (partial / RECIPE).write_text(json.dumps(written, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def ensure_models(
    models: ModelSet,
    root: Path | None = None,
    source: Path | None = None,
    card: dict[str, object] | None = None,
    on_model: Callable[[str, bool], None] | None = None,
) -> Path:
    """The set's folder under ``root`` with every model in it, made where missing
    or not intact; ``on_model(name, made)`` after each. ``source`` (the folder of
    ``model.safetensors`` and the tokenizer) and ``card`` default to the packaged
    model's."""
    if source is None or card is None:
        spec_folder = default_repository_path() / models.base
        source = source or read_spec(spec_folder).resolve_source()
        card = card or yaml.safe_load((spec_folder / "model.yaml").read_text(encoding="utf-8"))
    folder = models.folder(root or bench_models_dir())
    folder.mkdir(parents=True, exist_ok=True)
    base_sha256 = sha256_of(source / WEIGHTS)
    for index, name in enumerate(models.names()):
        recipe = _recipe(models, index, base_sha256)
        made = not _intact(folder / name, recipe)
        if made:
            _write(folder / name, source, _card(card, models, name, index), recipe, models.noise)
        else:  # the card follows the scenario (its latency target) without new weights
            text = yaml.safe_dump(_card(card, models, name, index), sort_keys=False)
            (folder / name / "model.yaml").write_text(text, encoding="utf-8")
        if on_model is not None:
            on_model(name, made)
    return folder
