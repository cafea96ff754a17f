"""How a model runs: torch, onnx and native runtimes behind one interface."""

from tessera.footprint import Footprint
from tessera.runtimes.base import (
    LoadContext,
    LoadedModel,
    ModelLoader,
    SharedComponents,
)
from tessera.runtimes.memory import Measured

__all__ = [
    "Footprint",
    "LoadContext",
    "LoadedModel",
    "Measured",
    "ModelLoader",
    "SharedComponents",
]
