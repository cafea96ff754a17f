"""Batching across models on this machine: forwards of several MiniLMs one by
one against stacked (``runtimes/stacking.py``), side by side in rounds.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/stack_bench.py \
        [--models 2 4] [--seconds 5] [--rounds 3] [--out benchmarks/results]

For each ``--models`` figure N: N copies of ``all-minilm-l6-v2`` (separate
modules, as N tenants' fine-tunes would be), N threads, each calling its
model's forward on one sentence in a loop for ``--seconds``, torch with one
intra-op thread each (the engine's share per worker here): first each
model's own forward (``alone``), then every forward through one stack
group (``stacked``: threads that meet are answered by one vmapped forward).
Reports model-forwards a second of each and the ratio, per round, and
writes ``OUT/stack-cpu-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from harness.report import write_report
from tessera.repository import default_repository_path, read_spec
from tessera.runtimes.graph_runner import run_eager
from tessera.runtimes.hf import SentenceEncoder
from tessera.runtimes.stacking import StackGroup

SENTENCE = "A quick note on serving many small models from one device."


def rate(encoders: list[SentenceEncoder], group: StackGroup | None, seconds: float) -> float:
    """Model-forwards a second from one thread per encoder."""
    counts = [0] * len(encoders)
    stop = time.perf_counter() + seconds

    def work(index: int) -> None:
        encoder = encoders[index]
        batch = encoder.tokenize([SENTENCE], 64)
        own = functools.partial(run_eager, encoder.model, "last_hidden_state")
        with torch.inference_mode():
            while time.perf_counter() < stop:
                if group is None:
                    own(batch)
                else:
                    group.forward(encoder.model, batch, own)
                counts[index] += 1

    began = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(encoders))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = read_spec(default_repository_path() / "all-minilm-l6-v2").resolve_source()
    runs: list[dict[str, Any]] = []
    for count in args.models:
        encoders = [SentenceEncoder.from_folder(folder, "cpu") for _ in range(count)]
        for round_ in range(1, args.rounds + 1):
            alone = rate(encoders, None, args.seconds)
            group = StackGroup(f"bench-{count}-{round_}", count)
            stacked = rate(encoders, group, args.seconds)
            run = {"models": count, "round": round_, "alone": alone, "stacked": stacked}
            run["stacked_rounds"] = group.num_rounds
            runs.append(run)
            print(f"{count} models, round {round_}: alone {alone:.0f}/s, stacked {stacked:.0f}/s"
                  f" ({group.num_rounds} stacked rounds)", flush=True)  # fmt: skip
        for encoder in encoders:
            encoder.close()
    date = datetime.date.today().isoformat()
    lines = [
        f"# Stacked forwards on the CPU, {date}",
        "",
        "MiniLM copies, one thread each, one sentence a forward, one intra-op thread.",
        "Rerun: `HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/stack_bench.py`.",
        "",
        "| models | round | alone forwards/s | stacked forwards/s | ratio | stacked rounds |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['models']} | {r['round']} | {r['alone']:.0f} | {r['stacked']:.0f}"
            f" | {r['stacked'] / r['alone']:.2f} | {r['stacked_rounds']} |"
            for r in runs
        ),
        "",
    ]
    for count in args.models:
        ratios = [r["stacked"] / r["alone"] for r in runs if r["models"] == count]
        lines.append(f"{count} models: median ratio {statistics.median(ratios):.2f}.")
    write_report(args.out, date, "stack-cpu", runs, "\n".join([*lines, ""]))


if __name__ == "__main__":
    main()
