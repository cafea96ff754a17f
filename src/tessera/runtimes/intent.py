"""Intent classification with the ``rag-intent-classifier`` package's sklearn heads.

The package embeds with sentence-transformers' all-MiniLM-L6-v2 (Transformer,
max 256 tokens, mean pooling, Normalize: its ``encoder.encode(texts)``) and
predicts with a joblib-pickled classifier, ``LogisticRegression`` by default.
This adapter reproduces that on the shared MiniLM encoder (option ``encoder``,
a local folder) without importing the package: its ``infer.py`` imports
sentence-transformers, falls back to a hub download when its pickled encoder
is absent (it is absent in 1.0.7) and reloads the head on every call. Here the
head and the label map are loaded once, at load.

Labels are resolved as the package's ``_resolve_label_name`` does: a class is
mapped through ``label_map.joblib`` unless the mapped value is a number (the
six meta-intents are stored as ``name -> "201"``...), in which case the class
name itself is the label.

Joblib files are pickles, which run code as they load: a head loads from its
safe form where there is one (``<head>.json``, the classifier's class, its
parameters and labels, beside ``<head>.npz``, its fitted arrays, read without
pickle), in the model folder or in the server's cache. Its joblib loads only
where ``repository/trust.py`` allows a pickle (an installed package, as the
packaged heads are, or a folder of ``trusted_pickle_dirs``; never for a model
registered over the API), and is then converted once into the cache, from
which later loads read the safe form. ``python -m tessera.runtimes.intent
FOLDER HEAD OUT`` converts a trusted head into ``OUT`` by hand.

The model is a head model (``heads.HeadModel``): its requests may run the
shared encoder in one batch with other head models' of the same stage key
(encoder batching, ``engine/groups.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tessera.errors import ModelUnavailableError, PermissionDeniedError
from tessera.repository.trust import PICKLE_RULE, unpickle_allowed
from tessera.runtimes.base import LoadContext, SharedComponents
from tessera.runtimes.cache import private_dirs
from tessera.runtimes.heads import HeadModel, stage_key
from tessera.runtimes.hf import (
    EncoderOptions,
    SentenceEncoder,
    acquire_encoder,
    encoder_key,
    expect_task,
    hf_weights_bytes,
    int_option,
    top_labels,
    torch_device_of,
)
from tessera.tasks.types import Task

if TYPE_CHECKING:
    from tessera.device import Device
    from tessera.repository.spec import ModelSpec

_LABEL_MAP = "label_map.joblib"
_SAFE_FORMAT = "tessera-intent-head/1"
# The classifiers a safe head is rebuilt as (the package's six heads), by name.
_HEAD_CLASSES = {
    "LogisticRegression": "sklearn.linear_model",
    "SGDClassifier": "sklearn.linear_model",
    "RidgeClassifier": "sklearn.linear_model",
    "PassiveAggressiveClassifier": "sklearn.linear_model",
    "LinearSVC": "sklearn.svm",
    "GaussianNB": "sklearn.naive_bayes",
}
_JSON_SCALARS = bool | int | float | str | None
_METHOD = "sklearn arrays (nbytes) + torch tensors (shared encoder)"
# How the package's SentenceTransformer embeds (modules.json: Pooling mean, Normalize).
_PACKAGE_ENCODING = EncoderOptions(pooling="mean", normalize=True, max_length=256)


def _joblib_load(path: Path) -> Any:
    import joblib

    with warnings.catch_warnings():
        # The heads were pickled by scikit-learn 1.5; the linear models' state
        # is plain arrays and loads unchanged in later versions.
        from sklearn.exceptions import InconsistentVersionWarning

        warnings.simplefilter("ignore", InconsistentVersionWarning)
        return joblib.load(path)


def resolve_label(prediction: object, label_map: Mapping[Any, Any]) -> str:
    """The package's ``_resolve_label_name``."""
    key = str(prediction)
    if key in label_map:
        mapped = label_map[key]
        if isinstance(mapped, str):
            if mapped.isdigit() or (mapped.startswith("-") and mapped[1:].isdigit()):
                return key
            return mapped
        return str(mapped)
    for map_key, value in label_map.items():
        if str(map_key) == key or str(value) == key:
            return str(map_key)
    return key


def _arrays_bytes(estimator: Any) -> int:
    """Bytes of the numpy arrays an sklearn estimator holds (its fitted state)."""
    return sum(v.nbytes for v in vars(estimator).values() if isinstance(v, np.ndarray))


