"""Serve a scenario's workload with each of its configurations in turn, and measure.

Configurations run one after the other, never two at once, on this machine:
each starts its servers, runs every step (a warm-up, then the measured load
with CPU, PSS and residency sampled), and stops them before the next starts.
One configuration that fails is recorded and the others still run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from harness.deploy import (
    Deployment,
    deploy_dedicated,
    deploy_peer,
    deploy_tessera,
    latency_targets_ms,
)
from harness.driver import Driver
from harness.figures import Cost, step_figures
from harness.machine import machine_info
from harness.probes import (
    CpuMeter,
    Sampler,
    batch_sizes,
    histogram_delta,
    scrape_batches,
)
from harness.progress import BenchProgress
from harness.raw import run_raw
from harness.scenario import Configuration, Scenario, ScenarioError
from harness.servers import log


def resolve(value: Any, done: dict[str, Any]) -> Any:
    """Replace ``{p99_of: CONFIG, tenant: T, times: X}`` with X times that p99, in ms."""
    if isinstance(value, dict):
        if "p99_of" in value:
            source = done.get(str(value["p99_of"]))
            if source is None or not source.get("steps"):
                raise ScenarioError(f"{value['p99_of']} has not run before this configuration")
            p99 = source["steps"][0]["per_tenant"][str(value["tenant"])]["p99_ms"]
            return round(float(value.get("times", 1)) * p99)
        return {k: resolve(v, done) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, done) for v in value]
    return value


def _reserved(deployment: Deployment, residency: dict[str, Any]) -> int | None:
    """What a configuration holds for its models: each tessera's budget (for a
    static partition, its slices together); for dedicated, each process's peak."""
    if deployment.kind == "peer":
        return None
    if deployment.kind == "dedicated":
        return sum(int(r["peak_used_bytes"]) for r in residency.values())
    budgets = {deployment.routes[m].base_url: int(r["budget_bytes"]) for m, r in residency.items()}
    return sum(budgets.values())


async def _residency_now(deployment: Deployment) -> dict[str, Any]:
    out = {}
    async with httpx.AsyncClient(timeout=30, headers=deployment.admin_headers) as client:
        for model, server in deployment.routes.items():
            response = await client.get(f"{server.base_url}/admin/residency")
            response.raise_for_status()
            out[model] = response.json()
    return out


async def _histograms(deployment: Deployment) -> dict[str, dict[str, float]]:
    merged: dict[str, dict[str, float]] = {}
    if deployment.kind == "peer":
        return merged
    for server in deployment.servers:
        merged.update(await batch_sizes(server.base_url, deployment.admin_headers))
    return merged


async def run_step(
    deployment: Deployment,
    scenario: Scenario,
    configuration: Configuration,
    step: int | None,
    seed: int,
) -> dict[str, Any]:
    tenants = scenario.tenants_for(configuration, step)
    models = list(scenario.models)
    if scenario.warmup_requests:
        warm = [t for t in tenants if not t.background]
        await Driver(deployment, models, scenario.zipf, seed + 1).run(
            warm, scenario.warmup_requests, scenario.duration_s
        )
    total = sum((t.requests or scenario.requests) for t in tenants if not t.background)
    progress = BenchProgress(total, sys.stderr)

    def advance() -> None:
        progress.advance()

    driver = Driver(deployment, models, scenario.zipf, seed, on_answer=advance)
    before = await _histograms(deployment)
    sampler = Sampler(deployment.processes, deployment.residencies())
    meter = CpuMeter(deployment.processes)
    meter.start()
    sampler.start()
    result = await driver.run(tenants, scenario.requests, scenario.duration_s)
    await sampler.stop()
    cpu = meter.stop()
    progress.close()
    residency = {} if deployment.kind == "peer" else await _residency_now(deployment)
    peaks = {m: int(r["peak_used_bytes"]) for m, r in residency.items()}
    cost = Cost(cpu, sampler.samples, _reserved(deployment, residency))
    groups = {t.name: t.group for t in tenants if t.group is not None}
    targets = latency_targets_ms(scenario)
    figures = step_figures(result.records, result.seconds, targets, cost, groups)
    figures["concurrency"] = step
    figures["batch_size_histogram"] = histogram_delta(before, await _histograms(deployment))
    figures["peak_used_bytes"] = peaks
    if deployment.kind != "peer":
        figures["batches"] = {
            s.base_url: scrape_batches(s.base_url, deployment.admin_headers)
            for s in deployment.servers
        }
    return figures


