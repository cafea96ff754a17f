"""Wiring of the core request path: batchers, residency and the compute executor."""

from tessera.engine.engine import (
    Caller,
    Engine,
    EngineConfig,
    ModelCounters,
    RequestTrace,
    Submission,
)
from tessera.engine.executor import BatchRun, ComputeExecutor
from tessera.engine.host import EngineHost

__all__ = [
    "BatchRun",
    "Caller",
    "ComputeExecutor",
    "Engine",
    "EngineConfig",
    "EngineHost",
    "ModelCounters",
    "RequestTrace",
    "Submission",
]
