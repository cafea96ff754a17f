"""Hugging Face text models on torch: encoders (embedding), bi-encoder rerank,
and sequence classifiers (classify, cross-encoder rerank).

The encoder of a folder (model + tokenizer) is a shared component: an
embedding model, a bi-encoder reranker and an intent classifier over the same
folder hold one copy, acquired through ``ctx.shared`` under
``hf-encoder:{content digest}:{torch device}``: the digest is of the folder's
files (``runtimes/digest.py``), so a copy of the folder shares the copy too.
Each consumer keeps its own pooling options; the shared part is only the
weights and the tokenizer.

Everything loads from local folders with ``local_files_only=True``: a folder
that lacks a file fails the load instead of reaching for a hub.

Every model here can wait in the host tier when evicted
(``runtimes.base.OffloadingModel``): its encoder's weights move to host memory
(``runtimes/hostcopy.py``) while the modules, the config and the tokenizer
stay built, so coming back is a copy, not a load. A shared encoder moves when
the last of its models on the device leaves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tessera.errors import InferenceError, InvalidInputError, ModelUnavailableError
from tessera.footprint import Footprint
from tessera.runtimes.base import LoadContext, SharedComponents
from tessera.runtimes.digest import content_digest
from tessera.runtimes.forward import (
    DeviceOptions,
    ForwardPath,
    TokenIds,
    device_options,
    encoder_variant,
    forward_path,
)
from tessera.runtimes.hf_skeletons import load_pretrained
from tessera.runtimes.hostcopy import HostCopy, tensors_of
from tessera.runtimes.memory import files_bytes, torch_module_bytes
from tessera.runtimes.pooling import Pooling, Readout
from tessera.runtimes.precision import CHECK_TEXTS, choose_precision
from tessera.runtimes.shared_tokenizers import SharedTokenizer, shared_tokenizer
from tessera.runtimes.tokens import (
    DEFAULT_MAX_LENGTH,
    TokenPlan,
    capped_length,
    pair_ids,
    text_tokenizer,
    token_plan,
    tokenized_ids,
)
from tessera.tasks.types import ClassifyOutput, LabelScore, RerankInput, Task, TextInput

if TYPE_CHECKING:
    import numpy.typing as npt

    from tessera.device import Device
    from tessera.repository.spec import ModelSpec

log = logging.getLogger(__name__)

_TORCH_METHOD = "torch tensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# What a failing from_pretrained raises: missing files (OSError), unknown or
# inconsistent configs (ValueError, KeyError), absent optional deps (ImportError).
LOAD_ERRORS = (OSError, ValueError, KeyError, ImportError, RuntimeError)


# --- options -------------------------------------------------------------------------


def int_option(spec: ModelSpec, key: str, default: int) -> int:
    """A positive integer option."""
    value = spec.options.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelUnavailableError(spec.name, f"option {key} must be a positive integer")
    return value


@dataclass(frozen=True, slots=True)
class EncoderOptions:
    """How token vectors become one vector per text."""

    pooling: Pooling = "mean"
    normalize: bool = True
    max_length: int = 256

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> EncoderOptions:
        pooling = spec.options.get("pooling", "mean")
        if pooling not in ("mean", "cls"):
            raise ModelUnavailableError(spec.name, "option pooling must be 'mean' or 'cls'")
        normalize = spec.options.get("normalize", True)
        if not isinstance(normalize, bool):
            raise ModelUnavailableError(spec.name, "option normalize must be true or false")
        return cls(pooling, normalize, int_option(spec, "max_length", DEFAULT_MAX_LENGTH))


# --- items ---------------------------------------------------------------------------


def texts_of(items: Sequence[Any]) -> list[str]:
    """The texts of ``TextInput`` items; anything else is a bad request."""
    texts = []
    for item in items:
        if not isinstance(item, TextInput) or not isinstance(item.text, str):
            raise InvalidInputError(f"expected TextInput items, got {type(item).__name__}")
        texts.append(item.text)
    return texts


def pairs_of(items: Sequence[Any]) -> list[RerankInput]:
    for item in items:
        if not isinstance(item, RerankInput):
            raise InvalidInputError(f"expected RerankInput items, got {type(item).__name__}")
    return list(items)


def expect_task(spec: ModelSpec, *tasks: Task) -> None:
    if spec.task not in tasks:
        allowed = ", ".join(t.value for t in tasks)
        raise ModelUnavailableError(
            spec.name, f"adapter {spec.adapter} does {allowed}, not {spec.task.value}"
        )


# --- logits to outputs (numpy; shared with the ONNX classifier) ----------------------


def softmax(logits: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    result: npt.NDArray[np.float64] = exp / exp.sum(axis=-1, keepdims=True)
    return result


def sigmoid(logits: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    result: npt.NDArray[np.float64] = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    return result


def top_labels(scores: npt.NDArray[Any], labels: Sequence[str], top_k: int) -> ClassifyOutput:
    """The ``top_k`` best labels of one row of scores, best first."""
    order = np.argsort(-scores, kind="stable")[:top_k]
    return ClassifyOutput(tuple(LabelScore(labels[i], float(scores[i])) for i in order))


@dataclass(frozen=True, slots=True)
class ClassifierHead:
    """How a classifier's logits become task outputs.

    classify: softmax over labels (sigmoid per label when multi-label), the
    ``top_k`` best. rerank (a cross-encoder): ``sigmoid(logit)`` with one
    output, else the softmax probability of label 1 ("relevant").
    """

    task: Task
    labels: tuple[str, ...]
    multi_label: bool = False
    top_k: int = 5

    @classmethod
    def from_config(cls, spec: ModelSpec, config: Any) -> ClassifierHead:
        """From a transformers config (or a config.json mapping)."""

        def get(key: str) -> Any:
            return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)

        id2label = get("id2label") or {}
        num_labels = int(get("num_labels") or len(id2label) or 1)
        labels = tuple(
            str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels)
        )
        multi = get("problem_type") == "multi_label_classification"
        return cls(spec.task, labels, multi, int_option(spec, "top_k", 5))

    def outputs(self, logits: npt.NDArray[Any]) -> list[Any]:
        if logits.ndim != 2:
            raise InferenceError(f"expected logits of shape (batch, labels), got {logits.shape}")
        if self.task is Task.RERANK:
            scores = sigmoid(logits[:, 0]) if logits.shape[1] == 1 else softmax(logits)[:, 1]
            return [float(s) for s in scores]
        probs = sigmoid(logits) if self.multi_label else softmax(logits)
        return [top_labels(row, self.labels, self.top_k) for row in probs]


# --- the shared encoder --------------------------------------------------------------


def torch_device_of(device: Device | None) -> str:
    return device.torch_device() if device is not None else "cpu"


def encoder_key(path: Path, torch_device: str, spec: ModelSpec | None = None) -> str:
    """The shared-component key of the encoder in ``path`` on ``torch_device``:
    by the content of its files, so a copied folder shares the same encoder,
    and by the precision and graphs ``spec`` asks for where not the defaults."""
    variant = encoder_variant(spec) if spec is not None else ""
    return f"hf-encoder:{content_digest(path)}:{torch_device}{variant}"


def hf_weights_bytes(path: Path) -> int:
    """Bytes of a Hugging Face folder's weights (safetensors preferred, as transformers does)."""
    if path.is_file():
        return path.stat().st_size
    safetensors = files_bytes(path, (".safetensors",))
    return safetensors or files_bytes(path, _WEIGHT_SUFFIXES) or files_bytes(path)


