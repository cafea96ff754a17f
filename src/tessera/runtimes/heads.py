"""Classifier heads over a shared encoder: many small models, one encoder.

A *head model* is a shared encoder (``hf.SharedEncoderModel``: its weights
and tokenizer held once, under ``hf.encoder_key``) and a head of its own over
the encoder's pooled vectors (``runtimes.base.EncoderHead``). Its first stage
is named by ``stage_key``: the encoder's key (the content of its files, the
device, the precision and graphs) and its readout (pooling, normalisation,
window). Two models of one stage key make the same vector of an item, so the
engine may run the first stage once for the rows of many such models and
each row's head after (encoder batching, ``engine/groups.py``). A loader of
such models says a card's stage key before it loads (``stage_key``), so that
its requests can queue with the others' from the first.

Adapter ``encoder-head``: a linear classifier over the encoder's vectors,
read without pickle: ``head.safetensors`` (tensors ``weight``, labels x
dimensions, and ``bias``, float32) and ``labels.json`` (a JSON list of the
labels, one per row of ``weight``) in the card's source folder. Options:
``encoder`` (the encoder's folder or ``{package, path}``, required),
``head`` and ``labels`` (the two files' names), ``top_k`` (5),
``multi_label`` (false: softmax over the labels; true: a sigmoid each), and
the encoder's ``pooling``, ``normalize`` and ``max_length``
(``hf.EncoderOptions``). The intent classifier (``intent.py``) is a head
model too, with scikit-learn heads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
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
    sigmoid,
    softmax,
    top_labels,
    torch_device_of,
)
from tessera.tasks.types import ClassifyOutput, Task

if TYPE_CHECKING:
    import numpy.typing as npt

    from tessera.device import Device
    from tessera.repository.spec import ModelSpec

HEAD_FILE = "head.safetensors"
LABELS_FILE = "labels.json"
_METHOD = "numpy arrays (nbytes) + torch tensors (shared encoder)"


def stage_key(encoder: str, options: EncoderOptions) -> str:
    """The stage key of a head over the shared encoder ``encoder`` (its
    ``hf.encoder_key``) read out as ``options`` say."""
    norm = "normalized" if options.normalize else "raw"
    return f"{encoder}|{options.pooling}|{norm}|{options.max_length}"


class HeadModel(SharedEncoderModel):
    """A shared encoder and a head of its own (``runtimes.base.EncoderHead``):
    ``run`` is ``head(vectors(items))``."""

    @property
    def stage_key(self) -> str:
        return stage_key(self._key, self._options)

    def head(self, vectors: npt.NDArray[np.float32]) -> list[Any]:
        raise NotImplementedError

    def run(self, items: Sequence[Any]) -> list[Any]:
        if not items:
            return []
        return self.head(self.vectors(items))


@dataclass(frozen=True, slots=True)
class LinearHead:
    """Logits ``vectors @ weight.T + bias``, one per label; a softmax over
    them (a sigmoid each where ``multi_label``), the ``top_k`` best."""

    weight: npt.NDArray[np.float32]
    bias: npt.NDArray[np.float32]
    labels: tuple[str, ...]
    multi_label: bool = False
    top_k: int = 5

    @classmethod
    def read(cls, head: Path, labels: Path, *, multi_label: bool, top_k: int) -> LinearHead:
        """From ``head`` (safetensors: ``weight`` and ``bias``) and ``labels``
        (a JSON list); ``ValueError`` where they do not make one head."""
        from safetensors.numpy import load_file

        tensors = load_file(str(head))
        weight, bias = tensors.get("weight"), tensors.get("bias")
        if weight is None or bias is None:
            raise ValueError(f"{head.name} must hold tensors 'weight' and 'bias'")
        if weight.ndim != 2 or bias.shape != (weight.shape[0],):
            raise ValueError(
                f"{head.name}: weight {weight.shape} and bias {bias.shape} do not make a head"
                " (weight: labels x dimensions, bias: one per label)"
            )
        names = json.loads(labels.read_text(encoding="utf-8"))
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{labels.name} must be a JSON list of labels")
        if len(names) != weight.shape[0]:
            raise ValueError(f"{labels.name} has {len(names)} labels, the head {weight.shape[0]}")
        return cls(
            np.ascontiguousarray(weight, dtype=np.float32),
            np.ascontiguousarray(bias, dtype=np.float32),
            tuple(names),
            multi_label,
            min(top_k, len(names)),
        )

    @property
    def num_bytes(self) -> int:
        return int(self.weight.nbytes + self.bias.nbytes)

    def outputs(self, vectors: npt.NDArray[np.float32]) -> list[ClassifyOutput]:
        logits = np.asarray(vectors, dtype=np.float32) @ self.weight.T + self.bias
        scores = sigmoid(logits) if self.multi_label else softmax(logits)
        return [top_labels(row, self.labels, self.top_k) for row in scores]


def write_linear_head(
    folder: Path, weight: npt.NDArray[np.float32], bias: npt.NDArray[np.float32], labels: list[str]
) -> None:
    """Write a head ``encoder-head`` reads: ``HEAD_FILE`` and ``LABELS_FILE`` in ``folder``."""
    from safetensors.numpy import save_file

    tensors = {
        "weight": np.ascontiguousarray(weight, dtype=np.float32),
        "bias": np.ascontiguousarray(bias, dtype=np.float32),
    }
    save_file(tensors, str(folder / HEAD_FILE))
    (folder / LABELS_FILE).write_text(json.dumps(labels), encoding="utf-8")


class EncoderHeadModel(HeadModel):
    """Labels of texts: a ``LinearHead`` over the shared encoder's vectors."""

    def __init__(
        self,
        shared: SharedComponents,
        key: str,
        encoder: SentenceEncoder,
        options: EncoderOptions,
        head: LinearHead,
    ) -> None:
        super().__init__(shared, key, encoder, options, head.num_bytes, _METHOD)
        self._head = head

    @property
    def labels(self) -> tuple[str, ...]:
        return self._head.labels

    def head(self, vectors: npt.NDArray[np.float32]) -> list[Any]:
        return list(self._head.outputs(vectors))