@dataclass(frozen=True, slots=True)
class IntentHead:
    """A fitted sklearn classifier and the label of each of its classes."""

    classifier: Any
    labels: tuple[str, ...]
    num_bytes: int

    @classmethod
    def from_pickles(cls, folder: Path, name: str) -> IntentHead:
        """The package's joblib files: call only where a pickle may load."""
        classifier = _joblib_load(folder / f"{name}.joblib")
        label_map = _joblib_load(folder / _LABEL_MAP)
        labels = tuple(resolve_label(c, label_map) for c in classifier.classes_)
        return cls(classifier, labels, _arrays_bytes(classifier))

    @classmethod
    def from_safe(cls, folder: Path, name: str) -> IntentHead:
        """The safe form: JSON and arrays, no pickle (``save``)."""
        meta = json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or meta.get("format") != _SAFE_FORMAT:
            raise ValueError(f"{name}.json is not a {_SAFE_FORMAT} head")
        module = _HEAD_CLASSES.get(str(meta.get("class")))
        if module is None:
            raise ValueError(f"{name}.json: unknown classifier {meta.get('class')!r}")
        import importlib

        classifier = getattr(importlib.import_module(module), str(meta["class"]))(**meta["params"])
        objects = set(meta.get("object_arrays", ()))  # saved as strings (no pickle)
        with np.load(folder / f"{name}.npz", allow_pickle=False) as arrays:
            for key in arrays.files:
                value = arrays[key]
                setattr(classifier, key, value.astype(object) if key in objects else value)
        for key, value in meta["attributes"].items():
            setattr(classifier, key, value)
        labels = tuple(str(label) for label in meta["labels"])
        return cls(classifier, labels, _arrays_bytes(classifier))

    def save(self, folder: Path, name: str) -> None:
        """Write the safe form into ``folder``: ``<name>.json`` and ``<name>.npz``."""
        fitted = vars(self.classifier)
        arrays = {
            k: v.astype(str) if v.dtype == object else v
            for k, v in fitted.items()
            if isinstance(v, np.ndarray)
        }
        meta = {
            "format": _SAFE_FORMAT,
            "class": type(self.classifier).__name__,
            "params": {
                k: v
                for k, v in self.classifier.get_params().items()
                if isinstance(v, _JSON_SCALARS)
            },
            "attributes": {
                k: v.item() if isinstance(v, np.generic) else v
                for k, v in fitted.items()
                if k.endswith("_") and isinstance(v, _JSON_SCALARS | np.generic)
            },
            "labels": list(self.labels),
            "object_arrays": [
                k for k, v in fitted.items() if isinstance(v, np.ndarray) and v.dtype == object
            ],
        }
        np.savez(folder / f"{name}.npz", allow_pickle=False, **arrays)
        (folder / f"{name}.json").write_text(json.dumps(meta), encoding="utf-8")

    def scores(self, embeddings: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Class probabilities where the head has them, else its decision scores."""
        if hasattr(self.classifier, "predict_proba"):
            return np.asarray(self.classifier.predict_proba(embeddings))
        return np.asarray(self.classifier.decision_function(embeddings))


class RagIntentModel(HeadModel):
    """Intents of texts: the ``top_k`` labels by the head's probability."""

    def __init__(
        self,
        shared: SharedComponents,
        key: str,
        encoder: SentenceEncoder,
        head: IntentHead,
        top_k: int,
    ) -> None:
        super().__init__(shared, key, encoder, _PACKAGE_ENCODING, head.num_bytes, _METHOD)
        self._head = head
        self._top_k = top_k

    @property
    def labels(self) -> tuple[str, ...]:
        """Every label the head can return."""
        return self._head.labels

    def head(self, vectors: np.ndarray[Any, Any]) -> list[Any]:
        scores = self._head.scores(vectors)
        return [top_labels(row, self._head.labels, self._top_k) for row in scores]


class RagIntentLoader:
    """Adapter ``rag-intent``: rag-intent-classifier's sklearn heads (source: its
    ``models/`` folder; option head, default LogisticRegression) over the shared
    MiniLM encoder (option ``encoder``, required: the package would use a hub)."""

    def _encoder_path(self, spec: ModelSpec) -> Path:
        path = spec.option_path("encoder")
        if path is None:
            raise ModelUnavailableError(spec.name, "option encoder (a MiniLM folder) is required")
        return path

    def _head_name(self, spec: ModelSpec) -> str:
        head = spec.options.get("head", "LogisticRegression")
        if not isinstance(head, str) or "/" in head:
            raise ModelUnavailableError(spec.name, "option head must be a model name")
        return head

    def estimate_bytes(self, spec: ModelSpec) -> int:
        """The head's file (its safe form's arrays, else its pickle) plus the
        shared encoder's weights."""
        folder, name = spec.resolve_source(), self._head_name(spec)
        head = next(
            (p for p in (folder / f"{name}.npz", folder / f"{name}.joblib") if p.is_file()), None
        )
        head_bytes = head.stat().st_size if head is not None else 0
        return head_bytes + hf_weights_bytes(self._encoder_path(spec))

    def shared_keys(self, spec: ModelSpec, device: Device | None = None) -> tuple[str, ...]:
        return (encoder_key(self._encoder_path(spec), torch_device_of(device), spec),)

    def stage_key(self, spec: ModelSpec, device: Device | None = None) -> str:
        """The stage key its model will have on ``device`` (``heads.HeadModel``)."""
        (encoder,) = self.shared_keys(spec, device)
        return stage_key(encoder, _PACKAGE_ENCODING)

    def load(self, spec: ModelSpec, ctx: LoadContext) -> RagIntentModel:
        expect_task(spec, Task.CLASSIFY)
        top_k = int_option(spec, "top_k", 5)
        folder = spec.resolve_source()
        try:
            head = load_head(spec, ctx, folder, self._head_name(spec))
        except (OSError, ValueError, AttributeError, ImportError, EOFError, TypeError) as e:
            raise ModelUnavailableError(spec.name, f"cannot load intent head: {e}") from e
        key, encoder = acquire_encoder(ctx, self._encoder_path(spec), spec)
        model = RagIntentModel(ctx.shared, key, encoder, head, top_k)
        model.take_ids_ahead(spec)
        return model


def load_head(spec: ModelSpec, ctx: LoadContext, folder: Path, name: str) -> IntentHead:
    """``name``'s head in ``folder``: its safe form there, else the cache's
    conversion of its joblib, else its joblib where a pickle may load (then
    converted into the cache); ``PermissionDeniedError`` otherwise."""
    if (folder / f"{name}.json").is_file():
        return IntentHead.from_safe(folder, name)
    pickles = (folder / f"{name}.joblib", folder / _LABEL_MAP)
    cached = _cache_folder(ctx.cache_dir, pickles)
    if cached is not None and (cached / f"{name}.json").is_file():
        return IntentHead.from_safe(cached, name)
    for path in pickles:
        if not unpickle_allowed(path, spec, ctx.trusted_pickle_dirs):
            raise PermissionDeniedError(
                f"model {spec.name!r}: {path.name} is a pickle and has no safe form"
                f" ({name}.json and {name}.npz): {PICKLE_RULE}"
            )
    head = IntentHead.from_pickles(folder, name)
    if cached is not None:
        _keep(head, cached, name)
    return head


def _cache_folder(cache_dir: Path | None, pickles: tuple[Path, ...]) -> Path | None:
    """Where the cache keeps the safe form of these files' contents (by digest)."""
    if cache_dir is None:
        return None
    digest = hashlib.sha256()
    for path in pickles:
        digest.update(path.read_bytes())  # a missing file fails the load as before
    return cache_dir / "intent-heads" / digest.hexdigest()[:32]


def _keep(head: IntentHead, cached: Path, name: str) -> None:
    """Write the safe form into the cache, whole or not at all."""
    private_dirs(cached.parent)
    staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".staging-"))
    head.save(staging, name)
    try:
        os.replace(staging, cached)  # another load may have kept it first
    except OSError:
        for leftover in staging.iterdir():
            leftover.unlink()
        staging.rmdir()


def main(argv: list[str]) -> int:
    """``python -m tessera.runtimes.intent FOLDER HEAD OUT``: convert a head
    whose joblib files you trust into its safe form in ``OUT``."""
    if len(argv) != 3:
        print("usage: python -m tessera.runtimes.intent FOLDER HEAD OUT", file=sys.stderr)
        return 2
    folder, name, out = Path(argv[0]), argv[1], Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    IntentHead.from_pickles(folder, name).save(out, name)
    print(f"{out / name}.json, {out / name}.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