def _same_ids(tokenizer: SharedTokenizer, plan: TokenPlan) -> bool:
    """Whether texts tokenised by ``plan`` get the ids ``tokenizer`` gives them
    (truncated at the plan's window): padding on the right, token types all
    0, the same ids for ``CHECK_TEXTS`` and a text past the window."""
    if tokenizer.padding_side != "right" or tokenizer.pad_token_id is None:
        return False
    texts = [*CHECK_TEXTS, "word " * plan.max_length]
    expected = tokenizer(texts, truncation=True, max_length=plan.max_length)
    types = expected.get("token_type_ids") or []
    if any(any(row) for row in types):
        return False
    made = text_tokenizer(plan)([TextInput(text) for text in texts])
    ids = [np.frombuffer(item.ids, dtype=np.int32).tolist() for item in made]
    return bool(ids == [list(row) for row in expected["input_ids"]])


class SentenceEncoder:
    """A Hugging Face encoder and its tokenizer: texts to pooled float32
    vectors, or (a classifier) to logits, every batch through the one
    ``ForwardPath`` chosen at its load (``runtimes/forward.py``).

    Thread-safe. Tokenization is serialised by its ``SharedTokenizer`` (every
    encoder of the same tokenizer files holds one: ``runtimes/shared_tokenizers.py``);
    the forward pass needs no lock under inference mode.
    """

    def __init__(
        self, model: Any, tokenizer: SharedTokenizer, device: str, path: ForwardPath
    ) -> None:
        self.model: Any = model
        self.tokenizer: SharedTokenizer | None = tokenizer
        self.device = device
        self.path = path
        self.num_bytes = torch_module_bytes(model)
        self._host_copy: HostCopy | None = None  # its weights while in the host tier
        # Its weights never change on the device: a restore's pinned buffer
        # is kept as theirs for the next eviction (``hostcopy.PinnedPool``).
        self._host_owner = object()
        self._tensors: list[Any] | None = None  # its parameters and buffers, once walked

    @classmethod
    def on_device(
        cls,
        model: Any,
        tokenizer: SharedTokenizer,
        device: str,
        options: DeviceOptions,
        *,
        output: str = "last_hidden_state",
        name: str = "",
        capture: bool = True,
        shared: SharedComponents | None = None,
    ) -> SentenceEncoder:
        """``model`` moved to ``device`` in the precision ``options`` ask for
        (checked: ``runtimes/precision.py``), on the path they choose
        (``forward.forward_path``: graphs a component of ``shared``, captured
        when made if ``capture``, a first load)."""
        model.to(device).eval()
        choose_precision(model, tokenizer, device, options.dtype, output, name)
        path = forward_path(
            model, tokenizer, device, options, output, capture=capture, shared=shared
        )
        return cls(model, tokenizer, device, path)

    @classmethod
    def from_folder(
        cls,
        path: Path,
        device: str,
        options: DeviceOptions | None = None,
        *,
        capture: bool = True,
        shared: SharedComponents | None = None,
    ) -> SentenceEncoder:
        from transformers import AutoModel

        quiet_transformers()
        tokenizer = shared_tokenizer(path)
        model = load_pretrained(AutoModel, path)
        options = options or DeviceOptions()
        return cls.on_device(
            model, tokenizer, device, options, name=path.name, capture=capture, shared=shared
        )

    def shared_bytes(self, *, host: bool = False) -> dict[str, int]:
        """The shared components its path holds beside it (its graphs': with
        ``host``, only while they wait in the host tier too)."""
        return self.path.shared_bytes(host=host)

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def window(self, max_length: int) -> int:
        """``max_length`` tokens, no more than the model's position table holds."""
        positions = getattr(self.model.config, "max_position_embeddings", None)
        return capped_length(max_length, positions)

    def tokenize(self, texts: list[str], max_length: int, pairs: list[str] | None = None) -> Any:
        """A padded batch of torch tensors on the encoder's device."""
        length = self.window(max_length)
        batch = self.held_tokenizer(
            texts, pairs, padding=True, truncation=True, max_length=length, return_tensors="pt"
        )
        return batch.to(self.device, non_blocking=True)  # the stream keeps the order

    def encode(
        self,
        texts: Sequence[str],
        *,
        pooling: Pooling = "mean",
        normalize: bool = True,
        max_length: int = 256,
    ) -> npt.NDArray[np.float32]:
        """One vector per text, shape ``(len(texts), dim)``."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        batch = self.tokenize(list(texts), max_length)
        return self.path.forward(batch, Readout(pooling, normalize))

    def takes_ids(self, plan: TokenPlan, max_length: int) -> bool:
        """Whether ``encode_ids`` of texts tokenised by ``plan`` makes what
        ``encode`` at ``max_length`` would: the same window, padding on the
        right, and the same ids (token types all 0) for ``CHECK_TEXTS`` and a
        text past the window."""
        tokenizer = self.held_tokenizer
        if plan.max_length != self.window(max_length):
            return False
        # The same answer for every encoder of this tokenizer (its own files'):
        # asked once (tens of milliseconds: the plan's tokenizer is built).
        answer = tokenizer.checked.get(plan.key)
        if answer is None:
            answer = tokenizer.checked[plan.key] = _same_ids(tokenizer, plan)
        return answer

    @property
    def held_tokenizer(self) -> SharedTokenizer:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ModelUnavailableError("encoder", "the encoder was closed")
        return tokenizer

    def encode_ids(
        self,
        ids: Sequence[npt.NDArray[np.int32]],
        *,
        pooling: Pooling = "mean",
        normalize: bool = True,
    ) -> npt.NDArray[np.float32]:
        """``encode`` of texts tokenised ahead (``runtimes.tokens.TokenizedText``):
        the batch ``tokenize`` would make of them, padded by its path."""
        return self.path.forward(TokenIds(ids), Readout(pooling, normalize))

    def logits(self, batch: Any) -> npt.NDArray[np.float32]:
        """A classifier's float32 logits of a tokenized batch."""
        return self.path.forward(batch, Readout())

    def offload(self) -> Footprint | None:
        """Move the weights to the host tier (the module and tokenizer stay built)."""
        if self.model is None or self._host_copy is not None:
            return None
        self.path.park()
        if self._tensors is None:
            self._tensors = tensors_of([self.model])
        self._host_copy = HostCopy.offload(
            [self.model], self.device, self._tensors, owner=self._host_owner
        )
        return self._host_copy.footprint()

    @property
    def host_method(self) -> str | None:
        """How the host tier holds the weights now; None while they are on the device."""
        copy = self._host_copy
        return copy.footprint().method if copy is not None else None

    def restore(self) -> None:
        """Bring the weights back from the host tier."""
        copy = self._host_copy
        if copy is None:
            raise ModelUnavailableError("hf-encoder", "its weights are not in the host tier")
        copy.restore()
        self._host_copy = None
        self.path.unpark()

    def close(self) -> None:
        """Drop the weights (called when the last user releases the encoder;
        again, a no-op)."""
        if self.model is None:
            return
        self.model = None
        self.tokenizer = None
        self.path.release(parked=self._host_copy is not None)
        copy, self._host_copy = self._host_copy, None
        if copy is not None:
            copy.close()
        empty_device_cache(self.device)


