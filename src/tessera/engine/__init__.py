"""The engine: plan, execute and report over the policies; one snapshot for readers."""

from tessera.engine.engine import (
    Caller,
    Engine,
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
    "Submission",
]
