"""Each tenant's cost in a step, from made-up cost counters."""

from __future__ import annotations

from typing import Any

import pytest

from harness.costs import parse_costs, spent, tenant_costs
from harness.report import render

GB = 1e9

METRICS = """\
# HELP tessera_tenant_device_seconds A tenant's share of the device time.
# TYPE tessera_tenant_device_seconds counter
tessera_tenant_device_seconds_total{model="m",tenant="app"} 2.5
tessera_tenant_device_seconds_total{model="x",tenant="app"} 0.5
tessera_tenant_device_seconds_total{model="m",tenant="partner"} 1.0
# HELP tessera_tenant_memory_byte_seconds Byte-seconds of a model's memory.
# TYPE tessera_tenant_memory_byte_seconds counter
tessera_tenant_memory_byte_seconds_total{model="m",tenant="app"} 3e9
tessera_tenant_memory_byte_seconds_total{model="x",tenant="app"} 1e9
tessera_tenant_memory_byte_seconds_total{model="x",tenant="unattributed"} 5e8
# HELP tessera_batch_duration_seconds A batch's run.
# TYPE tessera_batch_duration_seconds histogram
tessera_batch_duration_seconds_sum{model="m"} 99.0
"""


def test_the_counters_are_summed_over_models_and_nothing_else_is_read() -> None:
    assert parse_costs(METRICS) == {
        "app": (3.0, 4e9),
        "partner": (1.0, 0.0),
        "unattributed": (0.0, 5e8),
    }


def test_a_step_spent_the_difference_summed_over_every_process() -> None:
    before = [{"app": (1.0, 1e9)}, {"app": (0.5, 0.0), "unattributed": (0.0, 2e9)}]
    after = [
        {"app": (3.0, 4e9), "partner": (1.0, 1e9)},  # partner's first request in the step
        {"app": (1.5, 2e9), "unattributed": (0.0, 3e9)},
    ]
    got = spent(before, after)
    assert got["app"] == pytest.approx((3.0, 5e9))
    assert got["partner"] == pytest.approx((1.0, 1e9))
    assert got["unattributed"] == pytest.approx((0.0, 1e9))
    with pytest.raises(ValueError, match="same servers"):
        spent(before, after[:1])


def test_per_thousand_within_target_with_memory_held_unused_and_everything() -> None:
    costs = {"app": (10.0, 20e9), "partner": (2.0, 4e9), "unattributed": (0.0, 6e9)}
    rows = tenant_costs(costs, {"app": 500, "partner": 250})
    assert list(rows) == ["app", "partner", "unattributed", "all"]
    assert rows["app"]["within_target"] == 500
    assert rows["app"]["device_s_per_1k_within_target"] == 20.0
    assert rows["app"]["gb_s_per_1k_within_target"] == 40.0
    assert rows["partner"]["device_s_per_1k_within_target"] == 8.0
    assert rows["partner"]["gb_s_per_1k_within_target"] == 16.0
    # Memory no tenant used, over every tenant's requests within target.
    assert rows["unattributed"]["within_target"] == 750
    assert rows["unattributed"]["gb_s_per_1k_within_target"] == 8.0
    assert rows["unattributed"]["device_s"] == 0.0
    assert rows["all"]["device_s_per_1k_within_target"] == 16.0
    assert rows["all"]["gb_s_per_1k_within_target"] == 40.0


def test_a_tenant_none_within_target_costs_but_has_no_rate() -> None:
    rows = tenant_costs({"app": (1.0, 1e9)}, {"app": 0, "partner": 0})
    assert rows["app"]["device_s"] == 1.0
    assert rows["app"]["device_s_per_1k_within_target"] is None
    assert rows["partner"]["device_s"] == 0.0
    assert rows["all"]["gb_s_per_1k_within_target"] is None


def test_a_group_is_pooled_and_tenants_past_the_labels_go_to_other() -> None:
    costs = {
        "user-1": (1.0, 1e9),
        "user-2": (3.0, 1e9),
        "flood": (6.0, 2e9),
        "other": (2.0, 1e9),  # user-3 and user-4, past the server's labels
    }
    within = {"user-1": 100, "user-2": 100, "user-3": 100, "user-4": 100, "flood": 50}
    groups = {f"user-{i}": "user" for i in range(1, 5)}
    rows = tenant_costs(costs, within, groups)
    assert list(rows) == ["flood", "user", "other", "unattributed", "all"]
    assert rows["user"]["within_target"] == 200  # the named members only
    assert rows["user"]["device_s_per_1k_within_target"] == 20.0
    assert rows["other"]["within_target"] == 200
    assert rows["other"]["device_s_per_1k_within_target"] == 10.0
    assert rows["flood"]["gb_s_per_1k_within_target"] == 40.0
    assert rows["all"]["within_target"] == 450


def step_with(costs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    zero = {"p50_ms": 1.0, "p95_ms": 1.0, "p99_ms": 1.0, "within_target_share": 1.0}
    per_tenant = {
        t: {"requests": 1, "failed": 0, "req_per_s": 1.0, **zero}
        for t in costs
        if t not in ("unattributed", "all")
    }
    return {
        "concurrency": None, "req_per_s": 1.0, "failed": 0, "cpu_s_per_1k_requests": 1.0,
        "peak_pss_bytes": None, "reserved_bytes": None, "memory_utilization": None,
        "cold_loads": None, "per_tenant": per_tenant, "per_group": {}, "per_model": {},
        "tenant_costs": costs, **zero,
    }  # fmt: skip


def test_the_report_sets_each_configuration_side_by_side_per_tenant() -> None:
    shared = tenant_costs(
        {"app": (10.0, 20e9), "partner": (5.0, 10e9), "unattributed": (0.0, 0.0)},
        {"app": 500, "partner": 500},
    )
    dedicated = tenant_costs(
        {"app": (15.0, 60e9), "partner": (9.0, 30e9), "unattributed": (0.0, 10e9)},
        {"app": 400, "partner": 500},
    )
    peer = step_with({})
    del peer["tenant_costs"]  # a peer keeps no cost ledger
    results = {
        "scenario": {"name": "shared-vs-dedicated", "about": "made up"},
        "date": "2026-12-06",
        "machine": {"cpu_count": 2, "cpu_model": "cpu", "memory_bytes": 2 * 1024**3,
                    "python": "3.11", "versions": {}},
        "command": "tessera bench",
        "configurations": {
            "tessera": {"kind": "tessera", "steps": [step_with(shared)]},
            "dedicated": {"kind": "dedicated", "steps": [step_with(dedicated)]},
            "peer": {"kind": "peer", "steps": [peer]},
        },
        "errors": {},
    }  # fmt: skip
    markdown = render(results, [])
    assert "## Cost per tenant" in markdown
    header = (
        "| step | tenant | tessera in target | tessera device-s/1k | tessera GB-s/1k"
        " | dedicated in target | dedicated device-s/1k | dedicated GB-s/1k |"
    )
    assert header in markdown
    assert "| - | app | 500 | 20.00 | 40.00 | 400 | 37.50 | 150.00 |" in markdown
    assert "| - | partner | 500 | 10.00 | 20.00 | 500 | 18.00 | 60.00 |" in markdown
    assert "| - | unattributed | 1000 | 0.00 | 0.00 | 900 | 0.00 | 11.11 |" in markdown
    assert "| - | all | 1000 | 15.00 | 30.00 | 900 | 26.67 | 111.11 |" in markdown
    assert "peer in target" not in markdown