def quiet_transformers() -> None:
    """No per-load "Loading weights" progress bar on a server's stderr (process-wide)."""
    from transformers.utils import logging

    logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # untyped upstream


def empty_device_cache(device: str) -> None:
    """Hand freed CUDA blocks back to the card so the budget's view matches the card's."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def acquire_encoder(ctx: LoadContext, path: Path, spec: ModelSpec) -> tuple[str, SentenceEncoder]:
    """The shared encoder of ``path`` on ``ctx``'s device, as ``spec``'s
    precision and graphs options ask: (key, encoder).

    The caller owns one reference and must ``ctx.shared.release(key)`` once.
    """
    device = ctx.device.torch_device()
    key = encoder_key(path, device, spec)
    options = device_options(spec)
    model_name = spec.name

    def build() -> tuple[SentenceEncoder, int]:
        try:
            encoder = SentenceEncoder.from_folder(
                path, device, options, capture=ctx.warm_up, shared=ctx.shared
            )
        except LOAD_ERRORS as e:
            raise ModelUnavailableError(model_name, f"cannot load encoder {path}: {e}") from e
        return encoder, encoder.num_bytes

    return key, ctx.shared.acquire(key, build, on_free=SentenceEncoder.close)


class SharedEncoderModel:
    """Base of the loaded models that run on a shared encoder and own ~nothing else."""

    def __init__(
        self,
        shared: SharedComponents,
        key: str,
        encoder: SentenceEncoder,
        options: EncoderOptions,
        own_bytes: int = 0,
        method: str = _TORCH_METHOD + " (shared encoder)",
    ) -> None:
        self._shared = shared
        self._key = key
        self._encoder: SentenceEncoder | None = encoder
        self._options = options
        self.max_length = options.max_length
        self._own_bytes = own_bytes
        self._method = method
        self._unload_lock = threading.Lock()
        self._parked = False  # in the host tier: the encoder is not held on the device
        # The plan of the texts it takes tokenised ahead (runtimes/tokens.py), if any.
        self.plan_key: str | None = None

    @property
    def encoder(self) -> SentenceEncoder:
        encoder = self._encoder
        if encoder is None or self._parked:
            raise ModelUnavailableError(self._key, "the model was unloaded")
        return encoder

    def encode(
        self, texts: Sequence[str], normalize: bool | None = None
    ) -> npt.NDArray[np.float32]:
        opts = self._options
        return self.encoder.encode(
            texts,
            pooling=opts.pooling,
            normalize=opts.normalize if normalize is None else normalize,
            max_length=opts.max_length,
        )

    def vectors(self, items: Sequence[Any]) -> npt.NDArray[np.float32]:
        """The vectors of ``items``' texts: from their ids where every one was
        tokenised ahead by this model's plan (``runtimes/tokens.py``)."""
        ids = tokenized_ids(items, self.plan_key) if self.plan_key is not None else None
        if ids is None:
            return self.encode(texts_of(items))
        opts = self._options
        return self.encoder.encode_ids(ids, pooling=opts.pooling, normalize=opts.normalize)

    @property
    def stacks_across_models(self) -> bool:
        """Whether its batches may run in one forward with other models'
        (``runtimes.base.stacks``): as its encoder's path says for the texts
        it takes (tokenised ahead where it has a plan)."""
        encoder = self._encoder
        return encoder is not None and encoder.path.stacks(ids_ahead=self.plan_key is not None)

    def take_ids_ahead(self, spec: ModelSpec) -> None:
        """Take texts tokenised ahead by ``spec``'s plan where its load finds
        them its own (``SentenceEncoder.takes_ids``)."""
        plan = token_plan(spec)
        if plan is None:
            return
        if self.encoder.takes_ids(plan, self.max_length):
            self.plan_key = plan.key
        else:
            log.info("%s tokenises its texts itself: its plan %s differs", spec.key, plan)

    def memory(self) -> Footprint:
        return Footprint(
            own_bytes=self._own_bytes,
            shared_bytes=self._shared_bytes(),
            method=self._method,
        )

    def _shared_bytes(self, *, host: bool = False) -> dict[str, int]:
        """Its encoder's bytes and its encoder's graphs' (shared components;
        ``host``: as it waits in the host tier)."""
        encoder = self._encoder
        graphs = encoder.shared_bytes(host=host) if encoder is not None else {}
        return {self._key: self._shared.bytes_of(self._key), **graphs}

    def offload(self) -> Footprint | None:
        """Leave the device for the host tier: the shared encoder goes too once
        no model on the device holds it. What this model owns beside it (a head)
        stays in process memory."""
        with self._unload_lock:
            encoder = self._encoder
            if encoder is None or self._parked or not self._shared.park(self._key):
                return None
            self._parked = True
        held = encoder.host_method or "held for it while another model uses it on the device"
        return Footprint(
            own_bytes=self._own_bytes,
            shared_bytes=self._shared_bytes(host=True),
            method=f"shared encoder: {held}; the rest in process memory",
        )

    def restore(self) -> None:
        with self._unload_lock:
            if self._encoder is None or not self._parked:
                raise ModelUnavailableError(self._key, "the model is not in the host tier")
            self._shared.unpark(self._key)
            self._parked = False

    def unload(self) -> None:
        with self._unload_lock:
            if self._encoder is None:
                return
            self._encoder = None
            parked, self._parked = self._parked, False
        self._shared.release(self._key, parked=parked)


