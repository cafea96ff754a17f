"""Figures, bars, Markdown and plots of a benchmark, from made-up records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.driver import Record
from harness.figures import Cost, latency_figures, step_figures
from harness.plots import draw_all
from harness.probes import Sample, histogram_delta, time_average
from harness.report import bars, output_stem, render
from harness.suite import MODEL_DETAIL_LIMIT, without_model_detail

MIB = 1024**2


def records(tenant: str, model: str, latencies_ms: list[float], ok: bool = True) -> list[Record]:
    return [
        Record(tenant, model, i * 0.01, ms / 1000, "200" if ok else "503", ok)
        for i, ms in enumerate(latencies_ms)
    ]


def samples(used: list[int | None], budget: int | None, loads: list[int]) -> list[Sample]:
    return [Sample(float(i), 100 * MIB + i, u, budget, loads[i], 0) for i, u in enumerate(used)]


def step(
    recs: list[Record],
    concurrency: int | None = None,
    used: list[int | None] | None = None,
    reserved: int | None = None,
    loads: list[int] | None = None,
    batches: dict[str, Any] | None = None,
) -> dict[str, Any]:
    used = used or [None, None]
    cost = Cost(2.0, samples(used, reserved, loads or [0] * len(used)), reserved)
    out = step_figures(recs, 10.0, {"m": 100.0, "x": 100.0}, cost)
    out["concurrency"] = concurrency
    out["batch_size_histogram"] = {"m": {"1.0": 2.0, "2.0": 5.0, "+Inf": 0.0}}
    if batches is not None:
        out["batches"] = batches
    return out


def results(name: str, configurations: dict[str, Any]) -> dict[str, Any]:
    return {
        "scenario": {"name": name, "about": "made up"},
        "date": "2026-11-30",
        "machine": {
            "cpu_count": 2,
            "cpu_model": "cpu",
            "memory_bytes": 2 * 1024**3,
            "python": "3.11",
            "versions": {"tessera": "0"},
        },
        "command": "tessera bench --scenario x.yaml",
        "configurations": configurations,
        "errors": {"infinity": "ScenarioError: not installed"},
        "total_s": 1.0,
    }


def served(kind: str, *steps: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": kind,
        "settings": {"command": ["tessera", "serve"], "workers": 2},
        "steps": list(steps),
    }


def test_latency_figures_count_target_and_failures() -> None:
    recs = records("a", "m", [10, 50, 150]) + records("a", "m", [5], ok=False)
    figures = latency_figures(recs, 2.0, {"m": 100.0})
    assert (figures["requests"], figures["ok"], figures["failed"]) == (4, 3, 1)
    assert figures["req_per_s"] == 1.5
    assert figures["within_target"] == 2
    assert figures["within_target_share"] == 0.5
    assert figures["p50_ms"] == 50.0
    assert figures["statuses"] == {"200": 3, "503": 1}


def test_step_figures_cost_memory_and_loads() -> None:
    recs = records("a", "m", [10] * 100)
    figures = step(recs, used=[50 * MIB, 50 * MIB, 100 * MIB], reserved=100 * MIB, loads=[1, 2, 4])
    assert figures["cpu_s_per_1k_requests"] == 20.0
    assert figures["memory_utilization"] == pytest.approx(0.5)  # 50 MiB held 2 s of 2
    assert figures["cold_loads"] == 3
    assert figures["cold_load_share"] == 0.03
    gb_s = 100 * MIB / 1e9 * 10.0 / 0.1
    assert figures["reserved_gb_s_per_1k_within_target"] == pytest.approx(gb_s, rel=1e-3)
    assert figures["per_tenant"]["a"]["requests"] == 100
    assert figures["latencies_ms"]["a"][0] == 10.0


def test_time_average_holds_each_sample_until_the_next() -> None:
    points = [Sample(0.0, 0, 10, 1, 0, 0), Sample(1.0, 0, 30, 1, 0, 0), Sample(4.0, 0, 0, 1, 0, 0)]
    assert time_average(points, lambda s: s.used_bytes) == pytest.approx((10 * 1 + 30 * 3) / 4)
    assert time_average([], lambda s: s.used_bytes) is None


def test_histogram_delta_is_per_bucket_during_the_step() -> None:
    before = {"m": {"1.0": 1.0, "2.0": 1.0, "+Inf": 1.0}}
    after = {"m": {"1.0": 3.0, "2.0": 6.0, "+Inf": 6.0}, "idle": {"1.0": 0.0, "+Inf": 0.0}}
    assert histogram_delta(before, after) == {"m": {"1.0": 2.0, "2.0": 3.0, "+Inf": 0.0}}


def saturation() -> dict[str, Any]:
    fast, slow = records("b", "m", [20] * 50), records("b", "m", [40] * 50)
    return results(
        "embed-saturation",
        {
            "raw": {"kind": "raw", "raw": {"main": {"sentences_per_s": 5.0}, "command": "raw"}},
            "tessera": served("tessera", step(fast, 1), step(fast, 32)),
            "pytriton": served("peer", step(slow, 1), step(slow, 32)),
        },
    )


def test_embed_saturation_bars() -> None:
    verdicts = {figure: (measured, verdict) for figure, measured, _, verdict in bars(saturation())}
    assert verdicts["tessera / raw at saturation"][1] == "PASS"  # 5.0 vs 5.0
    assert verdicts["tessera / best peer at c=32"] == ("1.00 (5 vs pytriton 5 req/s)", "MISS")
    assert verdicts["p99 at c=32, tessera vs best peer"] == ("20.0 vs 40.0 ms", "PASS")


def test_mixed_zipf_and_shared_vs_dedicated_bars() -> None:
    recs = records("a", "m", [10] * 100)
    ours = step(recs, used=[80 * MIB, 80 * MIB], reserved=100 * MIB, loads=[0, 2])
    theirs = step(recs, used=[100 * MIB, 100 * MIB], reserved=400 * MIB)
    configurations = {"tessera": served("tessera", ours), "dedicated": served("dedicated", theirs)}
    mixed = {f: (m, v) for f, m, _, v in bars(results("mixed-zipf", configurations))}
    assert mixed["memory utilization (tessera)"] == ("80.0% (beside: dedicated 25.0%)", "PASS")
    assert mixed["cold loads / requests (tessera)"][1] == "PASS"
    cost = {f: (m, v) for f, m, _, v in bars(results("shared-vs-dedicated", configurations))}
    assert cost["GB-s reserved per 1k in target, tessera / dedicated"][1] == "PASS"  # 0.25
    assert cost["share within target, tessera vs dedicated"][1] == "PASS"


def test_noisy_neighbor_bars() -> None:
    quiet = lambda ms: records("quiet", "m", [ms] * 20)  # noqa: E731
    flood = records("flood", "m", [300] * 40)
    batches = {"u": {"models": [{"name": "m", "run_s_p99": 0.05}]}}
    configurations = {
        "alone": served("tessera", step(quiet(30))),
        "fifo": served("fifo", step(quiet(400) + flood)),
        "fair": served("tessera", step(quiet(80) + flood, batches=batches)),
        "vip": served("tessera", step(quiet(70) + flood)),
    }
    verdicts = {f: (m, v) for f, m, _, v in bars(results("noisy-neighbor", configurations))}
    assert verdicts["S, B, F, V, D (ms)"][0] == "30, 400, 80, 70, 50"
    assert verdicts["F / B"] == ("0.20", "PASS")
    assert verdicts["F vs S + 2D"] == ("80 vs 130", "PASS")
    assert verdicts["V / S"][1] == "PASS"
    assert verdicts["flooder throughput, vip / fair"] == ("1.00", "PASS")


def test_render_and_plots(tmp_path: Path) -> None:
    data = saturation()
    recs = records("b", "m", [10] * 20)
    data["configurations"]["tessera"]["steps"].append(
        step(recs, 64, used=[10 * MIB, 20 * MIB], reserved=30 * MIB)
    )
    plots = draw_all(data, tmp_path / "embed-saturation-2026-11-30")
    assert {p.name.rsplit("-", 1)[-1] for p in plots} >= {"throughput.png", "sizes.png", "cdf.png"}
    assert all(p.stat().st_size > 1000 for p in plots)
    markdown = render(data, plots)
    assert "| tessera / raw at saturation |" in markdown
    assert "`tessera serve`" in markdown
    assert "infinity: ScenarioError: not installed" in markdown
    assert "![embed-saturation-2026-11-30-throughput]" in markdown


def test_output_stem_never_overwrites(tmp_path: Path) -> None:
    first = output_stem(tmp_path, "2026-11-30", "x")
    first.with_suffix(".json").write_text("{}")
    assert output_stem(tmp_path, "2026-11-30", "x").name == "x-2026-11-30-2"


def test_a_group_of_tenants_is_pooled_and_reported_as_one_row(tmp_path: Path) -> None:
    recs = (
        records("user-1", "m", [10, 20])
        + records("user-2", "m", [30, 90])
        + records("flood", "m", [50] * 4)
    )
    cost = Cost(2.0, samples([None, None], None, [0, 0]), None)
    groups = {"user-1": "user", "user-2": "user"}
    figures = step_figures(recs, 10.0, {"m": 100.0}, cost, groups)
    group = figures["per_group"]["user"]
    assert (group["requests"], group["tenants"], group["members"]) == (4, 2, ["user-1", "user-2"])
    assert group["worst_p99_ms"] == 90.0
    assert group["p50_ms"] == 30.0  # of the four pooled: 10, 20, 30, 90
    assert sorted(figures["latencies_ms"]) == ["flood", "user"]  # a group is one line
    assert figures["latencies_ms"]["user"] == [10.0, 20.0, 30.0, 90.0]
    figures["concurrency"] = None
    figures["batch_size_histogram"] = {}
    markdown = render(results("many-tenants", {"fair": served("tessera", figures)}), [])
    assert "| fair | - | user (2 tenants; worst p99 90.0) | 4 |" in markdown
    assert "| user-1 |" not in markdown
    assert "| fair | - | flood | 4 |" in markdown


def rate_step(
    rate: float, latencies_ms: list[float], popularity: str = "uniform"
) -> dict[str, Any]:
    out = step(records("a", "m", latencies_ms), used=[MIB, MIB], reserved=2 * MIB)
    out.update(rate=rate, popularity=popularity, concurrency=None)
    out["swaps"] = {"loads": 3, "load": {"p50_ms": 210.0, "p99_ms": 400.0}}
    return out


def test_capacity_is_the_highest_rate_within_target_beside_the_least_memory(
    tmp_path: Path,
) -> None:
    fast, slow = [50.0] * 20, [50.0] * 18 + [500.0] * 2  # 100% and 90% within 100 ms
    ours = served("tessera", rate_step(5, fast), rate_step(10, fast), rate_step(15, slow))
    theirs = served("peer", rate_step(5, slow))
    for s in ours["steps"]:
        s["peak_pss_bytes"] = 300 * MIB
    theirs["steps"][0]["peak_pss_bytes"] = 100 * MIB
    made = results("hundred-models", {"tessera-20": ours, "ray-1x20": theirs})
    made["scenario"]["popularities"] = [None, 1.1]
    text = render(made, [])
    assert "| tessera-20 | uniform | 10 | 2.0 | 100.0% |" in text
    assert "| ray-1x20 | uniform | below the lowest |" in text
    assert "| 300 | 3.00 |" in text
    assert "| tessera-20 | 15/s uniform | 3 | - | 210.0 | 400.0 |" in text
    assert "| tessera-20 | 5/s uniform | m |" in text  # a few models: a row each
    made["scenario"]["models"] = [f"m-{i}" for i in range(100)]
    assert "100 models: their figures are in the JSON." in render(made, [])


def test_batches_through_a_shared_encoder_are_counted_and_reported() -> None:
    from harness.runner import encoder_figures

    before = {"s": {"encoder_batches_total": 10, "encoder_rows_total": 30}}
    after = {"s": {"encoder_batches_total": 20, "encoder_rows_total": 70}}
    figures = encoder_figures(before, after)
    assert figures == {"batches": 10, "rows": 40, "rows_per_batch": 4.0}
    assert encoder_figures({}, {"old": {}})["rows_per_batch"] is None  # a server without them

    across, alone = step(records("b", "m", [10] * 20), 8), step(records("b", "m", [10] * 20), 8)
    across["encoder_batches"] = figures
    alone["encoder_batches"] = encoder_figures({}, {"s": {}})
    data = results("thousand-heads", {"across": served("tessera", across)})
    data["configurations"]["alone"] = served("tessera", alone)
    markdown = render(data, [])
    assert "## Encoder batches" in markdown
    assert "| across | 8 | 10 | 40 | 4.00 |" in markdown
    assert "| alone |" not in markdown.split("## Encoder batches")[1].split("##")[0]


def capacity_step(
    rate: float,
    share: float,
    popularity: str = "uniform",
    pss: int = 0,
    swap_ms: float | None = None,
    host: int = 0,
) -> dict[str, Any]:
    return {
        "rate": rate,
        "popularity": popularity,
        "failed": 0,
        "within_target_share": share,
        "peak_pss_bytes": pss,
        "swaps": {"from_host_last": {"p50_ms": swap_ms}, "host_used_bytes": host},
    }


def sweep(kind: str, *steps: dict[str, Any]) -> dict[str, Any]:
    return {"kind": kind, "steps": list(steps)}


def test_thousand_heads_bars_compare_capacities_at_p99() -> None:
    data = results(
        "thousand-heads",
        {
            # 0.98 within target misses at a 0.99 share: capacity 200, not 400
            "tessera-across-models": sweep(
                "tessera",
                capacity_step(100, 1.0),
                capacity_step(200, 0.995),
                capacity_step(400, 0.98),
            ),
            "tessera-one-head": sweep("tessera", capacity_step(200, 1.0), capacity_step(400, 0.9)),
            "ray-whole-models": sweep("peer", capacity_step(25, 0.5)),
            "ray-expert": sweep("peer", capacity_step(100, 1.0), capacity_step(200, 0.95)),
        },
    )
    data["scenario"].update(rates=[25, 50, 100, 200, 400], capacity_share=0.99)
    verdicts = {f: (m, v) for f, m, _, v in bars(data)}
    assert verdicts["capacity, across models / one head"] == ("1.00 (200 vs 200 req/s)", "PASS")
    assert verdicts["capacity, across models / Ray Serve whole models"] == (
        "> 8.00 (200 vs under 25 req/s)",
        "PASS",
    )
    assert verdicts["capacity, across models / Ray Serve expert"] == (
        "2.00 (200 vs 100 req/s)",
        "PASS",
    )
    assert verdicts["capacity, across models / per model"][0] == "-"  # not run


def test_hundred_models_bars_compare_at_the_same_memory() -> None:
    gib = 1024**3
    zipf = "zipf 1.1"
    data = results(
        "hundred-models",
        {
            # Its PSS alone is under Ray Serve's, not with its host tier's 5 GiB.
            "tessera-20": sweep(
                "tessera",
                capacity_step(10, 1.0, pss=gib, swap_ms=4.0, host=5 * gib),
                capacity_step(25, 0.97, pss=gib, swap_ms=12.0),
                capacity_step(50, 0.5, pss=gib, swap_ms=90.0),  # past capacity: not counted
                capacity_step(10, 1.0, zipf, pss=gib),
            ),
            "tessera-20-no-host-tier": sweep(
                "tessera", capacity_step(10, 1.0, pss=2 * gib), capacity_step(15, 0.5, pss=2 * gib)
            ),
            "ray-1x20": sweep("peer", capacity_step(5, 1.0, pss=2 * gib), capacity_step(10, 0.2)),
            "ray-2x10": sweep("peer", capacity_step(5, 0.9, pss=gib)),
        },
    )
    verdicts = {f: (m, v) for f, m, _, v in bars(data)}
    assert verdicts["uniform: capacity, tessera-20 / ray-1x20"] == ("5.00 (25 vs 5 req/s)", "PASS")
    assert verdicts["uniform: capacity at the same memory, tessera-20-no-host-tier / ray-1x20"] == (
        "2.00 (10 vs 5 req/s)",
        "PASS",
    )
    assert verdicts["swap-in from the host tier, p50 (worst step held, ms)"] == ("12.0", "MISS")
    assert not any(f.startswith(zipf) for f in verdicts)  # no Ray Serve run under Zipf


def test_results_of_many_models_are_written_without_their_figures_per_model() -> None:
    def with_models(count: int) -> dict[str, Any]:
        step = {"rate": 5, "req_per_s": 5.0, "per_model": {"m": {}}, "batches": {"u": {}}}
        data = results("s", {"tessera": sweep("tessera", step)})
        data["scenario"]["models"] = [f"m{i}" for i in range(count)]
        return data

    few = with_models(MODEL_DETAIL_LIMIT)
    assert without_model_detail(few) is few
    many = with_models(MODEL_DETAIL_LIMIT + 1)
    written = without_model_detail(many)
    assert written["configurations"]["tessera"]["steps"] == [{"rate": 5, "req_per_s": 5.0}]
    assert "per_model" in many["configurations"]["tessera"]["steps"][0]  # the report's, kept
