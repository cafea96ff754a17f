"""A weight-only int8 ONNX model served as it is (onnxruntime folds its weights
to fp32) against served rewritten so that its weights stay int8
(``tessera.runtimes.onnx_quant``), side by side in one run.

    HF_HUB_OFFLINE=1 nice .venv/bin/python benchmarks/int8_onnx_bench.py \
        [--model all-minilm-l6-v2-int8] [--rounds 3] [--out benchmarks/results]

Each variant loads the model through its adapter (``onnx-encoder``) in a fresh
process of its own, one after the other, at 1 thread, ``rounds`` times over
(figures are medians over rounds; the machine is shared and noisy):

- ``as is``: option ``run_quantised: false``, the graph as it is;
- ``int8, rewrite``: the rewrite made at this load, into an empty cache folder;
- ``int8, cached``: the rewrite read back from that folder by a second load;
- ``int8 activations``: option ``int8_activations: true`` (MatMulNBits'
  accuracy level 4: the activations quantised too; answers not the same).

Reported per variant: the bytes the model reports (``runtimes.memory``'s rss
delta around load and warm-up) and the process's anonymous resident growth
(``RssAnon``, heap trimmed) over the same span; the load's seconds (the
tokenizer's included; the rewrite's too for ``int8, rewrite``); the
median seconds of a batch of 1 and of 32 sentences (tokenization included);
and the cosine similarity of its embeddings of 48 sentences to ``as is``'s
(min and mean). Prints a Markdown table and writes it with the figures to
``OUT/int8-onnx-DATE[-N].{md,json}`` (never overwritten).
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
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.report import output_stem

MIB = 2**20
VARIANTS: dict[str, dict[str, Any]] = {
    "as is": {"run_quantised": False},
    "int8, rewrite": {},
    "int8, cached": {},
    "int8 activations": {"int8_activations": True},
}
SUBJECTS = ("The train", "A small dog", "My grandmother", "The committee", "An old ship", "Rain")
ACTIONS = (
    "arrived late this morning.",
    "is waiting by the door for someone to come home.",
    "decided to postpone the vote until next spring.",
    "sank near the harbour during the storm of 1912.",
    "makes the streets smell of wet stone and coffee.",
    "cannot find the keys it lost yesterday.",
    "was mentioned in a report about renewable energy prices.",
    "?",
)
SENTENCES = [f"{s} {a}" for s in SUBJECTS for a in ACTIONS]


def rss_anon() -> int:
    """The process's anonymous resident bytes, after handing freed heap pages back."""
    from tessera.runtimes.memory import trim_heap

    trim_heap()
    with open("/proc/self/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name == "RssAnon":
                return int(rest.split()[0]) * 1024
    return 0


def measure(name: str, options: dict[str, Any], cache_dir: str, reps: int) -> dict[str, Any]:
    """Run in a child process: one variant's figures, as a dict."""
    from dataclasses import replace

    import numpy as np
    import onnxruntime  # noqa: F401  (its pages are not the model's)
    import transformers  # noqa: F401

    from tessera.repository import default_repository_path, read_spec
    from tessera.runtimes.base import standalone_context
    from tessera.runtimes.memory import Measured, measure_rss
    from tessera.runtimes.registry import get_loader
    from tessera.tasks.types import TextInput

    spec = read_spec(default_repository_path() / name)
    spec = replace(spec, options={**spec.options, **options})
    anon: list[int] = []

    def measure_anon(build: Callable[[], Any]) -> Measured:
        # Around the same span as the reported bytes (session and warm-up), not the tokenizer.
        before = rss_anon()
        measured = measure_rss(build)
        anon.append(rss_anon() - before)
        return measured

    ctx = replace(standalone_context(threads=1), cache_dir=Path(cache_dir), measure=measure_anon)
    loader = get_loader(spec.adapter)
    start = time.perf_counter()
    model = loader.load(spec, ctx)
    load_s = time.perf_counter() - start
    (anon_delta,) = anon
    footprint = model.memory()
    items = [TextInput(s) for s in SENTENCES]

    def timed(batch: list[TextInput], n: int) -> float:
        model.run(batch)
        times = []
        for _ in range(n):
            t = time.perf_counter()
            model.run(batch)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    batch_1 = timed(items[:1], 5 * reps)
    batch_32 = timed(items[:32], reps)
    vectors = np.stack(model.run(items))
    model.unload()
    return {
        "own_bytes": footprint.own_bytes,
        "method": footprint.method,
        "estimate_bytes": loader.estimate_bytes(spec),
        "rss_anon_delta": anon_delta,
        "load_s": load_s,
        "batch_1_s": batch_1,
        "batch_32_s": batch_32,
        "vectors": vectors.tolist(),
    }


def run_child(name: str, options: dict[str, Any], cache_dir: Path, reps: int) -> dict[str, Any]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import int8_onnx_bench as b; "
        "print(json.dumps(b.measure(sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], "
        "int(sys.argv[5]))))"
    )
    here = str(Path(__file__).parent)
    args = [here, name, json.dumps(options), str(cache_dir), str(reps)]
    out = subprocess.run(
        [sys.executable, "-c", code, *args], check=True, capture_output=True, text=True
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def cosines(a: list[list[float]], b: list[list[float]]) -> list[float]:
    import numpy as np

    x, y = np.asarray(a), np.asarray(b)
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    y = y / np.linalg.norm(y, axis=1, keepdims=True)
    return [float(c) for c in (x * y).sum(axis=1)]


def summarise(runs: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, Any]:
    median = statistics.median
    keys = ("own_bytes", "rss_anon_delta", "load_s", "batch_1_s", "batch_32_s")
    row: dict[str, Any] = {key: median(r[key] for r in runs) for key in keys}
    row["all"] = {key: [r[key] for r in runs] for key in keys}
    sims = [
        c for r, b in zip(runs, baseline, strict=True) for c in cosines(r["vectors"], b["vectors"])
    ]
    row["cosine_min"], row["cosine_mean"] = min(sims), statistics.fmean(sims)
    row["method"] = runs[-1]["method"]
    row["estimate_bytes"] = runs[-1]["estimate_bytes"]
    return row


def table(rows: dict[str, dict[str, Any]], name: str, rounds: int) -> str:
    lines = [
        f"{name}, 1 thread; medians over {rounds} rounds, each variant in a fresh process\n",
        "| variant | reported bytes (MiB) | RssAnon growth (MiB) | estimate (MiB) | load s "
        "| batch 1 ms | batch 32 ms | cosine to as is, min / mean | method |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, r in rows.items():
        lines.append(
            f"| {variant} | {r['own_bytes'] / MIB:.1f} | {r['rss_anon_delta'] / MIB:.1f} "
            f"| {r['estimate_bytes'] / MIB:.1f} | {r['load_s']:.2f} "
            f"| {r['batch_1_s'] * 1000:.1f} | {r['batch_32_s'] * 1000:.0f} "
            f"| {r['cosine_min']:.6f} / {r['cosine_mean']:.6f} | {r['method']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="all-minilm-l6-v2-int8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=7, help="batches of 32 timed (5x of 1)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in VARIANTS}
    for n in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="int8-bench-") as tmp:
            caches = {
                v: Path(tmp) / ("activations" if "activations" in v else "weights")
                for v in VARIANTS
            }
            for variant, options in VARIANTS.items():
                runs[variant].append(run_child(args.model, options, caches[variant], args.reps))
        print(f"round {n + 1}: done", file=sys.stderr)
    baseline = runs["as is"]
    rows = {variant: summarise(r, baseline) for variant, r in runs.items()}
    text = table(rows, args.model, args.rounds)
    print(text)
    date = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = output_stem(args.out, date, "int8-onnx")
    rerun = "HF_HUB_OFFLINE=1 nice .venv/bin/python benchmarks/int8_onnx_bench.py"
    stem.with_suffix(".md").write_text(
        f"# Weight-only int8 ONNX: served as it is vs with int8 weights kept, {date}\n\n"
        f"Rerun: `{rerun} --model {args.model} --rounds {args.rounds} --reps {args.reps}`\n\n"
        f"{text}"
    )
    machine = {"cpus": os.cpu_count(), "platform": platform.platform()}
    report = {"date": date, "model": args.model, "rounds": args.rounds, "machine": machine}
    stem.with_suffix(".json").write_text(json.dumps({**report, "rows": rows}, indent=2) + "\n")
    print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
