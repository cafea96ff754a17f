"""Each tenant's device-seconds and memory byte-seconds, as Prometheus counters."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from builders import make_spec
from tessera.engine import Engine, EngineConfig
from tessera.metrics.prometheus import PrometheusMetrics
from tessera.metrics.stats import EngineStats, TenantCost
from tessera.repository import ModelRepository


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    engine = Engine(
        ModelRepository([make_spec("embed")]),
        EngineConfig(memory_budget_bytes=1 << 20, device="cpu", num_threads=1),
    )
    yield engine
    await engine.close()


def samples(metrics: PrometheusMetrics, name: str) -> dict[tuple[str, str], float]:
    text = generate_latest(metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return {
                (s.labels["tenant"], s.labels["model"]): s.value
                for s in family.samples
                if s.name == name + "_total"
            }
    raise AssertionError(f"{name} not exported")


def test_costs_per_tenant_and_model_with_bounded_labels(engine: Engine) -> None:
    costs = (
        TenantCost("a", "embed", 1.5, 3e9),
        TenantCost("b", "embed", 0.5, 1e9),
        TenantCost("c", "embed", 0.25, 2e9),
        TenantCost("", "embed", 0.0, 4e9),
    )

    def snapshot() -> EngineStats:
        return dataclasses.replace(engine.snapshot(), tenant_costs=costs)

    metrics = PrometheusMetrics(snapshot, ["embed"], {}, max_tenant_labels=2)
    device = samples(metrics, "tessera_tenant_device_seconds")
    memory = samples(metrics, "tessera_tenant_memory_byte_seconds")
    assert device == {
        ("a", "embed"): 1.5,
        ("b", "embed"): 0.5,
        ("other", "embed"): 0.25,
        ("unattributed", "embed"): 0.0,
    }
    assert memory[("unattributed", "embed")] == 4e9
    assert memory[("other", "embed")] == 2e9
    assert sum(memory.values()) == 1e10


def test_no_costs_yet_exports_the_families_empty(engine: Engine) -> None:
    metrics = PrometheusMetrics(engine.snapshot, ["embed"], {})
    assert samples(metrics, "tessera_tenant_device_seconds") == {}
