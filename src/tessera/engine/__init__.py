"""The engine: plan, execute and report over the policies; one snapshot for readers."""

from tessera.engine.engine import Engine
from tessera.engine.serving import ServingEngine
from tessera.engine.types import (
    Caller,
    EngineConfig,
    PreloadProgress,
    RequestTrace,
    Submission,
)

__all__ = [
    "Caller",
    "Engine",
    "EngineConfig",
    "PreloadProgress",
    "RequestTrace",
    "ServingEngine",
    "Submission",
]
