"""Worker-process overhead: the native models (speech, translation, OCR)
inline against ``isolation: process``, side by side in one run.

    HF_HUB_OFFLINE=1 nice .venv/bin/python benchmarks/isolation_bench.py [--threads 1] \
        [--reps 20] [--out benchmarks/results]

Each model is loaded with its adapter's loader in a fresh process of its own
(one after the other, so that they never share the cores), once inline and
once in a worker (``runtimes/isolated.py``), with the same thread count, and
reports: the bytes the model holds (inline: the resident-set growth of the
process around the load and a warm-up batch; isolated: the worker's resident
set, its interpreter included, and what still grows in the server beside it),
the load seconds, and the p50 seconds per batch for a batch of one item and a
batch of the card's ``max_batch_size`` (the engine's warm-up items: a short
sentence, a 160x640 page). Prints a Markdown table and writes it with the
figures to ``OUT/isolation-DATE.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODELS = ("piper-joe", "bergamot-en-pt", "pp-ocrv6")
ISOLATIONS = ("inline", "process")


def measure(name: str, isolation: str, threads: int, reps: int) -> dict[str, Any]:
    """Run in a child process: load, warm up, time batches; the figures as a dict."""
    import dataclasses

    from tessera.repository import default_repository_path, read_spec
    from tessera.runtimes.base import standalone_context
    from tessera.runtimes.isolated import IsolatedLoader
    from tessera.runtimes.memory import rss_bytes, trim_heap
    from tessera.runtimes.registry import get_loader
    from tessera.tasks.samples import warmup_items

    spec = dataclasses.replace(read_spec(default_repository_path() / name), isolation=isolation)
    loader = IsolatedLoader(spec.adapter) if isolation == "process" else get_loader(spec.adapter)
    large = spec.batching.max_batch_size
    small_items, large_items = warmup_items(spec.task, 1), warmup_items(spec.task, large)
    trim_heap()
    rss_before = rss_bytes()
    start = time.perf_counter()
    model = loader.load(spec, standalone_context(threads))
    load_s = time.perf_counter() - start
    try:
        model.run(large_items)  # warm-up
        trim_heap()
        footprint = model.memory()
        growth = rss_bytes() - rss_before

        def p50(items: list[Any], num: int) -> float:
            seconds = []
            for _ in range(num):
                begun = time.perf_counter()
                model.run(items)
                seconds.append(time.perf_counter() - begun)
            return statistics.median(seconds)

        small_s, large_s = p50(small_items, reps), p50(large_items, max(3, reps // 4))
    finally:
        model.unload()
    return {
        "load_s": load_s,
        "bytes": growth if isolation == "inline" else footprint.own_bytes,
        "method": "server rss growth" if isolation == "inline" else footprint.method,
        "server_rss_growth_bytes": growth,
        "small_batch": 1,
        "large_batch": large,
        "p50_small_s": small_s,
        "p50_large_s": large_s,
    }


def run_child(name: str, isolation: str, threads: int, reps: int) -> dict[str, Any]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import isolation_bench as b; "
        "print(json.dumps(b.measure(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))"
    )
    here = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", code, here, name, isolation, str(threads), str(reps)],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def table(rows: list[dict[str, Any]], threads: int) -> str:
    lines = [
        f"{threads} thread(s); p50 per batch of 1 and of the card's max_batch_size\n",
        "| model | isolation | load s | bytes (MiB) | measured as | server RSS growth (MiB) "
        "| p50 batch of 1 (ms) | p50 large batch (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['isolation']} | {r['load_s']:.2f} | {r['bytes'] / 2**20:.0f} "
            f"| {r['method']} | {r['server_rss_growth_bytes'] / 2**20:.0f} "
            f"| {r['p50_small_s'] * 1000:.1f} | {r['p50_large_s'] * 1000:.1f} "
            f"(batch of {r['large_batch']}) |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows = [
        {"model": name, "isolation": how, **run_child(name, how, args.threads, args.reps)}
        for name in MODELS
        for how in ISOLATIONS
    ]
    text = table(rows, args.threads)
    print(text)
    date = datetime.date.today().isoformat()
    base = args.out / f"isolation-{date}"
    rerun = "HF_HUB_OFFLINE=1 nice .venv/bin/python benchmarks/isolation_bench.py"
    base.with_suffix(".md").write_text(
        f"# Worker-process overhead: inline vs isolation: process, {date}\n\n"
        f"Rerun: `{rerun} --threads {args.threads} --reps {args.reps}`\n\n{text}"
    )
    machine = {"cpus": os.cpu_count(), "platform": platform.platform()}
    report = {"date": date, "threads": args.threads, "reps": args.reps, "machine": machine}
    base.with_suffix(".json").write_text(json.dumps({**report, "rows": rows}, indent=2) + "\n")
    print(f"wrote {base}.md and .json")


if __name__ == "__main__":
    main()
