"""Serve a scenario's workload with each of its configurations in turn, and measure.

Configurations run one after the other, never two at once, on this machine:
each starts its servers, runs every step (a warm-up, then the measured load
with CPU, PSS and residency sampled), and stops them before the next starts.
One configuration that fails is recorded and the others still run.
Where a scenario sweeps rates, a configuration's sweep under each popularity
stops at the first rate it misses (fewer than 95% within target, or any
failed): the last rate before it is its capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from harness.costs import read_costs, spent, tenant_costs
from harness.deploy import (
    Deployment,
    deploy_dedicated,
    deploy_peer,
    deploy_tessera,
    latency_targets_ms,
)
from harness.driver import Driver
from harness.figures import Cost, percentile_ms, step_figures, within_capacity
from harness.heads import HeadSet, ensure_heads
from harness.machine import machine_info
from harness.perturbed import bench_models_dir, ensure_models
from harness.probes import (
    CpuMeter,
    Sampler,
    batch_sizes,
    histogram_delta,
    scrape_batches,
)
from harness.progress import BenchProgress
from harness.raw import run_raw
from harness.scenario import Configuration, Scenario, ScenarioError, Step
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


async def _residency_by_server(deployment: Deployment) -> dict[str, Any]:
    """Each tessera server's ``/admin/residency``, by base URL."""
    out = {}
    async with httpx.AsyncClient(timeout=30, headers=deployment.admin_headers) as client:
        for server in deployment.servers:
            response = await client.get(f"{server.base_url}/admin/residency")
            response.raise_for_status()
            out[server.base_url] = response.json()
    return out


async def _residency_now(deployment: Deployment) -> dict[str, Any]:
    """The residency of the server that serves each model, by model."""
    by_server = await _residency_by_server(deployment)
    return {model: by_server[server.base_url] for model, server in deployment.routes.items()}


async def _histograms(deployment: Deployment) -> dict[str, dict[str, float]]:
    merged: dict[str, dict[str, float]] = {}
    if deployment.kind == "peer":
        return merged
    for server in deployment.servers:
        merged.update(await batch_sizes(server.base_url, deployment.admin_headers))
    return merged


PRIME_BOUND_S = 1800.0


async def prime(deployment: Deployment, scenario: Scenario, configuration: Configuration) -> None:
    """One request to each model in turn, least popular first, by the first tenant."""
    tenant = next(t for t in scenario.tenants_for(configuration, None) if not t.background)
    models = list(reversed(scenario.models))
    once = replace(tenant, rate=None, concurrency=1, requests=len(models), background=False)
    driver = Driver(
        deployment, models, None, round_robin=True, model_headers=deployment.model_headers
    )
    result = await driver.run([once], len(models), PRIME_BOUND_S)
    failed = sum(not r.ok for r in result.records)
    log(f"  primed {len(result.records)} models in {result.seconds:.0f} s, {failed} failed")


def _load_events(path: Path | None) -> list[dict[str, Any]]:
    if path is None or not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _quantiles_ms(seconds: list[float]) -> dict[str, float | None]:
    return {"p50_ms": percentile_ms(seconds, 0.5), "p99_ms": percentile_ms(seconds, 0.99)}


def swap_figures(
    deployment: Deployment,
    before: dict[str, Any],
    after: dict[str, Any],
    events_before: int,
) -> dict[str, Any]:
    """Loads in a step and how long they took, where the configuration tells:
    tessera's residency by server, before and after (the last load from files
    and from the host tier of each model that loaded that way in the step,
    and the host tier's bytes at the end), a peer's load events."""
    if deployment.kind == "peer":
        if deployment.load_events is None:
            return {}
        events = _load_events(deployment.load_events)[events_before:]
        return {"loads": len(events), "load": _quantiles_ms([e["load_s"] for e in events])}
    loads = host_loads = host_used = 0
    files_s: list[float] = []
    host_s: list[float] = []
    for server, now in after.items():
        then = before.get(server, {})
        loads += int(now["loads_total"]) - int(then.get("loads_total", 0))
        host_loads += int(now["host_loads_total"]) - int(then.get("host_loads_total", 0))
        host_used += int(now["host_used_bytes"])
        earlier = {m["name"]: m for m in then.get("models", [])}
        for model in now["models"]:
            was = earlier.get(model["name"], {})
            from_host = int(model["host_loads"]) - int(was.get("host_loads", 0))
            from_files = int(model["loads"]) - int(was.get("loads", 0)) - from_host
            if from_files > 0 and model["files_load_s"] is not None:
                files_s.append(model["files_load_s"])
            if from_host > 0 and model["host_load_s"] is not None:
                host_s.append(model["host_load_s"])
    return {
        "loads": loads,
        "host_loads": host_loads,
        "host_used_bytes": host_used,
        "from_files_last": _quantiles_ms(files_s),  # of each model loaded in the step
        "from_host_last": _quantiles_ms(host_s),
    }


