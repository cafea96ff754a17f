"""Text models exported to ONNX, run by onnxruntime: encoders and sequence classifiers.

The graph takes ``input_ids`` and ``attention_mask`` (and ``token_type_ids``
where it has that input); the tokenizer is a Hugging Face tokenizer folder
(option ``tokenizer``, default the model file's folder). An encoder's output
is ``last_hidden_state`` (or option ``output``), pooled and normalised as in
the torch adapter; a classifier's output is its logits.

Memory is the process's resident-set growth around creating the session and
one warm-up batch: onnxruntime's own allocations are invisible to torch.

A weight-only int8 graph (int8 initializers dequantised in the graph by a
Cast and a Mul) is served rewritten so that its weights stay int8 in memory
(``runtimes.onnx_quant``: MatMulNBits, int8 embedding gathers), the same
answers in about a quarter of the bytes; option ``run_quantised: false``
serves the graph as it is (onnxruntime then folds the weights to fp32), and
``int8_activations: true`` has the matmuls quantise their inputs too (faster
at batch 1, answers no longer the same).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tessera.errors import InferenceError, ModelUnavailableError, TesseraError
from tessera.footprint import Footprint
from tessera.runtimes.base import LoadContext
from tessera.runtimes.hf import (
    ClassifierHead,
    EncoderOptions,
    expect_task,
    int_option,
    pairs_of,
    texts_of,
)
from tessera.runtimes.onnx_quant import ServedGraph, has_weight_only_int8, served_graph
from tessera.tasks.types import Task

if TYPE_CHECKING:
    import numpy.typing as npt

    from tessera.device import Device
    from tessera.repository.spec import ModelSpec

log = logging.getLogger(__name__)

_METHOD = "rss delta (load + warm-up)"
# Resident bytes per byte of ONNX file after load and a warm-up batch. Weight-only
# int8 exports (int8 initializers -> Cast -> Mul by a scale, as the packaged
# MiniLM) are constant-folded to fp32 when the session is created, unless
# rewritten (runtimes.onnx_quant): the int8 MiniLM's 23 MB file then holds
# ~30 MB resident, ~100 MB as it is.
_ESTIMATE_FACTOR = 4
_INT8_ESTIMATE_FACTOR = 2
_INT_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}
_WARM_UP = ["tessera warm-up"]


def onnx_file(spec: ModelSpec) -> Path:
    """The ``.onnx`` file of the source: the file itself, or ``model.onnx`` (or the
    only ``.onnx``) in a folder."""
    path = spec.resolve_source()
    if path.is_file():
        return path
    if (path / "model.onnx").is_file():
        return path / "model.onnx"
    found = sorted(path.glob("*.onnx"))
    if len(found) != 1:
        raise ModelUnavailableError(spec.name, f"expected one .onnx file in {path}")
    return found[0]


def _measured_bytes(rss_delta: int, file_bytes: int) -> tuple[int, str]:
    # The delta misses pages the file shares with the page cache (mmapped
    # initializers) and reads 0 where /proc is absent: never report below the file.
    if rss_delta < file_bytes:
        return file_bytes, f"weight file size (rss delta {rss_delta} B implausibly small)"
    return rss_delta, _METHOD


def _bool_option(spec: ModelSpec, key: str, default: bool) -> bool:
    value = spec.options.get(key, default)
    if not isinstance(value, bool):
        raise ModelUnavailableError(spec.name, f"option {key} must be true or false")
    return value


def estimate_bytes(spec: ModelSpec) -> int:
    """Bytes after load and warm-up, from the file: about twice its size for a
    graph whose int8 weights stay int8, four times otherwise."""
    path = onnx_file(spec)
    rewritten = _bool_option(spec, "run_quantised", True) and has_weight_only_int8(path)
    return (_INT8_ESTIMATE_FACTOR if rewritten else _ESTIMATE_FACTOR) * path.stat().st_size


def _load_tokenizer(spec: ModelSpec, model_path: Path) -> Any:
    folder = spec.option_path("tokenizer") or model_path.parent
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise ModelUnavailableError(spec.name, f"cannot load tokenizer {folder}: {e}") from e


class OnnxTextRunner:
    """An onnxruntime session and its tokenizer: texts (or pairs) in, one output array out.

    Thread-safe: ``InferenceSession.run`` is, and tokenization is serialised
    (a fast tokenizer's padding/truncation settings are mutable state).
    """

    def __init__(self, session: Any, tokenizer: Any, output: str, max_length: int) -> None:
        self.session: Any = session
        self.tokenizer: Any = tokenizer
        self.output = output
        self.max_length = max_length
        self.inputs = {i.name: _INT_TYPES.get(i.type, np.int64) for i in session.get_inputs()}
        self._lock = threading.Lock()

    def run(self, texts: list[str], pairs: list[str] | None = None) -> tuple[Any, Any]:
        """(output, attention mask) for a batch."""
        with self._lock:
            encoded = self.tokenizer(
                texts,
                pairs,
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="np",
            )
        mask = encoded["attention_mask"]
        feed: dict[str, Any] = {}
        for name, dtype in self.inputs.items():
            if name in encoded:
                feed[name] = encoded[name].astype(dtype, copy=False)
            elif name == "token_type_ids":
                feed[name] = np.zeros_like(mask, dtype=dtype)
            else:
                raise InferenceError(f"the ONNX graph wants input {name!r}; no tokenizer gives it")
        (output,) = self.session.run([self.output], feed)
        return output, mask

    def close(self) -> None:
        self.session = None
        self.tokenizer = None


def _make_runner(spec: ModelSpec, ctx: LoadContext, default_output: str) -> tuple[Any, int, str]:
    """Create the session under ``ctx.measure`` with a warm-up batch: (runner, bytes, method)."""
    model_path = onnx_file(spec)
    tokenizer = _load_tokenizer(spec, model_path)
    limit = int_option(spec, "max_length", 256 if spec.task is Task.EMBEDDING else 512)
    if 0 < getattr(tokenizer, "model_max_length", 0) < 100_000:
        limit = min(limit, int(tokenizer.model_max_length))

    # Imported before the measurement: the library's own pages are not this model's.
    import onnxruntime as ort

    # Rewritten (or read from the cache) before the measurement too; a rewrite
    # made now is held as bytes until the measurement ends, so that freeing
    # them does not shrink the delta.
    served = ServedGraph(str(model_path), "original graph")
    method_note = ""
    if _bool_option(spec, "run_quantised", True):
        level = 4 if _bool_option(spec, "int8_activations", False) else 0
        served = served_graph(model_path, ctx.cache_dir, spec.name, level)

    def build() -> OnnxTextRunner:
        options = ort.SessionOptions()
        options.intra_op_num_threads = ctx.threads
        options.inter_op_num_threads = 1
        # Idle intra-op threads spin by default, stealing cores from the other
        # models' batches; a short wake-up costs less than that here.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ctx.device.onnx_providers(spec.max_bytes)
        try:
            session = ort.InferenceSession(served.model, options, providers=providers)
        except Exception as e:  # the rewrite onnxruntime cannot run: the graph as it is
            if served.model == str(model_path):
                raise
            log.warning("%s: cannot run its int8 rewrite (%s); loading it as it is", spec.name, e)
            nonlocal method_note
            method_note = "original graph (rewrite rejected)"
            session = ort.InferenceSession(str(model_path), options, providers=providers)
        outputs = [o.name for o in session.get_outputs()]
        output = spec.options.get("output")
        if output is None:
            output = default_output if default_output in outputs else outputs[0]
        if output not in outputs:
            raise ModelUnavailableError(spec.name, f"no output {output!r}; has {outputs}")
        runner = OnnxTextRunner(session, tokenizer, str(output), limit)
        if not ctx.warm_up:
            return runner
        if spec.task is Task.RERANK:
            runner.run(_WARM_UP, _WARM_UP)
        else:
            runner.run(_WARM_UP)
        return runner

    try:
        measured = ctx.measure(build)
    except TesseraError:
        raise
    except Exception as e:  # onnxruntime's errors (InvalidProtobuf, Fail...) derive from Exception
        raise ModelUnavailableError(spec.name, f"cannot load {model_path}: {e}") from e
    own_bytes, method = _measured_bytes(measured.rss_delta_bytes, model_path.stat().st_size)
    method_note = method_note or served.how
    if method_note != "original graph":
        method = f"{method}; {method_note}"
    return measured.value, own_bytes, method


class OnnxTextModel:
    """A loaded ONNX text model; ``head`` maps its output to task outputs."""

    def __init__(self, runner: OnnxTextRunner, own_bytes: int, method: str) -> None:
        self._runner: OnnxTextRunner | None = runner
        self._own_bytes = own_bytes
        self._method = method

    @property
    def runner(self) -> OnnxTextRunner:
        runner = self._runner
        if runner is None:
            raise ModelUnavailableError("onnx", "the model was unloaded")
        return runner

    def memory(self) -> Footprint:
        return Footprint(own_bytes=self._own_bytes, method=self._method)

    def unload(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.close()


def pool(
    hidden: npt.NDArray[Any], mask: npt.NDArray[Any], options: EncoderOptions
) -> npt.NDArray[np.float32]:
    """Token vectors (batch, seq, dim) to one vector per text; a 2-D output is
    taken as already pooled."""
    if hidden.ndim == 3:
        if options.pooling == "cls":
            hidden = hidden[:, 0]
        else:
            weights = mask[..., None].astype(np.float32)
            hidden = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
    vectors = hidden.astype(np.float32, copy=False)
    if options.normalize:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.maximum(norms, 1e-12)
    return vectors


class OnnxEncoderModel(OnnxTextModel):
    def __init__(
        self, runner: OnnxTextRunner, options: EncoderOptions, own_bytes: int, method: str
    ) -> None:
        super().__init__(runner, own_bytes, method)
        self._options = options

    def run(self, items: Sequence[Any]) -> list[Any]:
        texts = texts_of(items)
        if not texts:
            return []
        hidden, mask = self.runner.run(texts)
        return list(pool(hidden, mask, self._options))


class OnnxEncoderLoader:
    """Adapter ``onnx-encoder``: an ONNX encoder, pooled (mean|cls) and optionally
    normalised. Options: tokenizer (path), output, pooling, normalize, max_length,
    run_quantised, int8_activations."""

    def estimate_bytes(self, spec: ModelSpec) -> int:
        return estimate_bytes(spec)

    def shared_keys(self, spec: ModelSpec, device: Device | None = None) -> tuple[str, ...]:
        return ()

    def load(self, spec: ModelSpec, ctx: LoadContext) -> OnnxEncoderModel:
        expect_task(spec, Task.EMBEDDING)
        options = EncoderOptions.from_spec(spec)
        runner, own_bytes, method = _make_runner(spec, ctx, "last_hidden_state")
        return OnnxEncoderModel(runner, options, own_bytes, method)


class OnnxSequenceClassifierModel(OnnxTextModel):
    def __init__(
        self, runner: OnnxTextRunner, head: ClassifierHead, own_bytes: int, method: str
    ) -> None:
        super().__init__(runner, own_bytes, method)
        self._head = head

    def run(self, items: Sequence[Any]) -> list[Any]:
        if not items:
            return []
        if self._head.task is Task.RERANK:
            pairs = pairs_of(items)
            logits, _ = self.runner.run([p.query for p in pairs], [p.document for p in pairs])
        else:
            logits, _ = self.runner.run(texts_of(items))
        return self._head.outputs(np.asarray(logits))


def _classifier_head(spec: ModelSpec, model_path: Path) -> ClassifierHead:
    """Labels from option ``labels``, else a ``config.json`` beside the model."""
    labels = spec.options.get("labels")
    if labels is not None:
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            raise ModelUnavailableError(spec.name, "option labels must be a list of strings")
        config: dict[str, Any] = {"id2label": dict(enumerate(labels)), "num_labels": len(labels)}
        if spec.options.get("multi_label"):
            config["problem_type"] = "multi_label_classification"
        return ClassifierHead.from_config(spec, config)
    config_path = model_path.parent / "config.json"
    if config_path.is_file():
        try:
            return ClassifierHead.from_config(spec, json.loads(config_path.read_text()))
        except (OSError, ValueError) as e:
            raise ModelUnavailableError(spec.name, f"bad {config_path}: {e}") from e
    if spec.task is Task.RERANK:  # a score needs no label names
        return ClassifierHead(spec.task, ("score",))
    raise ModelUnavailableError(spec.name, "needs option labels or a config.json beside the model")


class OnnxSequenceClassifierLoader:
    """Adapter ``onnx-sequence-classifier``: an ONNX classifier's logits (option
    output, default ``logits``) for classify (option top_k) or cross-encoder rerank;
    options run_quantised and int8_activations as ``onnx-encoder``'s."""

    def estimate_bytes(self, spec: ModelSpec) -> int:
        return estimate_bytes(spec)

    def shared_keys(self, spec: ModelSpec, device: Device | None = None) -> tuple[str, ...]:
        return ()

    def load(self, spec: ModelSpec, ctx: LoadContext) -> OnnxSequenceClassifierModel:
        expect_task(spec, Task.CLASSIFY, Task.RERANK)
        head = _classifier_head(spec, onnx_file(spec))
        runner, own_bytes, method = _make_runner(spec, ctx, "logits")
        (width,) = [o.shape[-1] for o in runner.session.get_outputs() if o.name == runner.output]
        if spec.task is Task.CLASSIFY and isinstance(width, int) and width != len(head.labels):
            runner.close()
            raise ModelUnavailableError(spec.name, f"{len(head.labels)} labels for {width} logits")
        return OnnxSequenceClassifierModel(runner, head, own_bytes, method)
