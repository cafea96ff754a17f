"""Wiring of the core request path: batchers, residency and the compute executor."""

from tessera.engine.engine import Engine, EngineConfig, ModelCounters
from tessera.engine.executor import BatchRun, ComputeExecutor
from tessera.engine.host import EngineHost

__all__ = ["BatchRun", "ComputeExecutor", "Engine", "EngineConfig", "EngineHost", "ModelCounters"]
