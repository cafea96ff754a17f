"""How a model runs: torch, onnx and native runtimes behind one interface."""

from tessera.runtimes.base import (
    LoadContext,
    LoadedModel,
    Measured,
    MemoryReport,
    ModelLoader,
    SharedComponents,
)

__all__ = [
    "LoadContext",
    "LoadedModel",
    "Measured",
    "MemoryReport",
    "ModelLoader",
    "SharedComponents",
]
