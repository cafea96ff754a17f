"""Many classifier heads over one packaged encoder, made reproducibly.

Head ``i`` of a set is a linear classifier over the packaged model's encoder
(tessera's ``encoder-head`` adapter, ``tessera.runtimes.heads``): ``2 + i %
7`` labels of its own (its name and a word each), its weights and bias drawn
from a generator seeded with ``i``, so the same bytes on every machine and no
two heads alike. Each is a real model folder::

    ~/.cache/tessera/bench-models/heads-all-minilm-l6-v2/
      heads.json            # the encoder's folder (peers load it from there)
      head-000/
        model.yaml          # encoder-head over the packaged encoder
        head.safetensors    # weight (labels x 384) and bias, float32
        labels.json
        recipe.json         # the recipe and the head's SHA-256

A head is written once and reused while its ``recipe.json`` matches the
recipe and its file still hashes to what it records; its card follows the
scenario (its latency target) without new weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from harness.perturbed import sha256_of
from tessera.repository import default_repository_path, read_spec
from tessera.runtimes.heads import HEAD_FILE, LABELS_FILE, write_linear_head

RECIPE = "recipe.json"
SET_FILE = "heads.json"
RECIPE_VERSION = 1
# Words a head's labels are made of (each label its head's name and one of them).
_WORDS = (
    "billing", "refund", "delivery", "account", "password", "cancel", "upgrade", "complaint",
    "praise", "question", "invoice", "shipping", "return", "warranty", "login", "security",
    "privacy", "outage", "feature", "pricing",
)  # fmt: skip


@dataclass(frozen=True)
class HeadSet:
    """``count`` linear heads over the encoder of the packaged model ``base``,
    named ``PREFIX-000`` and on, each with ``latency_target_ms`` on its card."""

    base: str
    count: int
    prefix: str = "head"
    latency_target_ms: float | None = None

    def names(self) -> list[str]:
        width = max(3, len(str(self.count - 1)))
        return [f"{self.prefix}-{i:0{width}d}" for i in range(self.count)]

    def folder(self, root: Path) -> Path:
        """Where this set's heads live under ``root`` (head ``i`` is the same
        whatever the count)."""
        return root / f"heads-{self.base}"


def head_labels(name: str, index: int) -> list[str]:
    """Head ``index``'s labels: ``2 + index % 7`` of them, each its name and a word."""
    rng = np.random.default_rng(index)
    count = 2 + index % 7
    words = rng.choice(len(_WORDS), size=count, replace=False)
    return [f"{name}-{_WORDS[int(w)]}" for w in words]


def head_weights(index: int, labels: int, dims: int) -> tuple[np.ndarray, np.ndarray]:
    """Head ``index``'s weight (``labels`` x ``dims``) and bias, seeded by ``index``."""
    rng = np.random.default_rng(1_000_003 + index)
    weight = rng.standard_normal((labels, dims), dtype=np.float32) / np.float32(math.sqrt(dims))
    return weight, rng.standard_normal(labels, dtype=np.float32) * np.float32(0.1)


def _card(base: dict[str, object], heads: HeadSet, name: str, index: int) -> dict[str, object]:
    """Head ``name``'s card: ``encoder-head`` over ``base``'s (the packaged card's) weights."""
    card: dict[str, object] = {
        "name": name,
        "task": "classify",
        "runtime": "torch",
        "adapter": "encoder-head",
        "source": {"path": "."},
        "description": (
            f"A linear head (seed {index}) over {heads.base}'s encoder: one of"
            f" {heads.count} heads for benchmarks."
        ),
        "batching": base.get("batching", {}),
        "preload": False,
        "options": {"encoder": base["source"], "top_k": 3},
    }
    if heads.latency_target_ms is not None:
        card["latency_target_ms"] = heads.latency_target_ms
    return card


def _intact(folder: Path, recipe: dict[str, object]) -> bool:
    try:
        written = json.loads((folder / RECIPE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if written.get("recipe") != recipe or not (folder / LABELS_FILE).is_file():
        return False
    return bool(sha256_of(folder / HEAD_FILE) == written.get("head_sha256"))


def _write(folder: Path, name: str, index: int, dims: int, recipe: dict[str, object]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    labels = head_labels(name, index)
    weight, bias = head_weights(index, len(labels), dims)
    write_linear_head(folder, weight, bias, labels)
    written = {"recipe": recipe, "head_sha256": sha256_of(folder / HEAD_FILE)}
    (folder / RECIPE).write_text(json.dumps(written, indent=2) + "\n", encoding="utf-8")


def ensure_heads(
    heads: HeadSet, root: Path, on_head: Callable[[str, bool], None] | None = None
) -> Path:
    """The set's folder under ``root`` with every head in it, made where
    missing or not intact, and ``heads.json`` naming the encoder's folder;
    ``on_head(name, made)`` after each."""
    spec_folder = default_repository_path() / heads.base
    base = yaml.safe_load((spec_folder / "model.yaml").read_text(encoding="utf-8"))
    encoder = read_spec(spec_folder).resolve_source()
    config = json.loads((encoder / "config.json").read_text(encoding="utf-8"))
    dims = int(config["hidden_size"])
    folder = heads.folder(root)
    folder.mkdir(parents=True, exist_ok=True)
    described = {"base": heads.base, "encoder": str(encoder), "dims": dims}
    (folder / SET_FILE).write_text(json.dumps(described, indent=2) + "\n", encoding="utf-8")
    for index, name in enumerate(heads.names()):
        recipe = {"version": RECIPE_VERSION, "seed": index, "dims": dims, "name": name}
        made = not _intact(folder / name, recipe)
        if made:
            _write(folder / name, name, index, dims, recipe)
        text = yaml.safe_dump(_card(base, heads, name, index), sort_keys=False)
        (folder / name / "model.yaml").write_text(text, encoding="utf-8")
        if on_head is not None:
            on_head(name, made)
    return folder
