"""Stats the core emits, and their Prometheus adapter."""

from tessera.metrics.stats import NullSink, RequestEvent, StatsSink

__all__ = ["NullSink", "RequestEvent", "StatsSink"]