def encoder_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Batches tessera ran through a shared encoder for several head models'
    requests in a step (encoder batching), their items, and the items a
    batch; from each server's residency before and after."""
    batches = rows = 0
    for server, now in after.items():
        then = before.get(server, {})
        batches += int(now.get("encoder_batches_total", 0)) - int(
            then.get("encoder_batches_total", 0)
        )
        rows += int(now.get("encoder_rows_total", 0)) - int(then.get("encoder_rows_total", 0))
    return {"batches": batches, "rows": rows, "rows_per_batch": rows / batches if batches else None}


async def run_step(
    deployment: Deployment,
    scenario: Scenario,
    configuration: Configuration,
    step: Step,
    seed: int,
) -> dict[str, Any]:
    tenants = scenario.tenants_for(configuration, step.concurrency, step.rate)
    models = list(scenario.models)
    headers = deployment.model_headers
    if scenario.warmup_requests:
        # Each tenant's warm-up is ``warmup_requests``, whatever its own bound
        # (a flooder's ``requests: 1000`` would warm up for the whole duration).
        warm = [replace(t, requests=None) for t in tenants if not t.background]
        await Driver(deployment, models, step.zipf, seed + 1, model_headers=headers).run(
            warm, scenario.warmup_requests, scenario.duration_s
        )
    total = sum((t.requests or scenario.requests) for t in tenants if not t.background)
    progress = BenchProgress(total, sys.stderr)

    def advance() -> None:
        progress.advance()

    driver = Driver(deployment, models, step.zipf, seed, on_answer=advance, model_headers=headers)
    before = await _histograms(deployment)
    servers_before = {} if deployment.kind == "peer" else await _residency_by_server(deployment)
    events_before = len(_load_events(deployment.load_events))
    sampler = Sampler(deployment.processes, deployment.residencies())
    meter = CpuMeter(deployment.processes)
    meter.start()
    sampler.start()
    # The tenants' cost counters, read around the load alone (``harness.costs``).
    ledgers = [] if deployment.kind == "peer" else [s.base_url for s in deployment.servers]
    costs_before = await read_costs(ledgers, deployment.admin_headers)
    result = await driver.run(tenants, scenario.requests, scenario.duration_s)
    costs_after = await read_costs(ledgers, deployment.admin_headers)
    await sampler.stop()
    cpu = meter.stop()
    progress.close()
    residency = {} if deployment.kind == "peer" else await _residency_now(deployment)
    peaks = {m: int(r["peak_used_bytes"]) for m, r in residency.items()}
    cost = Cost(cpu, sampler.samples, _reserved(deployment, residency))
    groups = {t.name: t.group for t in tenants if t.group is not None}
    targets = latency_targets_ms(scenario)
    figures = step_figures(result.records, result.seconds, targets, cost, groups)
    figures["concurrency"] = step.concurrency
    figures["rate"] = step.rate
    figures["popularity"] = step.popularity
    servers_after = {} if deployment.kind == "peer" else await _residency_by_server(deployment)
    figures["swaps"] = swap_figures(deployment, servers_before, servers_after, events_before)
    if deployment.kind != "peer":
        figures["encoder_batches"] = encoder_figures(servers_before, servers_after)
    figures["batch_size_histogram"] = histogram_delta(before, await _histograms(deployment))
    figures["peak_used_bytes"] = peaks
    if ledgers:
        within = {t: f["within_target"] for t, f in figures["per_tenant"].items()}
        step_costs = spent(costs_before, costs_after)
        figures["tenant_costs"] = tenant_costs(step_costs, within, groups)
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
        if scenario.prime:
            asyncio.run(prime(deployment, scenario, configuration))
        steps: list[dict[str, Any]] = []
        missed: set[str] = set()  # popularities whose capacity is found
        for n, step in enumerate(scenario.plan()):
            if step.popularity in missed:
                log(f"  skip {step.rate} req/s ({step.popularity}): a lower rate missed")
                continue
            label = _label(step)
            log(f"{scenario.name} / {configuration.name}: step {label}")
            figures = asyncio.run(run_step(deployment, scenario, configuration, step, seed=n))
            log(
                f"  {figures['req_per_s']} req/s, p99 {figures['p99_ms']} ms, "
                f"{figures['failed']} failed, {figures['within_target_share']} within target"
            )
            steps.append(figures)
            if step.rate is not None and not within_capacity(figures, scenario.capacity_share):
                missed.add(step.popularity)
        return {"kind": configuration.kind, "settings": deployment.settings, "steps": steps}


def _label(step: Step) -> str:
    if step.rate is not None:
        return f"{step.rate:g} req/s, {step.popularity}"
    concurrency = "as written" if step.concurrency is None else str(step.concurrency)
    return concurrency if step.zipf is None else f"{concurrency}, {step.popularity}"


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
    generated = scenario.generated
    if generated is not None:
        if isinstance(generated, HeadSet):
            made = ensure_heads(generated, bench_models_dir())
        else:
            made = ensure_models(generated, bench_models_dir())
        log(f"{generated.count} models in {made} ({time.perf_counter() - start:.0f} s)")
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
