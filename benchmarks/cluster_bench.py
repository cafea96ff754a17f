"""tessera on a local Ray cluster: affinity, a hot model's second replica, a node
lost under load, and one tenant's rate held by two gateways.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/cluster_bench.py [--qps-seconds 60] \
        [--out benchmarks/results]

Three Ray nodes on this machine (``harness.raycluster``: every node on
127.0.0.1, one CPU each), one engine actor per node, two gateway processes
(``tessera cluster`` and ``tessera serve --cluster``) sharing tenants in
PostgreSQL and admission in Redis (127.0.0.1, as the tests use them). The
models are fake ones whose batches sleep (wall time without CPU), so that the
figures are the routing's, not this machine's two cores'. In order:

1. **Affinity**: 12 models, each warmed once, then 600 requests from 8
   callers over both gateways, uniform over the models: the share sent to a
   device whose last report held the model ready (bar: >= 95%).
2. **A hot model**: ``hot`` runs one request a batch for 50 ms (20 a second
   per replica); 16 callers in a closed loop on it: the seconds from the start
   of the load to a second replica in the router's view, and each second's
   p99 before and after (bar: a second replica; the p99 falls).
3. **Rate across gateways**: a tenant with ``qps 20`` (burst 20) sends as
   fast as 8 callers can, split over both gateways, for ``--qps-seconds``:
   requests accepted against the limit (20 x seconds + the burst; bar <= 1.05).
4. **A node lost**: 8 callers over the 12 models across both gateways; a
   worker node (its raylet and every process on it) is killed after 3 s, the
   load runs 10 s in all: requests that did not get 200 (bar: 0).

Prints a Markdown table and writes it, with the figures, to
``OUT/cluster-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

from harness.fake_models import FAKE_ADAPTERS
from harness.raycluster import LocalRayCluster, local_ray_cluster, running_gateways
from harness.report import output_stem
from harness.servers import RunningServer
from harness.stores import postgres_schema, redis_prefix, redis_url

MODELS = [f"m{i}" for i in range(12)]
ROUTING = {
    "report_interval_s": 0.25,
    "target_p99_s": 0.2,
    "max_queue_per_replica": 4,
    "target_utilization": 0.6,
    "scale_up_after_s": 1.0,
    "scale_down_after_s": 20.0,
}
QPS = 20.0


class Bench:
    def __init__(self, ray: LocalRayCluster, gateways: list[RunningServer], keys: dict[str, str]):
        self.ray = ray
        self.gateways = gateways
        self.keys = keys
        self.clients = [httpx.Client(base_url=g.base_url, timeout=60) for g in gateways]

    def post(self, gateway: int, tenant: str, model: str) -> tuple[int, float]:
        start = time.perf_counter()
        r = self.clients[gateway % len(self.clients)].post(
            "/v1/embeddings",
            json={"model": model, "input": ["a sentence"]},
            headers={"Authorization": f"Bearer {self.keys[tenant]}"},
        )
        return r.status_code, time.perf_counter() - start

    def cluster(self, gateway: int) -> dict[str, Any]:
        r = self.clients[gateway].get(
            "/admin/cluster", headers={"Authorization": f"Bearer {self.keys['ops']}"}
        )
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    def routing(self) -> tuple[int, int]:
        views = [self.cluster(g)["routing"] for g in range(len(self.gateways))]
        return sum(v["num_requests"] for v in views), sum(v["num_resident"] for v in views)

    def closed_loop(
        self,
        num_callers: int,
        pick: Callable[[int], tuple[int, str, str]],
        seconds: float,
        during: Callable[[], None] = lambda: None,
    ) -> list[tuple[float, int, float]]:
        """Callers sending back to back for ``seconds`` (``during`` runs meanwhile,
        on this thread): (end time, status, seconds) of each request."""
        results: list[tuple[float, int, float]] = []
        stop = threading.Event()
        deadline = time.monotonic() + seconds

        def caller(i: int) -> None:
            n = i
            while not stop.is_set():
                gateway, tenant, model = pick(n)
                status, seconds = self.post(gateway, tenant, model)
                results.append((time.monotonic(), status, seconds))
                n += num_callers

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(num_callers)]
        for t in threads:
            t.start()
        try:
            during()
            time.sleep(max(0.0, deadline - time.monotonic()))
        finally:
            stop.set()
            for t in threads:
                t.join()
        return results


def affinity(bench: Bench) -> dict[str, Any]:
    for model in MODELS:
        bench.post(0, "load", model)
    time.sleep(1.0)
    sent0, resident0 = bench.routing()
    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = list(pool.map(lambda i: bench.post(i, "load", MODELS[i % 12])[0], range(600)))
    sent1, resident1 = bench.routing()
    replicas = bench.cluster(0)["replicas"]
    return {
        "requests": len(statuses),
        "ok": statuses.count(200),
        "routed": sent1 - sent0,
        "resident_share": (resident1 - resident0) / max(1, sent1 - sent0),
        "replicas_per_model": statistics.mean(len(replicas[m]) for m in MODELS),
    }


def p99(values: list[float]) -> float | None:
    return sorted(values)[int(0.99 * (len(values) - 1))] if values else None


def hot_model(bench: Bench) -> dict[str, Any]:
    bench.post(0, "load", "hot")
    time.sleep(1.0)
    start = time.monotonic()
    second_at: float | None = None

    def watch() -> None:
        nonlocal second_at
        while time.monotonic() - start < 30:
            if len(bench.cluster(0)["replicas"].get("hot", [])) >= 2:
                second_at = time.monotonic()
                return
            time.sleep(0.1)

    results = bench.closed_loop(16, lambda n: (n, "load", "hot"), 20.0, watch)
    end = time.monotonic()
    replicas_at_end = len(bench.cluster(0)["replicas"].get("hot", []))
    per_second = []
    for s in range(int(end - start)):
        window = [sec for t, status, sec in results if start + s <= t < start + s + 1]
        per_second.append({"second": s, "requests": len(window), "p99_s": p99(window)})
    before = [sec for t, _, sec in results if second_at is None or t < second_at]
    after = [sec for t, _, sec in results if second_at is not None and t >= second_at + 2]
    return {
        "seconds_to_second_replica": None if second_at is None else second_at - start,
        "p99_before_s": p99(before),
        "p99_after_s": p99(after),
        "throughput_before": len(before) / max(1e-9, (second_at or end) - start),
        "throughput_after": len(after) / max(1e-9, end - (second_at or end) - 2),
        "failed": sum(1 for _, status, _ in results if status != 200),
        "replicas_at_end": replicas_at_end,
        "per_second": per_second,
    }


def rate_across_gateways(bench: Bench, seconds: float) -> dict[str, Any]:
    start = time.monotonic()
    results = bench.closed_loop(8, lambda n: (n, "acme", MODELS[n % 12]), seconds)
    elapsed = time.monotonic() - start
    accepted = sum(1 for _, status, _ in results if status == 200)
    limit = QPS * elapsed + QPS  # the rate over the run, plus the burst
    return {
        "seconds": elapsed,
        "sent": len(results),
        "accepted": accepted,
        "refused_429": sum(1 for _, status, _ in results if status == 429),
        "limit": limit,
        "accepted_over_limit": accepted / limit,
    }


def node_lost(bench: Bench) -> dict[str, Any]:
    start = time.monotonic()
    killed_at = math.inf

    def kill() -> None:
        nonlocal killed_at
        time.sleep(3.0)
        bench.ray.kill_node(bench.ray.workers[0])
        killed_at = time.monotonic()

    results = bench.closed_loop(8, lambda n: (n, "load", MODELS[n % 12]), 10.0, kill)
    views = [bench.cluster(g) for g in range(len(bench.gateways))]
    after = [sec for t, _, sec in results if t >= killed_at]
    return {
        "requests": len(results),
        "after_kill": len(after),
        "not_ok": sum(1 for _, status, _ in results if status != 200),
        "rerouted": sum(v["routing"]["num_rerouted"] for v in views),
        "lost": sum(v["routing"]["num_lost"] for v in views),
        "p99_after_kill_s": p99(after),
        "seconds": time.monotonic() - start,
    }


def deploy_and_run(work: Path, qps_seconds: float) -> dict[str, Any]:
    from tessera.tenants import TenantStore
    from tessera.tenants.store import load_secret

    repo = work / "repo"
    models: dict[str, dict[str, Any]] = {
        m: {"options": {"run_s": 0.02, "own_bytes": 4_000_000}} for m in MODELS
    }
    models["hot"] = {
        "batching": {"max_batch_size": 1, "max_wait_ms": 1},
        "options": {"run_s": 0.05, "own_bytes": 4_000_000},
    }
    for name, extra in models.items():
        (repo / name).mkdir(parents=True)
        descriptor = {"name": name, "task": "embedding", "runtime": "torch", "adapter": "fake"}
        (repo / name / "model.yaml").write_text(yaml.safe_dump({**descriptor, **extra}))
    secret = work / "secret.key"
    with postgres_schema() as url, redis_prefix() as prefix:
        keys = {}
        with TenantStore(work / "setup", url=url, secret=load_secret(secret)) as store:
            for tenant in ("ops", "load", "acme"):
                store.add_tenant(tenant, qps=QPS if tenant == "acme" else None)
                keys[tenant] = store.create_key(tenant, admin=tenant == "ops").key
        config = work / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "include_default_models": False,
                    "model_repositories": [str(repo)],
                    "adapters": FAKE_ADAPTERS,
                    "memory_budget": "64MiB",
                    "num_threads": 1,
                    "tenant_store": url,
                    "key_secret_file": str(secret),
                    "admission_store": redis_url(),
                    "admission_prefix": prefix,
                    "cluster_cpu_share": 0.5,
                    "cluster_routing": ROUTING,
                }
            )
        )
        with (
            local_ray_cluster(num_nodes=3) as ray,
            running_gateways(work, ray.address, config) as gateways,
        ):
            bench = Bench(ray, gateways, keys)
            return {
                "affinity": affinity(bench),
                "hot_model": hot_model(bench),
                "rate_across_gateways": rate_across_gateways(bench, qps_seconds),
                "node_lost": node_lost(bench),
            }


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def markdown(figures: dict[str, Any], date: str) -> str:
    a, h, r, n = (
        figures["affinity"],
        figures["hot_model"],
        figures["rate_across_gateways"],
        figures["node_lost"],
    )
    rows = [
        (
            "affinity: share routed to a device holding the model",
            fmt(a["resident_share"]),
            ">= 0.95",
        ),
        ("affinity: replicas per model (12 models, 3 devices)", fmt(a["replicas_per_model"]), "1"),
        (
            "hot model: seconds from overload to a second replica",
            fmt(h["seconds_to_second_replica"]),
            "-",
        ),
        ("hot model: replicas after 20 s of overload", str(h["replicas_at_end"]), ">= 2"),
        (
            "hot model: p99 before / after (s)",
            f"{fmt(h['p99_before_s'])} / {fmt(h['p99_after_s'])}",
            "falls",
        ),
        (
            "hot model: req/s before / after",
            f"{fmt(h['throughput_before'])} / {fmt(h['throughput_after'])}",
            "rises",
        ),
        (
            "rate: accepted / (20 x seconds + burst), two gateways",
            fmt(r["accepted_over_limit"]),
            "<= 1.05",
        ),
        ("rate: accepted of sent", f"{r['accepted']} of {r['sent']} in {r['seconds']:.0f} s", "-"),
        ("node lost: requests not answered 200", f"{n['not_ok']} of {n['requests']}", "0"),
        ("node lost: tries re-routed from the dead engine", str(n["rerouted"]), "-"),
    ]
    lines = [
        f"# Cluster benchmark, {date}",
        "",
        "Three Ray nodes on one machine, one engine each, two gateways; fake models",
        "whose batches sleep. Rerun:",
        "`HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/cluster_bench.py`.",
        "",
        "| figure | measured | bar |",
        "|---|---|---|",
        *(f"| {name} | {value} | {bar} |" for name, value, bar in rows),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--qps-seconds", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument(
        "--table-of", type=Path, help="Print the table of a run's JSON again; run nothing."
    )
    args = parser.parse_args()
    if args.table_of is not None:
        stem = args.table_of.with_suffix("")
        date = stem.name.removeprefix("cluster-")[:10]
        text = markdown(json.loads(args.table_of.read_text()), date)
        stem.with_suffix(".md").write_text(text)
        print(text)
        return
    with tempfile.TemporaryDirectory(prefix="tessera-cluster-") as tmp:
        figures = deploy_and_run(Path(tmp), args.qps_seconds)
    date = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = output_stem(args.out, date, "cluster")
    text = markdown(figures, date)
    stem.with_suffix(".json").write_text(json.dumps(figures, indent=2))
    stem.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