@contextlib.contextmanager
def _deployed(
    scenario: Scenario,
    configuration: Configuration,
    work: Path,
    done: dict[str, Any],
    slices: dict[str, int] | None,
) -> Iterator[Deployment]:
    tiers = {t.name: scenario.tier_of(configuration, t) for t in scenario.tenants}
    resolved = replace(configuration, config=resolve(configuration.config, done))
    if configuration.kind == "peer":
        with deploy_peer(scenario, resolved, work) as deployment:
            yield deployment
    elif configuration.kind == "dedicated":
        with deploy_dedicated(scenario, resolved, work, tiers) as deployment:
            yield deployment
    else:
        with deploy_tessera(scenario, resolved, work, tiers, slices) as deployment:
            yield deployment


def run_configuration(
    scenario: Scenario,
    configuration: Configuration,
    work: Path,
    done: dict[str, Any],
    slices: dict[str, int] | None,
) -> dict[str, Any]:
    if configuration.kind == "raw":
        bases = {scenario.base_model(m) for m in scenario.models}
        if len(bases) != 1:
            raise ScenarioError("raw measures one model's weights")
        threads = os.cpu_count() or 1
        raw = run_raw(bases.pop(), threads, min(20.0, scenario.duration_s), 200)
        return {"kind": "raw", "raw": raw}
    with _deployed(scenario, configuration, work, done, slices) as deployment:
        steps = []
        for n, step in enumerate(scenario.steps()):
            log(f"{scenario.name} / {configuration.name}: step {step or 'as written'}")
            figures = asyncio.run(run_step(deployment, scenario, configuration, step, seed=n))
            log(
                f"  {figures['req_per_s']} req/s, p99 {figures['p99_ms']} ms, "
                f"{figures['failed']} failed"
            )
            steps.append(figures)
        return {"kind": configuration.kind, "settings": deployment.settings, "steps": steps}


def scenario_json(scenario: Scenario) -> dict[str, Any]:
    out = asdict(scenario)
    out["path"] = None if scenario.path is None else str(scenario.path)
    return out


def run_scenario(scenario: Scenario, work: Path, only: set[str] | None = None) -> dict[str, Any]:
    """Every configuration of ``scenario`` (or those in ``only``), one after the other."""
    now = datetime.now(UTC).astimezone()
    results: dict[str, Any] = {
        "scenario": scenario_json(scenario),
        "date": now.date().isoformat(),
        "started": now.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "command": " ".join(sys.argv),
        "configurations": {},
        "errors": {},
    }
    slices: dict[str, int] | None = None
    start = time.perf_counter()
    for configuration in scenario.configurations:
        if only is not None and configuration.name not in only:
            continue
        begun = time.perf_counter()
        try:
            outcome = run_configuration(
                scenario, configuration, work, results["configurations"], slices
            )
        except Exception as e:  # one broken configuration must not lose the others
            log(f"{configuration.name} failed: {type(e).__name__}: {e}")
            results["errors"][configuration.name] = f"{type(e).__name__}: {e}"
            continue
        outcome["wall_s"] = round(time.perf_counter() - begun, 1)
        results["configurations"][configuration.name] = outcome
        if configuration.kind == "dedicated":
            slices = outcome["steps"][-1]["peak_used_bytes"]
    results["total_s"] = round(time.perf_counter() - start, 1)
    return results
