"""Adapters by name, imported only when a model uses them (torch stays unimported
until a torch model loads).

Beside the built-in ``ADAPTERS``, a server config's ``adapters`` names more:
``{name: "module:Class"}``, a ``ModelLoader`` class the server imports (from
its ``sys.path``: an installed package or ``PYTHONPATH``) when a card names
that adapter. A name of the config's may not shadow a built-in one.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import cast

from tessera.errors import ConfigError
from tessera.runtimes.base import ModelLoader

ADAPTERS: dict[str, str] = {
    "hf-encoder": "tessera.runtimes.hf:HfEncoderLoader",
    "hf-sequence-classifier": "tessera.runtimes.hf:HfSequenceClassifierLoader",
    "bi-encoder-rerank": "tessera.runtimes.hf:BiEncoderRerankLoader",
    "rag-intent": "tessera.runtimes.intent:RagIntentLoader",
    "encoder-head": "tessera.runtimes.heads:EncoderHeadLoader",
    "onnx-encoder": "tessera.runtimes.onnx:OnnxEncoderLoader",
    "onnx-sequence-classifier": "tessera.runtimes.onnx:OnnxSequenceClassifierLoader",
    "rapidocr": "tessera.runtimes.ocr:RapidOcrLoader",
    "piper": "tessera.runtimes.piper:PiperLoader",
    "bergamot": "tessera.runtimes.bergamot:BergamotLoader",
    "hf-causal-lm": "tessera.runtimes.causal_lm:CausalLmLoader",
    "external": "tessera.runtimes.external:ExternalLoader",
    "hf-vision-ocr": "tessera.runtimes.vision_ocr:VisionOcrLoader",
}

# Built-in adapters whose models are head models (``runtimes/heads.py``),
# whose loaders say a card's stage key before it loads.
HEAD_ADAPTERS = frozenset({"encoder-head", "rag-intent"})
# The other built-in adapters, whose modules need not be imported to know
# that their models batch their encoder on their own.
NOT_STAGED = frozenset(ADAPTERS) - HEAD_ADAPTERS


def parse_adapters(raw: object) -> dict[str, str]:
    """A config's ``adapters``: a mapping of new adapter names to ``module:Class``."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"adapters must be a mapping of names to module:Class, not {raw!r}")
    adapters: dict[str, str] = {}
    for name, target in raw.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"adapters: a name must be a non-empty string, not {name!r}")
        if name in ADAPTERS:
            raise ConfigError(f"adapters: {name!r} is a built-in adapter")
        module_name, _, class_name = str(target).partition(":")
        if not isinstance(target, str) or not module_name or not class_name:
            raise ConfigError(f"adapters: {name!r} must name module:Class, not {target!r}")
        adapters[name] = target
    return adapters


def get_loader(adapter: str, extra: Mapping[str, str] | None = None) -> ModelLoader:
    """Instantiate the loader of an adapter by name: a built-in one, or one of
    ``extra`` (a config's ``adapters``)."""
    extra = extra or {}
    target = ADAPTERS.get(adapter) or extra.get(adapter)
    if target is None:
        known = sorted({*ADAPTERS, *extra})
        raise ConfigError(f"unknown adapter {adapter!r}; known: {known}")
    module_name, _, class_name = target.partition(":")
    if adapter in ADAPTERS:
        module = importlib.import_module(module_name)
        return cast(ModelLoader, getattr(module, class_name)())
    try:
        loader = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"adapter {adapter!r}: cannot import {target}: {e}") from e
    return cast(ModelLoader, loader())