# --- adapters ------------------------------------------------------------------------


class HfEncoderModel(SharedEncoderModel):
    """Embeddings: one float32 vector per ``TextInput``."""

    def run(self, items: Sequence[Any]) -> list[Any]:
        return list(self.vectors(items))


class BiEncoderRerankModel(SharedEncoderModel):
    """Rerank by the cosine of the query's and the document's embeddings."""

    def run(self, items: Sequence[Any]) -> list[Any]:
        pairs = pairs_of(items)
        # Encode each distinct text once: a rerank batch repeats its query.
        index: dict[str, int] = {}
        for pair in pairs:
            index.setdefault(pair.query, len(index))
            index.setdefault(pair.document, len(index))
        ids = pair_ids(items, self.plan_key) if self.plan_key is not None else None
        if ids is None:
            vectors = self.encode(list(index), normalize=True)
        else:
            pooling = self._options.pooling
            rows = [ids[text] for text in index]
            vectors = self.encoder.encode_ids(rows, pooling=pooling, normalize=True)
        return [float(vectors[index[p.query]] @ vectors[index[p.document]]) for p in pairs]


class _SharedEncoderLoader:
    """Loads a model that is only a view of the shared encoder of a folder."""

    task = Task.EMBEDDING
    model_class: type[SharedEncoderModel] = HfEncoderModel

    def encoder_path(self, spec: ModelSpec) -> Path:
        return spec.option_path("encoder") or spec.resolve_source()

    def estimate_bytes(self, spec: ModelSpec) -> int:
        """The shared encoder's weights (the engine subtracts shared keys already resident)."""
        return hf_weights_bytes(self.encoder_path(spec))

    def shared_keys(self, spec: ModelSpec, device: Device | None = None) -> tuple[str, ...]:
        return (encoder_key(self.encoder_path(spec), torch_device_of(device), spec),)

    def load(self, spec: ModelSpec, ctx: LoadContext) -> SharedEncoderModel:
        expect_task(spec, self.task)
        options = EncoderOptions.from_spec(spec)
        key, encoder = acquire_encoder(ctx, self.encoder_path(spec), spec)
        model = self.model_class(ctx.shared, key, encoder, options)
        model.take_ids_ahead(spec)
        return model


