"""Stats the core emits, and their Prometheus adapter."""

from tessera.metrics.stats import (
    EngineStats,
    FanoutSink,
    ModelStats,
    NullSink,
    RequestEvent,
    RolloutCount,
    RolloutStats,
    StatsSink,
    TenantCost,
)

__all__ = [
    "EngineStats",
    "FanoutSink",
    "ModelStats",
    "NullSink",
    "RequestEvent",
    "RolloutCount",
    "RolloutStats",
    "StatsSink",
    "TenantCost",
]