class EncoderHeadLoader:
    """Adapter ``encoder-head`` (module notes)."""

    def _encoder_path(self, spec: ModelSpec) -> Path:
        path = spec.option_path("encoder")
        if path is None:
            raise ModelUnavailableError(spec.name, "option encoder (a folder) is required")
        return path

    def _file(self, spec: ModelSpec, option: str, default: str) -> Path:
        name = spec.options.get(option, default)
        if not isinstance(name, str) or "/" in name:
            raise ModelUnavailableError(spec.name, f"option {option} must be a file name")
        return spec.resolve_source() / name

    def estimate_bytes(self, spec: ModelSpec) -> int:
        """The head's file plus the shared encoder's weights."""
        head = self._file(spec, "head", HEAD_FILE)
        head_bytes = head.stat().st_size if head.is_file() else 0
        return head_bytes + hf_weights_bytes(self._encoder_path(spec))

    def shared_keys(self, spec: ModelSpec, device: Device | None = None) -> tuple[str, ...]:
        return (encoder_key(self._encoder_path(spec), torch_device_of(device), spec),)

    def stage_key(self, spec: ModelSpec, device: Device | None = None) -> str:
        """The stage key its model will have on ``device`` (``HeadModel.stage_key``)."""
        (encoder,) = self.shared_keys(spec, device)
        return stage_key(encoder, EncoderOptions.from_spec(spec))

    def load(self, spec: ModelSpec, ctx: LoadContext) -> EncoderHeadModel:
        expect_task(spec, Task.CLASSIFY)
        options = EncoderOptions.from_spec(spec)
        multi_label = spec.options.get("multi_label", False)
        if not isinstance(multi_label, bool):
            raise ModelUnavailableError(spec.name, "option multi_label must be true or false")
        try:
            head = LinearHead.read(
                self._file(spec, "head", HEAD_FILE),
                self._file(spec, "labels", LABELS_FILE),
                multi_label=multi_label,
                top_k=int_option(spec, "top_k", 5),
            )
        except (OSError, ValueError) as e:
            raise ModelUnavailableError(spec.name, f"cannot read its head: {e}") from e
        key, encoder = acquire_encoder(ctx, self._encoder_path(spec), spec)
        dims = encoder.dim
        if dims != head.weight.shape[1]:
            ctx.shared.release(key)
            raise ModelUnavailableError(
                spec.name,
                f"its head takes vectors of {head.weight.shape[1]} dimensions,"
                f" its encoder makes {dims}",
            )
        model = EncoderHeadModel(ctx.shared, key, encoder, options, head)
        model.take_ids_ahead(spec)
        return model
