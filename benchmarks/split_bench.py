"""One process against the process split (an engine process and N gateway
processes), on one model, side by side in rounds.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/split_bench.py \
        [--gateways 0 1 2] [--rounds 3] [--concurrency 64] [--requests 2000] \
        [--out benchmarks/results]

For each round, for each ``--gateways`` figure in turn (0: one process, the
gateway in the engine's), one ``tessera serve --gateways N`` with only
``all-minilm-l6-v2`` (no keys), a warm-up of 200 requests, then ``tessera
bench``: one sentence a request, a closed loop of ``--concurrency`` callers
for ``--requests`` requests, then one caller for 300 (the latency the extra
hop adds). Reports each run and, per configuration, the median over rounds
and its ratio to one process in the same rounds. Writes
``OUT/process-split-DATE[-N].{md,json}``. What it says is this machine's: on
two cores the engine's batches want both, and a gateway process takes
from them what it saves the engine's event loop.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psutil

from harness.probes import cpu_seconds
from harness.report import write_report
from harness.servers import running_tessera, tessera_command

MODEL = "all-minilm-l6-v2"


def bench(url: str, out: Path, concurrency: int, requests: int) -> dict[str, Any]:
    subprocess.run(
        [*tessera_command(), "bench", "--model", MODEL, "--url", url,
         "--concurrency", str(concurrency), "--requests", str(requests),
         "--duration", "120", "--out", str(out)],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def cpu_split(engine: psutil.Process) -> dict[str, float]:
    """CPU seconds so far of the server's process (the engine process, or the
    one process) and of its gateway processes together."""
    own = cpu_seconds([engine])
    children = cpu_seconds(engine.children())
    return {"engine": sum(own.values()), "gateways": sum(children.values())}


def markdown(runs: list[dict[str, Any]], summary: dict[str, Any], date: str, args: Any) -> str:
    lines = [
        f"# Process split, {date}",
        "",
        f"`{MODEL}`, one sentence a request; each round starts one server per",
        f"configuration in turn. c={args.concurrency}: {args.requests} requests;",
        "c=1: 300. Rerun: `HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/split_bench.py`.",
        "",
        "| round | gateways | req/s | p50 ms | p99 ms | failed | c=1 p50 ms | c=1 p99 ms"
        " | engine CPU ms/req | gateways CPU ms/req |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        load, one = run["load"], run["one"]
        lines.append(
            f"| {run['round']} | {run['gateways']} | {load['req_per_s']:.0f}"
            f" | {load['p50_ms']:.1f} | {load['p99_ms']:.1f} | {load['failed']}"
            f" | {one['p50_ms']:.1f} | {one['p99_ms']:.1f}"
            f" | {run['cpu_ms_per_request']['engine']:.2f}"
            f" | {run['cpu_ms_per_request']['gateways']:.2f} |"
        )
    lines += [
        "",
        "Medians over the rounds, and the median of each round's ratio to one process:",
        "",
        "| gateways | req/s | ratio | p99 ms | c=1 p50 ms | c=1 p50 ratio | engine CPU ms/req |",
        "|---|---|---|---|---|---|---|",
    ]
    for gateways, s in summary.items():
        lines.append(
            f"| {gateways} | {s['req_per_s']:.0f} | {s['throughput_ratio']:.2f}"
            f" | {s['p99_ms']:.1f} | {s['c1_p50_ms']:.1f} | {s['c1_p50_ratio']:.2f}"
            f" | {s['engine_cpu_ms']:.2f} |"
        )
    return "\n".join([*lines, ""])


def summarise(runs: list[dict[str, Any]], configs: list[int]) -> dict[str, Any]:
    base = {r["round"]: r for r in runs if r["gateways"] == configs[0]}
    summary: dict[str, Any] = {}
    for gateways in configs:
        mine = [r for r in runs if r["gateways"] == gateways]
        summary[str(gateways)] = {
            "req_per_s": statistics.median(r["load"]["req_per_s"] for r in mine),
            "p99_ms": statistics.median(r["load"]["p99_ms"] for r in mine),
            "c1_p50_ms": statistics.median(r["one"]["p50_ms"] for r in mine),
            "engine_cpu_ms": statistics.median(r["cpu_ms_per_request"]["engine"] for r in mine),
            "throughput_ratio": statistics.median(
                r["load"]["req_per_s"] / base[r["round"]]["load"]["req_per_s"] for r in mine
            ),
            "c1_p50_ratio": statistics.median(
                r["one"]["p50_ms"] / base[r["round"]]["one"]["p50_ms"] for r in mine
            ),
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gateways", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tessera-split-") as tmp:
        work = Path(tmp)
        for round_ in range(1, args.rounds + 1):
            for gateways in args.gateways:
                slug = f"r{round_}-g{gateways}"
                config = work / f"{slug}.yaml"
                config.write_text(json.dumps({"preload": [MODEL], "gateways": gateways}))
                with running_tessera(work, slug, ["--config", str(config), "--no-auth"]) as srv:
                    bench(srv.base_url, work / f"{slug}-warm.json", 8, 200)
                    engine = psutil.Process(srv.process.pid)
                    before = cpu_split(engine)
                    load = bench(
                        srv.base_url, work / f"{slug}.json", args.concurrency, args.requests
                    )
                    after = cpu_split(engine)
                    one = bench(srv.base_url, work / f"{slug}-c1.json", 1, 300)
                answered = max(1, load["ok"])
                cpu = {k: 1000 * (after[k] - before[k]) / answered for k in after}
                runs.append(
                    {"round": round_, "gateways": gateways, "load": load, "one": one,
                     "cpu_ms_per_request": cpu}
                )  # fmt: skip
                print(f"round {round_}, gateways {gateways}: {load['req_per_s']:.0f} req/s,"
                      f" c=1 p50 {one['p50_ms']:.1f} ms, CPU ms/request: engine"
                      f" {cpu['engine']:.2f}, gateways {cpu['gateways']:.2f}",
                      flush=True)  # fmt: skip
    summary = summarise(runs, args.gateways)
    date = datetime.date.today().isoformat()
    figures = {"runs": runs, "summary": summary}
    write_report(args.out, date, "process-split", figures, markdown(runs, summary, date, args))


if __name__ == "__main__":
    main()
