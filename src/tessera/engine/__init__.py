"""The engine: plan, execute and report over the policies; one snapshot for readers."""

from tessera.engine.engine import (
    Caller,
    Engine,
    EngineConfig,
    PreloadProgress,
    RequestTrace,
    Submission,
)
from tessera.engine.serving import ServingEngine

__all__ = [
    "Caller",
    "Engine",
    "EngineConfig",
    "PreloadProgress",
    "RequestTrace",
    "ServingEngine",
    "Submission",
]