class HfEncoderLoader(_SharedEncoderLoader):
    """Adapter ``hf-encoder``: any Hugging Face encoder folder, pooled (mean|cls),
    optionally L2-normalised. Options: pooling, normalize, max_length."""

    task = Task.EMBEDDING
    model_class = HfEncoderModel

    def encoder_path(self, spec: ModelSpec) -> Path:
        return spec.resolve_source()


class BiEncoderRerankLoader(_SharedEncoderLoader):
    """Adapter ``bi-encoder-rerank``: score = cosine of the embeddings of query and
    document from a shared encoder (option ``encoder``, default the source)."""

    task = Task.RERANK
    model_class = BiEncoderRerankModel


class HfSequenceClassifierModel:
    """A ``*ForSequenceClassification`` model: classify texts or score pairs.

    Held in a ``SentenceEncoder`` for its locked tokenizer; it is not shared.
    """

    def __init__(self, encoder: SentenceEncoder, head: ClassifierHead, max_length: int) -> None:
        self._encoder: SentenceEncoder | None = encoder
        self._head = head
        self._max_length = max_length
        self._bytes = encoder.num_bytes
        self._parked = False  # in the host tier

    def run(self, items: Sequence[Any]) -> list[Any]:
        encoder = self._encoder
        if encoder is None or self._parked:
            raise ModelUnavailableError("hf-sequence-classifier", "the model was unloaded")
        if not items:
            return []
        if self._head.task is Task.RERANK:
            pairs = pairs_of(items)
            queries, documents = [p.query for p in pairs], [p.document for p in pairs]
            batch = encoder.tokenize(queries, self._max_length, documents)
        else:
            batch = encoder.tokenize(texts_of(items), self._max_length)
        return self._head.outputs(encoder.logits(batch))

    def memory(self) -> Footprint:
        encoder = self._encoder
        graphs = encoder.shared_bytes() if encoder is not None else {}
        return Footprint(own_bytes=self._bytes, shared_bytes=graphs, method=_TORCH_METHOD)

    def offload(self) -> Footprint | None:
        encoder = self._encoder
        if encoder is None or self._parked:
            return None
        held = encoder.offload()
        self._parked = held is not None
        if held is None:
            return None
        return replace(held, shared_bytes=encoder.shared_bytes(host=True))

    def restore(self) -> None:
        encoder = self._encoder
        if encoder is None or not self._parked:
            raise ModelUnavailableError("hf-sequence-classifier", "not in the host tier")
        encoder.restore()
        self._parked = False

    def unload(self) -> None:
        encoder, self._encoder = self._encoder, None
        if encoder is not None:
            encoder.close()


