"""Adapters by name, imported only when a model uses them (torch stays unimported
until a torch model loads)."""

from __future__ import annotations

import importlib
from typing import cast

from tessera.errors import ConfigError
from tessera.runtimes.base import ModelLoader

ADAPTERS: dict[str, str] = {
    "hf-encoder": "tessera.runtimes.hf:HfEncoderLoader",
    "hf-sequence-classifier": "tessera.runtimes.hf:HfSequenceClassifierLoader",
    "bi-encoder-rerank": "tessera.runtimes.hf:BiEncoderRerankLoader",
    "rag-intent": "tessera.runtimes.intent:RagIntentLoader",
    "onnx-encoder": "tessera.runtimes.onnx:OnnxEncoderLoader",
    "onnx-sequence-classifier": "tessera.runtimes.onnx:OnnxSequenceClassifierLoader",
    "rapidocr": "tessera.runtimes.ocr:RapidOcrLoader",
    "piper": "tessera.runtimes.piper:PiperLoader",
    "bergamot": "tessera.runtimes.bergamot:BergamotLoader",
    "hf-causal-lm": "tessera.runtimes.causal_lm:CausalLmLoader",
    "external": "tessera.runtimes.external:ExternalLoader",
    "hf-vision-ocr": "tessera.runtimes.vision_ocr:VisionOcrLoader",
    "fake": "tessera.runtimes.fake:FakeLoader",
}


def get_loader(adapter: str) -> ModelLoader:
    """Instantiate the loader of an adapter by name."""
    try:
        target = ADAPTERS[adapter]
    except KeyError as e:
        raise ConfigError(f"unknown adapter {adapter!r}; known: {sorted(ADAPTERS)}") from e
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name)
    return cast(ModelLoader, getattr(module, class_name)())
