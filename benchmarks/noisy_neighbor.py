"""Noisy neighbour: a quiet tenant's p99 beside a flooding one, FIFO vs fair vs vip.

    python benchmarks/noisy_neighbor.py [--quick]

One run, all on ``all-minilm-l6-v2``, one server per configuration:

- alone: the quiet tenant sends one sentence every 100 ms (open loop): p99 ``S``;
- beside a flooder that keeps 16 connections busy with 8-sentence requests:
  - FIFO (``scheduling: fifo``), both tenants ``standard``: quiet p99 ``B``;
  - fair, both ``standard``: quiet p99 ``F``;
  - fair, the quiet tenant ``vip`` with a latency target of 3 x ``S``: p99 ``V``.
  For each: the flooder's throughput and the batch run time p99 ``D`` during
  the flood (from ``/admin/batches``).

Bars (issue: tenants): ``F <= 0.25 B``; ``F <= S + 2 D``; ``V <= 3 S`` while the
flooder keeps at least 70% of the throughput it had beside a standard quiet
tenant. Figures go to ``benchmarks/results/noisy-neighbor-DATE[-N].{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml
from engine_bench import (
    EMBED_MODEL,
    RESULTS_DIR,
    ServerProcess,
    log,
    machine_info,
    output_stem,
    percentile,
    running_server,
    sentences,
    wait_for_quiet,
)

from tessera.tenants import TenantStore

QUIET_INTERVAL_S = 0.1
FLOOD_CONNECTIONS = 16
FLOOD_SENTENCES = 8


@dataclass(frozen=True)
class Plan:
    quiet_requests: int
    flood_warmup_s: float


@dataclass
class Outcome:
    label: str
    quiet_p50_ms: float
    quiet_p99_ms: float
    quiet_failures: int
    flood_req_per_s: float
    flood_sentences_per_s: float
    flood_failures: int
    batch_run_p99_ms: float | None
    mean_batch_size: float | None


def prepare(data_dir: Path, quiet_tier: str) -> dict[str, str]:
    """Tenants ``quiet`` and ``flood`` with a key each, and an admin key."""
    with TenantStore(data_dir) as store:
        store.add_tenant("ops")
        store.add_tenant("quiet", tier=quiet_tier)
        store.add_tenant("flood", tier="standard")
        return {
            "admin": store.create_key("ops", admin=True).key,
            "quiet": store.create_key("quiet").key,
            "flood": store.create_key("flood").key,
        }


async def quiet_caller(
    base_url: str, key: str, texts: list[str], count: int
) -> tuple[list[float], int]:
    """One sentence every 100 ms, on schedule whatever the answers take."""
    latencies: list[float] = []
    failures = 0
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as client:

        async def one(i: int) -> None:
            nonlocal failures
            start = time.perf_counter()
            response = await client.post(
                "/v1/embeddings", json={"model": EMBED_MODEL, "input": texts[i % len(texts)]}
            )
            if response.status_code == 200:
                latencies.append(time.perf_counter() - start)
            else:
                failures += 1

        tasks = []
        start = time.perf_counter()
        for i in range(count):
            await asyncio.sleep(max(0.0, start + i * QUIET_INTERVAL_S - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.gather(*tasks)
    return latencies, failures


async def flooder(base_url: str, key: str, texts: list[str], stop: asyncio.Event) -> dict[str, Any]:
    """16 connections, each sending 8 sentences again as soon as answered."""
    done, failures = 0, 0
    headers = {"Authorization": f"Bearer {key}"}
    started = time.perf_counter()

    async def connection(n: int) -> None:
        nonlocal done, failures
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as client:
            i = n
            while not stop.is_set():
                batch = [texts[(i + j) % len(texts)] for j in range(FLOOD_SENTENCES)]
                i += FLOOD_SENTENCES
                response = await client.post(
                    "/v1/embeddings", json={"model": EMBED_MODEL, "input": batch}
                )
                if response.status_code == 200:
                    done += 1
                else:
                    failures += 1

    await asyncio.gather(*(connection(n) for n in range(FLOOD_CONNECTIONS)))
    return {"done": done, "failures": failures, "seconds": time.perf_counter() - started}


async def batch_stats(server: ServerProcess, admin_key: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as client:
        r = await client.get("/admin/batches", headers={"Authorization": f"Bearer {admin_key}"})
    models = {m["name"]: m for m in r.json()["models"]}
    return dict(models[EMBED_MODEL])


async def measure(
    server: ServerProcess, keys: dict[str, str], plan: Plan, *, flood: bool, label: str
) -> Outcome:
    texts = sentences()
    stop = asyncio.Event()
    flood_task = (
        asyncio.ensure_future(flooder(server.base_url, keys["flood"], texts, stop))
        if flood
        else None
    )
    if flood_task is not None:
        await asyncio.sleep(plan.flood_warmup_s)
    flood_before = await batch_stats(server, keys["admin"])
    start = time.perf_counter()
    latencies, quiet_failures = await quiet_caller(
        server.base_url, keys["quiet"], texts, plan.quiet_requests
    )
    elapsed = time.perf_counter() - start
    after = await batch_stats(server, keys["admin"])
    stop.set()
    flood_result = await flood_task if flood_task is not None else None
    flood_rps = 0.0
    flood_failures = 0
    if flood_result is not None:
        # Requests answered by the flooder while the quiet tenant was measured.
        served = after["num_requests"] - flood_before["num_requests"] - plan.quiet_requests
        flood_rps = served / elapsed
        flood_failures = flood_result["failures"]
    outcome = Outcome(
        label=label,
        quiet_p50_ms=round(1000 * percentile(latencies, 0.50), 1),
        quiet_p99_ms=round(1000 * percentile(latencies, 0.99), 1),
        quiet_failures=quiet_failures,
        flood_req_per_s=round(flood_rps, 1),
        flood_sentences_per_s=round(flood_rps * FLOOD_SENTENCES, 1),
        flood_failures=flood_failures,
        batch_run_p99_ms=round(1000 * after["run_s_p99"], 1) if after["run_s_p99"] else None,
        mean_batch_size=round(after["mean_batch_size"], 1) if after["mean_batch_size"] else None,
    )
    log(f"  {label}: {outcome}")
    return outcome


def run_configuration(
    work: Path,
    label: str,
    plan: Plan,
    *,
    scheduling: str,
    quiet_tier: str,
    vip_target_ms: float | None = None,
    flood: bool = True,
) -> Outcome:
    data_dir = work / f"data-{label}"
    keys = prepare(data_dir, quiet_tier)
    config: dict[str, Any] = {"scheduling": scheduling, "preload": [EMBED_MODEL]}
    if vip_target_ms is not None:
        config["tiers"] = {"vip": {"latency_target_ms": vip_target_ms}}
    config_path = work / f"config-{label}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    args = ("--config", str(config_path), "--data-dir", str(data_dir))
    with running_server(work, label, *args) as server:
        # Warm the HTTP path and the model before measuring.
        asyncio.run(quiet_caller(server.base_url, keys["quiet"], sentences(), 10))
        return asyncio.run(measure(server, keys, plan, flood=flood, label=label))


def rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    o = {r["label"]: r for r in results["outcomes"]}
    s, b, f, v = (o[k]["quiet_p99_ms"] for k in ("alone", "fifo", "fair", "vip"))
    d = o["fair"]["batch_run_p99_ms"] or 0.0
    keep = o["vip"]["flood_req_per_s"] / max(o["fair"]["flood_req_per_s"], 1e-9)

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    table = [
        ("S: quiet p99 alone (ms)", f"{s:.0f}", "", "info"),
        ("B: quiet p99 beside flood, FIFO (ms)", f"{b:.0f}", "", "info"),
        ("F: quiet p99 beside flood, fair (ms)", f"{f:.0f}", "", "info"),
        ("V: quiet p99 beside flood, quiet vip (ms)", f"{v:.0f}", "", "info"),
        ("D: batch run time p99 during flood, fair (ms)", f"{d:.0f}", "", "info"),
        ("F / B", f"{f / b:.2f}", "<= 0.25", verdict(f <= 0.25 * b)),
        ("F vs S + 2D (ms)", f"{f:.0f} vs {s + 2 * d:.0f}", "F <= S+2D", verdict(f <= s + 2 * d)),
        ("V / S", f"{v / s:.2f}", "<= 3", verdict(v <= 3 * s)),
        ("flood throughput vip / fair", f"{keep:.2f}", ">= 0.70", verdict(keep >= 0.7)),
    ]
    for label in ("fifo", "fair", "vip"):
        table.append(
            (f"flood sentences/s ({label})", f"{o[label]['flood_sentences_per_s']:.0f}", "", "info")
        )
    failures = sum(r["quiet_failures"] + r["flood_failures"] for r in results["outcomes"])
    table.append(("failed requests", str(failures), "", "info"))
    return table


def render(results: dict[str, Any], table: list[tuple[str, str, str, str]]) -> str:
    lines = [
        f"# Noisy neighbour, {results['date']}",
        "",
        (__doc__ or "").split("\n\n", 2)[2].strip(),
        "",
        f"Command: `{results['command']}`. Machine: {results['machine']['cpu_count']} cores,"
        f" {results['machine']['cpu_model']}.",
        "",
        "| figure | value | bar | verdict |",
        "|---|---|---|---|",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in table),
        "",
        "| configuration | quiet p50 ms | quiet p99 ms | flood req/s"
        " | batch run p99 ms | mean batch |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['label']} | {r['quiet_p50_ms']} | {r['quiet_p99_ms']} | {r['flood_req_per_s']}"
            f" | {r['batch_run_p99_ms']} | {r['mean_batch_size']} |"
            for r in results["outcomes"]
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 quiet requests instead of 200")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--wait-quiet", type=float, default=60.0, metavar="S")
    args = parser.parse_args()
    plan = Plan(quiet_requests=100 if args.quick else 200, flood_warmup_s=3.0)
    if args.wait_quiet > 0:
        wait_for_quiet(args.wait_quiet)
    now = datetime.now(UTC).astimezone()
    results: dict[str, Any] = {
        "date": now.date().isoformat(),
        "started": now.isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine_info(),
        "plan": plan.__dict__,
        "outcomes": [],
    }
    with tempfile.TemporaryDirectory(prefix="tessera-noisy-") as tmp:
        work = Path(tmp)
        alone = run_configuration(
            work, "alone", plan, scheduling="fair", quiet_tier="standard", flood=False
        )
        results["outcomes"].append(alone.__dict__)
        for label, scheduling, tier in (("fifo", "fifo", "standard"), ("fair", "fair", "standard")):
            outcome = run_configuration(work, label, plan, scheduling=scheduling, quiet_tier=tier)
            results["outcomes"].append(outcome.__dict__)
        vip = run_configuration(
            work,
            "vip",
            plan,
            scheduling="fair",
            quiet_tier="vip",
            vip_target_ms=3 * alone.quiet_p99_ms,
        )
        results["outcomes"].append(vip.__dict__)
    table = rows(results)
    results["table"] = table
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = output_stem(args.out_dir, results["date"], "noisy-neighbor")
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    stem.with_suffix(".md").write_text(render(results, table), encoding="utf-8")
    for figure, value, bar, verdict in table:
        print(f"{figure:<48} {value:>16}  {bar:<10} {verdict}")
    print(f"\nwrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