class HfSequenceClassifierLoader:
    """Adapter ``hf-sequence-classifier``: ``AutoModelForSequenceClassification``.

    classify: labels from ``config.id2label``, softmax (sigmoid when
    ``problem_type`` is multi-label), option top_k (5). rerank: a cross-encoder
    over (query, document) pairs. Option max_length (512).
    """

    def estimate_bytes(self, spec: ModelSpec) -> int:
        return hf_weights_bytes(spec.resolve_source())

    def shared_keys(self, spec: ModelSpec, device: Device | None = None) -> tuple[str, ...]:
        return ()

    def load(self, spec: ModelSpec, ctx: LoadContext) -> HfSequenceClassifierModel:
        expect_task(spec, Task.CLASSIFY, Task.RERANK)
        path = spec.resolve_source()
        device = ctx.device.torch_device()
        max_length = int_option(spec, "max_length", 512)
        try:
            from transformers import AutoModelForSequenceClassification

            quiet_transformers()
            tokenizer = shared_tokenizer(path)
            model = load_pretrained(AutoModelForSequenceClassification, path)
        except LOAD_ERRORS as e:
            raise ModelUnavailableError(spec.name, f"cannot load classifier {path}: {e}") from e
        head = ClassifierHead.from_config(spec, model.config)
        encoder = SentenceEncoder.on_device(
            model,
            tokenizer,
            device,
            device_options(spec),
            output="logits",
            name=spec.name,
            capture=ctx.warm_up,
            shared=ctx.shared,
        )
        return HfSequenceClassifierModel(encoder, head, max_length)
