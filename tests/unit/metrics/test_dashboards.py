"""Every metric the Grafana dashboard and the alert rules query is one tessera exports."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from builders import ISSUE_FAMILIES, make_spec
from harness.fake_models import FAKE_ADAPTERS
from tessera.device import CpuDevice, DeviceStats
from tessera.engine import Engine, EngineConfig
from tessera.metrics.prometheus import PrometheusMetrics
from tessera.repository import ModelRepository

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "tessera.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
METRIC = re.compile(r"\btessera_[a-z_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


class GpuLikeDevice(CpuDevice):
    """A CPU that reports what NVML would, so the GPU-only families are exported."""

    def stats(self) -> DeviceStats:
        return DeviceStats(used_bytes=1, total_bytes=2, utilization=0.5, temperature_c=40.0)


@pytest.fixture
async def metrics() -> AsyncIterator[PrometheusMetrics]:
    engine = Engine(
        ModelRepository([make_spec("embed"), make_spec("ocr")]),
        EngineConfig(
            memory_budget_bytes=1 << 20, device="cpu", num_threads=1, adapters=FAKE_ADAPTERS
        ),
        device=GpuLikeDevice(),
    )
    models = engine.model_names()
    yield PrometheusMetrics(engine.snapshot, models, {"embed": 0.2}, per_tenant_labels=True)
    await engine.close()


def exprs(node: Any) -> Iterator[str]:
    """Every ``expr`` string anywhere in a parsed JSON/YAML document."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from exprs(value)
    elif isinstance(node, list):
        for value in node:
            yield from exprs(value)


def queried(document: Any) -> set[str]:
    found = {name for expr in exprs(document) for name in METRIC.findall(expr)}
    assert found, "no tessera_* metric found in any expr"
    return found


def histograms(metrics: PrometheusMetrics) -> set[str]:
    return {f.name for f in metrics.registry.collect() if f.type == "histogram"}


def unexported(names: set[str], metrics: PrometheusMetrics) -> set[str]:
    exported = metrics.family_names()
    missing = set()
    for name in names:
        base = next((name.removesuffix(s) for s in HISTOGRAM_SUFFIXES if name.endswith(s)), name)
        if name in exported or (base in histograms(metrics) and base != name):
            continue
        missing.add(name)
    return missing


def test_the_exporter_has_every_promised_family(metrics: PrometheusMetrics) -> None:
    required = ISSUE_FAMILIES | {"tessera_device_temperature_celsius"}
    assert required - metrics.family_names() == set()


def test_dashboard_queries_only_exported_metrics(metrics: PrometheusMetrics) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names = queried(dashboard)
    assert unexported(names, metrics) == set()
    # The panels the dashboard promises are there.
    assert {"tessera_batch_size_bucket", "tessera_model_resident_bytes"} <= names
    assert dashboard["__inputs"][0]["name"] == "DS_PROMETHEUS"
    uids = {p["datasource"]["uid"] for p in dashboard["panels"] if p.get("type") != "row"}
    assert uids == {"${DS_PROMETHEUS}"}


def test_alert_rules_query_only_exported_metrics(metrics: PrometheusMetrics) -> None:
    alerts = yaml.safe_load(ALERTS.read_text())
    names = queried(alerts)
    assert unexported(names, metrics) == set()
    rules = [rule for group in alerts["groups"] for rule in group["rules"]]
    assert all({"alert", "expr"} <= set(rule) for rule in rules)
    assert {"tessera_slo_target_seconds", "tessera_queue_depth"} <= names
    assert {"tessera_memory_budget_bytes", "tessera_model_evictions_total"} <= names


def test_prometheus_scrapes_tessera() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["localhost:8000"]
    assert job["authorization"]["credentials_file"]
    assert "alerts.yml" in config["rule_files"]


def test_unexported_names_are_caught(metrics: PrometheusMetrics) -> None:
    assert unexported({"tessera_nonexistent_total", "tessera_queue_depth_bucket"}, metrics) == {
        "tessera_nonexistent_total",
        "tessera_queue_depth_bucket",
    }
