"""The figures of one step: throughput, latency, share within target, cost, memory."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from harness.driver import Record
from harness.probes import Sample, time_average
from harness.scenario import CAPACITY_SHARE

GB = 1e9


def percentile_ms(latencies_s: list[float], q: float) -> float | None:
    if not latencies_s:
        return None
    ordered = sorted(latencies_s)
    return round(1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 1)


def latency_figures(
    records: Iterable[Record], seconds: float, targets_ms: dict[str, float | None]
) -> dict[str, Any]:
    """Counts, rate, quantiles and the share of requests answered within the model's target."""
    records = list(records)
    ok = [r for r in records if r.ok]
    within = [
        r for r in ok if (target := targets_ms.get(r.model)) is None or 1000 * r.latency_s <= target
    ]
    latencies = [r.latency_s for r in ok]
    return {
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "req_per_s": round(len(ok) / seconds, 2) if seconds > 0 else 0.0,
        "p50_ms": percentile_ms(latencies, 0.50),
        "p95_ms": percentile_ms(latencies, 0.95),
        "p99_ms": percentile_ms(latencies, 0.99),
        "mean_ms": round(1000 * sum(latencies) / len(ok), 1) if ok else None,
        "within_target": len(within),
        "within_target_share": round(len(within) / len(records), 4) if records else None,
        "statuses": dict(Counter(r.status for r in records)),
    }


def within_capacity(figures: dict[str, Any], least_share: float = CAPACITY_SHARE) -> bool:
    share = figures["within_target_share"]
    return figures["failed"] == 0 and share is not None and share >= least_share


@dataclass(frozen=True)
class Cost:
    cpu_seconds: float
    samples: list[Sample]
    reserved_bytes: int | None  # what the configuration holds for its models


def cost_figures(cost: Cost, figures: dict[str, Any], seconds: float) -> dict[str, Any]:
    """CPU-s per 1,000 requests, PSS, memory utilization, loads and GB-s per 1,000 in target."""
    samples = cost.samples
    ok, within = figures["ok"], figures["within_target"]
    mean_pss = time_average(samples, lambda s: float(s.pss_bytes))
    used = time_average(samples, lambda s: None if s.used_bytes is None else float(s.used_bytes))
    loads = [s.loads_total for s in samples if s.loads_total is not None]
    evictions = [s.evictions_total for s in samples if s.evictions_total is not None]
    reserved = cost.reserved_bytes
    out: dict[str, Any] = {
        "cpu_seconds": round(cost.cpu_seconds, 2),
        "cpu_s_per_1k_requests": round(1000 * cost.cpu_seconds / ok, 2) if ok else None,
        "peak_pss_bytes": max((s.pss_bytes for s in samples), default=None),
        "mean_pss_bytes": None if mean_pss is None else int(mean_pss),
        "mean_used_bytes": None if used is None else int(used),
        "reserved_bytes": reserved,
        "memory_utilization": round(used / reserved, 4) if used is not None and reserved else None,
        "cold_loads": loads[-1] - loads[0] if loads else None,
        "evictions": evictions[-1] - evictions[0] if evictions else None,
    }
    if out["cold_loads"] is not None and figures["requests"]:
        out["cold_load_share"] = round(out["cold_loads"] / figures["requests"], 4)
    per_1k = within / 1000
    if reserved and per_1k:
        out["reserved_gb_s_per_1k_within_target"] = round(reserved / GB * seconds / per_1k, 3)
    if mean_pss and per_1k:
        out["pss_gb_s_per_1k_within_target"] = round(mean_pss / GB * seconds / per_1k, 3)
    return out


def step_figures(
    records: list[Record],
    seconds: float,
    targets_ms: dict[str, float | None],
    cost: Cost,
    groups: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A step's figures: overall, per tenant, per group of tenants (``groups``:
    tenant -> group, the scenario's ``count`` entries: their requests pooled,
    and the worst member's p99), per model, and each tenant's or group's
    latencies (a group's pooled: one line of the plot, not one a member)."""
    groups = groups or {}
    overall = latency_figures(records, seconds, targets_ms)
    by_tenant: dict[str, list[Record]] = {}
    for r in records:
        by_tenant.setdefault(r.tenant, []).append(r)
    models = sorted({r.model for r in records})
    per_tenant = {t: latency_figures(by_tenant[t], seconds, targets_ms) for t in sorted(by_tenant)}
    per_group: dict[str, dict[str, Any]] = {}
    for group in sorted(set(groups.values())):
        members = [t for t in by_tenant if groups.get(t) == group]
        pooled = [r for t in members for r in by_tenant[t]]
        worst = [per_tenant[t]["p99_ms"] for t in members if per_tenant[t]["p99_ms"] is not None]
        per_group[group] = {
            **latency_figures(pooled, seconds, targets_ms),
            "tenants": len(members),
            "members": sorted(members),
            "worst_p99_ms": max(worst, default=None),
        }
    lines: dict[str, list[float]] = {}
    for t, mine in by_tenant.items():
        line = lines.setdefault(groups.get(t, t), [])
        line.extend(round(1000 * r.latency_s, 1) for r in mine if r.ok)
    return {
        "seconds": round(seconds, 2),
        **overall,
        **cost_figures(cost, overall, seconds),
        "per_tenant": per_tenant,
        "per_group": per_group,
        "per_model": {
            m: latency_figures((r for r in records if r.model == m), seconds, targets_ms)
            for m in models
        },
        "latencies_ms": {who: sorted(lines[who]) for who in sorted(lines)},
        "memory_timeline": [
            [round(s.t_s, 2), s.used_bytes, s.budget_bytes, s.pss_bytes] for s in cost.samples
        ],
    }
