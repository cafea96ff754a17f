"""The keys a ``model.yaml`` may give, at every level, and each adapter's
``options``.

A key the card does not know is a ``ConfigError`` that names it and the
known key nearest to it, so that ``max_bach_size`` is not silently the
default batch. ``options`` are read by the model's adapter
(``runtimes/``), so each adapter declares its own here, beside those every
model's card may give (``spec.parse_inputs`` reads them whatever the
adapter); an adapter this table does not know fails at load, by name.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from tessera.errors import ConfigError

CARD_KEYS = frozenset(
    {
        "name",
        "task",
        "runtime",
        "engine",
        "adapter",
        "source",
        "version",
        "batching",
        "memory",
        "options",
        "preload",
        "latency_target_ms",
        "max_inputs",
        "description",
        "licence",
        "version_policy",
        "isolation",
        "mps_active_thread_percentage",
        "threads",
        "smoke",
    }
)
# ``max_batch_tokens`` is ``max_batch_units``' older name, still read.
BATCHING_KEYS = frozenset(
    {
        "max_batch_size",
        "max_batch_units",
        "max_batch_tokens",
        "max_wait_ms",
        "max_concurrent_batches",
    }
)
MEMORY_KEYS = frozenset({"max_bytes"})
SOURCE_KEYS = frozenset({"package", "path"})

# Options any model's card may give, whatever its adapter: what it runs of an
# input (``spec.parse_inputs``), where the tokenizer that counts its work units
# is (``runtimes/tokens.py``), a worker process's time per batch (``isolation:
# process``), and what the gateway reads of a task's models: a translation's
# languages (DeepL's routes), a vision-language page's prompts (``/v1/ocr``).
COMMON_OPTIONS = frozenset(
    {
        "max_length",
        "truncate",
        "max_tokens_limit",
        "max_tokens_default",
        "vision",
        "rapidocr_params",
        "tokenizer",
        "encoder",
        "run_timeout_s",
        "direction",
        "prompts",
    }
)
# A torch model's precision, CUDA graphs and stacked forwards (``runtimes/forward.py``).
_DEVICE = frozenset({"dtype", "cuda_graphs", "stack"})
# A sentence encoder's pooling (``runtimes/hf.py``).
_ENCODER = frozenset({"pooling", "normalize"})

ADAPTER_OPTIONS: Mapping[str, frozenset[str]] = {
    "hf-encoder": _ENCODER | _DEVICE,
    "bi-encoder-rerank": _ENCODER | _DEVICE,
    "hf-sequence-classifier": _DEVICE | {"top_k"},
    "rag-intent": _ENCODER | {"head", "top_k"},
    "encoder-head": _ENCODER | _DEVICE | {"head", "labels", "top_k", "multi_label"},
    "onnx-encoder": _ENCODER | {"output", "run_quantised", "int8_activations"},
    "onnx-sequence-classifier": _ENCODER
    | {"output", "run_quantised", "int8_activations", "labels", "multi_label", "top_k"},
    "rapidocr": frozenset({"det_model", "rec_model", "cls_model", "text_score", "use_cls"}),
    "piper": frozenset({"config"}),
    "bergamot": frozenset(),
    "hf-causal-lm": frozenset({"gguf_file", "dtype", "chat_template", "stop_tokens"}),
    "hf-vision-ocr": frozenset({"dtype"}),
    "external": frozenset({"idle_timeout_s", "load_timeout_s"}),
}
# Options of ``runtime: external`` per engine (``runtimes/llamacpp.py``, ``vllm.py``);
# a card registered over the API may not give the process's (``trust.py``).
ENGINE_OPTIONS: Mapping[str, frozenset[str]] = {
    "llamacpp": frozenset({"gguf_file", "context_tokens", "gpu_layers"}),
    "vllm": frozenset({"model", "command", "args"}),
}


def check_keys(given: Iterable[object], known: Iterable[str], where: str) -> None:
    """``ConfigError`` naming the first key of ``given`` not in ``known``, and
    the known key nearest to it (or every known key, where none is near)."""
    known = sorted(known)
    for key in given:
        if key in known:
            continue
        near = difflib.get_close_matches(str(key), known, n=1)
        hint = f"did you mean {near[0]!r}?" if near else f"known keys: {', '.join(known)}"
        raise ConfigError(f"{where}: unknown key {key!r}; {hint}")


def check_options(options: Mapping[str, Any], adapter: str, engine: str | None, where: str) -> None:
    """``options`` are the adapter's (and its engine's) or every card's."""
    own = ADAPTER_OPTIONS.get(adapter)
    if own is None:
        # An adapter from the server's config (``adapters``) reads its own
        # options; an adapter nobody registered fails at load, by name.
        return
    check_keys(options, COMMON_OPTIONS | own | ENGINE_OPTIONS.get(engine or "", frozenset()), where)
