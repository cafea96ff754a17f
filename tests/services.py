"""The PostgreSQL and Redis servers of the tests: ``harness.stores`` (shared
with the benchmarks)."""

from harness.stores import postgres_schema, postgres_url, redis_prefix, redis_url

__all__ = ["postgres_schema", "postgres_url", "redis_prefix", "redis_url"]
