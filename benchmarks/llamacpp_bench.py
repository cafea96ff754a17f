"""smollm2-135m: the external llama.cpp engine against in-process transformers.

    HF_HUB_OFFLINE=1 nice .venv/bin/python benchmarks/llamacpp_bench.py [--threads 1] \
        [--skip-transformers] [--out benchmarks/results]

The first is ``runtime: external``, ``engine: llamacpp`` (its card as shipped);
the second ``hf-causal-lm`` (transformers dequantises the same GGUF to fp32).

Each adapter loads the packaged SmolLM2-135M-Instruct Q4_1 GGUF in a process of
its own (one after the other, so that they never share the cores) with the
same thread count, and reports: load seconds (transformers: a cold conversion
of the GGUF, then a load from its converted cache), the bytes the runtime
reports and how it measured them, the resident-set growth of the process that
holds the weights, time to first token, and decode tokens/s for one greedy
answer of 64 tokens and for a batch of 4. Prints a Markdown table and writes
it with the figures to ``OUT/external-llamacpp-DATE.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

QUESTION = "Which city is the capital of France?"
STORY = "Write a short story about a lighthouse keeper."
NUM_TOKENS = 64


def measure(adapter: str, threads: int, cache_dir: str | None) -> dict[str, Any]:
    """Run in a child process: load, then generate; the figures as a dict."""
    import dataclasses

    from tessera.repository import default_repository_path, read_spec
    from tessera.runtimes.base import standalone_context
    from tessera.runtimes.memory import rss_bytes, trim_heap
    from tessera.runtimes.registry import get_loader
    from tessera.tasks.types import ChatInput, ChatMessage

    spec = read_spec(default_repository_path() / "smollm2-135m")
    if adapter == "hf-causal-lm":
        import torch

        torch.set_num_threads(threads)
        spec = dataclasses.replace(spec, runtime="torch", adapter=adapter)
    ctx = dataclasses.replace(
        standalone_context(threads), cache_dir=Path(cache_dir) if cache_dir else None
    )
    loader = get_loader(spec.adapter)
    trim_heap()
    rss_before = rss_bytes()
    start = time.perf_counter()
    model = loader.load(spec, ctx)
    load_s = time.perf_counter() - start

    def chat(text: str, **kwargs: Any) -> ChatInput:
        return ChatInput(messages=(ChatMessage("user", text),), **kwargs)

    answer = model.run([chat(QUESTION, max_tokens=16)])[0].text  # also a warm-up
    first: list[float] = []
    item = chat(STORY, max_tokens=NUM_TOKENS, on_text=lambda _: first.append(time.perf_counter()))
    start = time.perf_counter()
    (one,) = model.run([item])
    one_s = time.perf_counter() - start
    first_token_s = first[0] - start
    batch = [chat(STORY + f" Number {i}.", max_tokens=NUM_TOKENS) for i in range(4)]
    start = time.perf_counter()
    outputs = model.run(batch)
    batch_s = time.perf_counter() - start
    report = model.memory()
    trim_heap()
    figures = {
        "adapter": adapter,
        "load_s": load_s,
        "bytes": report.own_bytes,
        "method": report.method,
        "server_rss_growth_bytes": rss_bytes() - rss_before,
        "answer": answer,
        "first_token_s": first_token_s,
        "one_tokens_per_s": one.completion_tokens / one_s,
        "batch_tokens_per_s": sum(o.completion_tokens for o in outputs) / batch_s,
    }
    model.unload()
    return figures


def run_child(adapter: str, threads: int, cache_dir: str | None) -> dict[str, Any]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import llamacpp_bench as b; "
        "print(json.dumps(b.measure(sys.argv[2], int(sys.argv[3]), sys.argv[4] or None)))"
    )
    here = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", code, here, adapter, str(threads), cache_dir or ""],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def table(rows: list[tuple[str, dict[str, Any]]], threads: int) -> str:
    lines = [
        f"smollm2-135m, {threads} thread(s), {NUM_TOKENS} new tokens\n",
        "| runtime | load s | bytes (MiB) | measured as | server RSS growth (MiB) "
        "| first token s | tok/s (1) | tok/s (batch 4) | answer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {r['load_s']:.2f} | {r['bytes'] / 2**20:.0f} | {r['method']} "
            f"| {r['server_rss_growth_bytes'] / 2**20:.0f} | {r['first_token_s']:.3f} "
            f"| {r['one_tokens_per_s']:.1f} | {r['batch_tokens_per_s']:.1f} | {r['answer']!r} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows: list[tuple[str, dict[str, Any]]] = []
    rows.append(("external llamacpp", run_child("external", args.threads, None)))
    if not args.skip_transformers:
        with tempfile.TemporaryDirectory() as cache:
            rows.append(("hf-causal-lm (cold)", run_child("hf-causal-lm", args.threads, cache)))
            rows.append(("hf-causal-lm (cached)", run_child("hf-causal-lm", args.threads, cache)))
    text = table(rows, args.threads)
    print(text)
    date = datetime.date.today().isoformat()
    base = args.out / f"external-llamacpp-{date}"
    rerun = "HF_HUB_OFFLINE=1 nice .venv/bin/python benchmarks/llamacpp_bench.py"
    base.with_suffix(".md").write_text(
        f"# External llama.cpp engine vs in-process transformers, {date}\n\n"
        f"Rerun: `{rerun} --threads {args.threads}`\n\n{text}"
    )
    machine = {"cpus": os.cpu_count(), "platform": platform.platform()}
    figures = {"date": date, "threads": args.threads, "num_tokens": NUM_TOKENS}
    report = {**figures, "machine": machine, "rows": [{"name": n, **r} for n, r in rows]}
    base.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {base}.md and .json")


if __name__ == "__main__":
    main()
