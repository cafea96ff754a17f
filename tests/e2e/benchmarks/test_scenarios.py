"""``tessera bench --scenario``: real servers, every kind of baseline, one report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml


def run_scenario(tmp_path: Path, scenario: dict[str, Any]) -> tuple[dict[str, Any], Path, str]:
    path = tmp_path / f"{scenario['name']}.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    out = tmp_path / "results"
    command = [sys.executable, "-m", "tessera", "bench", "--scenario", str(path)]
    command += ["--out-dir", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    [result] = out.glob("*.json")
    return json.loads(result.read_text()), result.with_suffix(".md"), done.stderr


def test_sweep_beside_the_raw_model_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    results, markdown, log = run_scenario(
        tmp_path,
        {
            "name": "embed-saturation",
            "about": "a short sweep",
            "models": ["all-minilm-l6-v2"],
            "requests": 40,
            "duration_s": 3,
            "warmup_requests": 8,
            "sweep": [1, 4],
            "tenants": [{"name": "bench", "concurrency": 1}],
            "configurations": ["raw", "tessera", {"name": "nope", "kind": "peer"}],
        },
    )
    raw = results["configurations"]["raw"]["raw"]
    assert raw["main"]["sentences_per_s"] > 0
    steps = results["configurations"]["tessera"]["steps"]
    assert [s["concurrency"] for s in steps] == [1, 4]
    for step in steps:
        assert step["failed"] == 0
        assert 0 < step["ok"] <= 40
        assert step["cpu_s_per_1k_requests"] > 0
        assert step["peak_pss_bytes"] > 0
        assert step["per_tenant"]["bench"]["ok"] == step["ok"]
        assert sum(sum(b.values()) for b in step["batch_size_histogram"].values()) > 0
    assert "unknown peer 'nope'" in results["errors"]["nope"]  # the others still ran
    text = markdown.read_text()
    assert "| tessera / raw at saturation |" in text
    for plot in ("throughput", "latency-cdf", "budget", "batch-sizes"):
        assert (markdown.parent / f"{markdown.stem}-{plot}.png").stat().st_size > 1000
    assert "bench: 40/40 requests done" in log or "requests done" in log


@pytest.mark.bench
@pytest.mark.timeout(600)
def test_dedicated_and_static_partition_beside_shared(tmp_path: Path) -> None:
    models = ["all-minilm-l6-v2", "all-minilm-l6-v2-int8"]
    results, _, _ = run_scenario(
        tmp_path,
        {
            "name": "shared-vs-dedicated",
            "about": "two models three ways",
            "models": models,
            "memory_budget": "300MiB",
            "requests": 30,
            "duration_s": 10,
            "tenants": [{"name": "a", "rate": 20}, {"name": "b", "tier": "vip", "rate": 10}],
            "configurations": ["tessera", "dedicated", "static", "fifo"],
        },
    )
    assert results["errors"] == {}
    shared, dedicated, static = (
        results["configurations"][name]["steps"][0] for name in ("tessera", "dedicated", "static")
    )
    for step in (shared, dedicated, static):
        assert step["failed"] == 0
        assert set(step["per_model"]) <= set(models)
        assert set(step["per_tenant"]) == {"a", "b"}
        assert 0 < step["memory_utilization"] <= 1.0
        costs = step["tenant_costs"]  # every process's ledger, summed
        assert list(costs) == ["a", "b", "unattributed", "all"]
        for tenant in ("a", "b"):
            assert costs[tenant]["within_target"] == step["per_tenant"][tenant]["within_target"]
            assert costs[tenant]["device_s"] > 0
            assert costs[tenant]["byte_s"] > 0
    assert shared["reserved_bytes"] == 300 * 1024**2
    # tessera held the scenario's two models only (about 120 MB), not the default
    # models that a fill at start would have loaded into the budget (about 270 MiB).
    assert max(shared["peak_used_bytes"].values()) < 200 * 2**20
    slices = results["configurations"]["static"]["settings"]["slices_bytes"]
    assert set(slices) == set(models)
    assert static["reserved_bytes"] == sum(slices.values())
    assert static["reserved_bytes"] == pytest.approx(1.1 * dedicated["reserved_bytes"], rel=1e-3)
    assert results["configurations"]["dedicated"]["settings"]["processes"] == 2
    assert static["evictions"] == 0


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(600)
def test_generated_models_under_a_budget_for_one_find_a_capacity_and_count_swaps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hundred-models in small: three generated models, a budget that holds one,
    two rates; tessera primes them, swaps them through its host tier, and the
    report gives its capacity, loads and swap-in times."""
    monkeypatch.setenv("TESSERA_BENCH_MODELS", str(tmp_path / "models"))
    results, markdown, log = run_scenario(
        tmp_path,
        {
            "name": "hundred-models",
            "about": "three generated models",
            "generated_models": {"from": "all-minilm-l6-v2", "count": 3, "prefix": "minilm"},
            "latency_target_ms": 5000,
            "popularity": ["uniform"],
            "rates": [2, 3],
            "requests": 1000,
            "duration_s": 6,
            "prime": True,
            "tenants": [{"name": "a", "rate": 1}, {"name": "b", "rate": 1}],
            "configurations": [{"name": "tessera-1", "kind": "tessera", "memory_budget": "100MiB"}],
        },
    )
    assert results["errors"] == {}
    assert "primed 3 models" in log
    steps = results["configurations"]["tessera-1"]["steps"]
    assert [(s["rate"], s["popularity"]) for s in steps] == [(2, "uniform"), (3, "uniform")]
    for step in steps:
        assert step["failed"] == 0
        assert set(step["per_model"]) <= {"minilm-000", "minilm-001", "minilm-002"}
        assert 0 < step["swaps"]["host_loads"] <= step["swaps"]["loads"]  # copies back
        assert step["swaps"]["host_used_bytes"] > 0
        assert step["swaps"]["from_files_last"]["p50_ms"] > 0
    text = markdown.read_text()
    assert "## Capacity" in text
    assert "| tessera-1 | uniform |" in text
    assert "## Loads" in text
