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
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tessera.errors import ModelUnavailableError
from tessera.runtimes.base import LoadContext, SharedComponents
from tessera.runtimes.hf import (
    EncoderOptions,
    SentenceEncoder,
    SharedEncoderModel,
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
    def from_folder(cls, folder: Path, name: str) -> IntentHead:
        classifier = _joblib_load(folder / f"{name}.joblib")
        label_map = _joblib_load(folder / _LABEL_MAP)
        labels = tuple(resolve_label(c, label_map) for c in classifier.classes_)
        return cls(classifier, labels, _arrays_bytes(classifier))

    def scores(self, embeddings: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Class probabilities where the head has them, else its decision scores."""
        if hasattr(self.classifier, "predict_proba"):
            return np.asarray(self.classifier.predict_proba(embeddings))
        return np.asarray(self.classifier.decision_function(embeddings))


class RagIntentModel(SharedEncoderModel):
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

    def run(self, items: Sequence[Any]) -> list[Any]:
        if not items:
            return []
        scores = self._head.scores(self.vectors(items))
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
        """The head's pickle plus the shared encoder's weights."""
        head = spec.resolve_source() / f"{self._head_name(spec)}.joblib"
        head_bytes = head.stat().st_size if head.is_file() else 0
        return head_bytes + hf_weights_bytes(self._encoder_path(spec))

    def shared_keys(self, spec: ModelSpec, device: Device | None = None) -> tuple[str, ...]:
        return (encoder_key(self._encoder_path(spec), torch_device_of(device), spec),)

    def load(self, spec: ModelSpec, ctx: LoadContext) -> RagIntentModel:
        expect_task(spec, Task.CLASSIFY)
        top_k = int_option(spec, "top_k", 5)
        folder = spec.resolve_source()
        try:
            head = IntentHead.from_folder(folder, self._head_name(spec))
        except (OSError, ValueError, AttributeError, ImportError, EOFError) as e:
            raise ModelUnavailableError(spec.name, f"cannot load intent head: {e}") from e
        key, encoder = acquire_encoder(ctx, self._encoder_path(spec), spec)
        model = RagIntentModel(ctx.shared, key, encoder, head, top_k)
        model.take_ids_ahead(spec)
        return model
