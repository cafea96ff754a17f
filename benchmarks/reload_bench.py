"""Reloads from files against reloads from the host tier (issue 9, item 3: a
reload is a copy, not a parse), every default model, side by side in one run.

    HF_HUB_OFFLINE=1 nice .venv/bin/python benchmarks/reload_bench.py [--threads 1] \
        [--reps 7] [--models NAME ...] [--no-cache] [--out benchmarks/results]

Each model runs in a fresh process of its own (one after the other, so that
they never share the cores), through the engine's own ``EngineHost`` with a
cache folder of its own, empty at the start, as a server has one under its
data folder (``--no-cache``: none): a first load (measured and warmed up, as
the engine's is, and filling the cache), then ``reps`` rounds, each
of which evicts the model and brings it back twice, one way after the other:

- from files: ``unload`` then ``load``, the engine's reload (not measured nor
  warmed up again): read the configs, build the tokenizer and the modules,
  open or parse the weights;
- from the host tier: ``offload`` then ``restore``, for a model that can wait
  there (``runtimes.base.OffloadingModel``: the torch adapters); the ONNX,
  native and external ones cannot, and show "-";
- and, for a Hugging Face folder (adapters ``hf-encoder`` and
  ``hf-sequence-classifier``), what a user's own code does with the same
  folder: transformers' ``AutoTokenizer.from_pretrained`` and
  ``AutoModel.from_pretrained`` (or ``AutoModelForSequenceClassification``),
  local files only, in the same process between the engine's reloads.

Reported per model: the median seconds of each kind of reload and their ratio,
the median seconds of the first batch after each (one warm-up item: on CPU it
pays for the page faults of mapped weights either way), whether the answers
after a reload from the tier equal those before any eviction, the bytes the
tier reports holding and how, and the process's anonymous and file-backed
resident memory with the model resident, in the tier, and unloaded. Both
kinds of reload read a warm page cache here (the files were just read); after
memory pressure both would read the disk. Prints a Markdown table and writes
it with the figures to ``OUT/reload-DATE[-N].{md,json}`` (never overwritten).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.report import output_stem

MODELS = (
    "all-minilm-l6-v2",
    "minilm-rerank",
    "intent-minilm",
    "all-minilm-l6-v2-int8",
    "bergamot-en-pt",
    "bergamot-pt-en",
    "piper-joe",
    "pp-ocrv6",
    "smollm2-135m",
)
MIB = 2**20
# Adapters whose source is a Hugging Face folder: the transformers class a
# user would load it with.
FROM_PRETRAINED = {
    "hf-encoder": "AutoModel",
    "hf-sequence-classifier": "AutoModelForSequenceClassification",
}


def from_pretrained(folder: Path, auto: str) -> None:
    """Load ``folder`` as a user would with transformers: tokenizer and model."""
    import transformers

    transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    getattr(transformers, auto).from_pretrained(str(folder), local_files_only=True).eval()


def resident_mib() -> dict[str, float]:
    """The process's anonymous and file-backed resident memory (MiB), after
    handing freed heap pages back."""
    from tessera.runtimes.memory import trim_heap

    trim_heap()
    fields: dict[str, float] = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in ("RssAnon", "RssFile"):
                fields[name] = int(rest.split()[0]) / 1024
    return fields


async def measure(name: str, threads: int, reps: int, cache: bool) -> dict[str, Any]:
    """Run in a child process: the figures of one model, as a dict."""
    from tessera.device import CpuDevice
    from tessera.engine.executor import ComputeExecutor
    from tessera.engine.host import EngineHost
    from tessera.repository import default_repository_path, read_spec
    from tessera.residency import ActivationBook
    from tessera.runtimes.base import OffloadingModel
    from tessera.tasks.samples import warmup_items

    spec = read_spec(default_repository_path() / name)
    device = CpuDevice()
    executor = ComputeExecutor(device, threads, 1)
    cache_dir = Path(tempfile.mkdtemp(prefix="reload-cache-")) if cache else None
    host = EngineHost(device, executor, ActivationBook(), cache_dir=cache_dir)
    items = warmup_items(spec.task, 1)
    try:
        start = time.perf_counter()
        model = await host.load(spec)
        first_load_s = time.perf_counter() - start
        reference = pickle.dumps(model.run(items))
        in_tier = isinstance(model, OffloadingModel)
        auto = FROM_PRETRAINED.get(spec.adapter)
        files_s, tier_s, batch_files_s, batch_tier_s, pretrained_s = [], [], [], [], []
        same, held, memory = True, None, {"resident": resident_mib()}
        for _ in range(reps):
            await host.unload(spec, model)
            start = time.perf_counter()
            model = await host.load(spec)
            files_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            model.run(items)
            batch_files_s.append(time.perf_counter() - start)
            if auto is not None:
                start = time.perf_counter()
                from_pretrained(spec.resolve_source(), auto)
                pretrained_s.append(time.perf_counter() - start)
            if not in_tier:
                continue
            held = await host.offload(spec, model)
            memory["in the host tier"] = resident_mib()
            start = time.perf_counter()
            restored = await host.restore(spec)
            tier_s.append(time.perf_counter() - start)
            if restored is None:
                raise RuntimeError(f"{name} did not come back from the host tier")
            model = restored
            start = time.perf_counter()
            same = same and pickle.dumps(model.run(items)) == reference
            batch_tier_s.append(time.perf_counter() - start)
        await host.unload(spec, model)
        memory["unloaded"] = resident_mib()
    finally:
        host.shutdown()
        executor.shutdown()
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)
    median = statistics.median
    return {
        "model": name,
        "adapter": spec.adapter,
        "runtime": spec.runtime,
        "in_tier": in_tier,
        "first_load_s": first_load_s,
        "files_reload_s": median(files_s),
        "files_reload_all_s": files_s,
        "tier_reload_s": median(tier_s) if tier_s else None,
        "tier_reload_all_s": tier_s,
        "ratio": median(files_s) / median(tier_s) if tier_s else None,
        "from_pretrained_s": median(pretrained_s) if pretrained_s else None,
        "from_pretrained_all_s": pretrained_s,
        "first_batch_after_files_s": median(batch_files_s),
        "first_batch_after_tier_s": median(batch_tier_s) if batch_tier_s else None,
        "same_answers_after_tier": same if in_tier else None,
        "host_bytes": held.total_bytes if held is not None else None,
        "host_method": held.method if held is not None else None,
        "resident_mib": memory,
    }


def run_child(name: str, threads: int, reps: int, cache: bool) -> dict[str, Any]:
    code = (
        "import asyncio, json, sys; sys.path.insert(0, sys.argv[1]); import reload_bench as b; "
        "a = sys.argv[2:]; "
        "print(json.dumps(asyncio.run(b.measure(a[0], int(a[1]), int(a[2]), a[3] == 'cache'))))"
    )
    here = str(Path(__file__).parent)
    kind = "cache" if cache else "none"
    out = subprocess.run(
        [sys.executable, "-c", code, here, name, str(threads), str(reps), kind],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _s(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(rows: list[dict[str, Any]], threads: int, reps: int, cache: bool) -> str:
    folder = "a cache folder" if cache else "no cache folder"
    lines = [
        f"{threads} thread(s), {folder}; medians of {reps} reloads each way,"
        " one way after the other\n",
        "| model | runtime | first load s | reload from files s | from the host tier s "
        "| files / tier | transformers' from_pretrained s | files / from_pretrained "
        "| first batch after, files / tier (ms) | host tier holds (MiB) | same answers |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | | failed: {r['error']} | | | | | | | | |")
            continue
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.0f}x"
        pretrained = r.get("from_pretrained_s")
        versus = "-" if pretrained is None else f"{r['files_reload_s'] / pretrained:.2f}"
        held = "-" if r["host_bytes"] is None else f"{r['host_bytes'] / MIB:.1f}"
        same = {None: "-", True: "yes", False: "no"}[r["same_answers_after_tier"]]
        lines.append(
            f"| {r['model']} | {r['runtime']} ({r['adapter']}) | {r['first_load_s']:.2f} "
            f"| {_s(r['files_reload_s'])} | {_s(r['tier_reload_s'], digits=4)} | {ratio} "
            f"| {_s(pretrained)} | {versus} "
            f"| {_s(r['first_batch_after_files_s'], 1000, 1)} / "
            f"{_s(r['first_batch_after_tier_s'], 1000, 1)} | {held} | {same} |"
        )
    lines += [
        "",
        "Resident memory of the model's process (MiB, anonymous / file-backed), trimmed:",
        "",
        "| model | resident | in the host tier | unloaded | the tier holds it as |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r or not r["in_tier"]:
            continue
        memory = r["resident_mib"]

        def pair(state: str, memory: dict[str, dict[str, float]] = memory) -> str:
            found = memory.get(state)
            return "-" if found is None else f"{found['RssAnon']:.0f} / {found['RssFile']:.0f}"

        lines.append(
            f"| {r['model']} | {pair('resident')} | {pair('in the host tier')} "
            f"| {pair('unloaded')} | {r['host_method']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--no-cache", action="store_true", help="load without a cache folder")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for name in args.models:
        try:
            rows.append(run_child(name, args.threads, args.reps, not args.no_cache))
        except subprocess.CalledProcessError as e:
            cause = (e.stderr or "").strip().splitlines()[-1:] or ["no output"]
            rows.append({"model": name, "error": cause[0]})
        print(f"{name}: done", file=sys.stderr)
    text = table(rows, args.threads, args.reps, not args.no_cache)
    print(text)
    date = datetime.date.today().isoformat()
    stem = output_stem(args.out, date, "reload")
    rerun = "HF_HUB_OFFLINE=1 nice .venv/bin/python benchmarks/reload_bench.py"
    models = "" if args.models == list(MODELS) else f" --models {' '.join(args.models)}"
    stem.with_suffix(".md").write_text(
        f"# Reloads from files vs from the host tier, {date}\n\n"
        f"Rerun: `{rerun} --threads {args.threads} --reps {args.reps}{models}"
        f"{' --no-cache' if args.no_cache else ''}`\n\n{text}"
    )
    machine = {"cpus": os.cpu_count(), "platform": platform.platform()}
    report = {
        "date": date,
        "threads": args.threads,
        "reps": args.reps,
        "cache": not args.no_cache,
        "machine": machine,
    }
    stem.with_suffix(".json").write_text(json.dumps({**report, "rows": rows}, indent=2) + "\n")
    print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
