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
