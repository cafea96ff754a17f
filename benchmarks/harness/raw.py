"""The limit: a model called in-process in batches, no server.

    PYTHONPATH=benchmarks python -m harness.raw --model all-minilm-l6-v2 --threads 2 --seconds 20

Prints one JSON line: sentences/s at ``--threads`` torch threads, and at one
thread (what each of the server's batches gets when it runs one worker per
core). Run it in a subprocess of its own, so that the measuring process holds
nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.inputs import sentences
from harness.servers import SERVER_ENV, log

BATCH_SIZE = 32
# The folder that holds this package, for the subprocess to import it from.
BENCHMARKS_DIR = Path(__file__).resolve().parents[1]


def raw_throughput(
    model: Any, texts: list[str], seconds: float, max_batches: int
) -> dict[str, Any]:
    """Sentences/s of ``model.run`` over batches of 32, after a 3-batch warm-up."""
    from tessera.tasks.types import TextInput

    batches = [
        [TextInput(t) for t in texts[i : i + BATCH_SIZE]]
        for i in range(0, len(texts) - BATCH_SIZE + 1, BATCH_SIZE)
    ]
    for batch in batches[:3]:
        model.run(batch)
    done, start, own_cpu = 0, time.perf_counter(), time.process_time()
    while done < max_batches and time.perf_counter() - start < seconds:
        model.run(batches[done % len(batches)])
        done += 1
    elapsed = time.perf_counter() - start
    return {
        "cpu_cores": (time.process_time() - own_cpu) / elapsed,
        "batches": done,
        "sentences": done * BATCH_SIZE,
        "seconds": round(elapsed, 3),
        "sentences_per_s": done * BATCH_SIZE / elapsed,
        "ms_per_batch": 1000 * elapsed / max(1, done),
    }


def raw_worker(model_name: str, threads: int, seconds: float, max_batches: int) -> dict[str, Any]:
    """Load the model here and measure it at ``threads`` threads and at one."""
    import torch

    from tessera.repository import default_repository_path, read_spec
    from tessera.runtimes.base import standalone_context
    from tessera.runtimes.registry import get_loader

    torch.set_num_threads(threads)
    spec = read_spec(default_repository_path() / model_name)
    start = time.perf_counter()
    model = get_loader(spec.adapter).load(spec, standalone_context(threads=threads))
    result: dict[str, Any] = {"model": model_name, "threads": threads}
    result["load_s"] = round(time.perf_counter() - start, 2)
    texts = sentences()
    result["main"] = raw_throughput(model, texts, seconds, max_batches)
    if threads > 1:
        torch.set_num_threads(1)
        result["one_thread"] = raw_throughput(model, texts, seconds / 2, max_batches // 2)
    model.unload()
    return result


def run_raw(model: str, threads: int, seconds: float, max_batches: int) -> dict[str, Any]:
    """Run :func:`raw_worker` in a subprocess; its result and the command."""
    command = [sys.executable, "-m", "harness.raw", "--model", model]
    command += ["--threads", str(threads), "--seconds", str(seconds)]
    command += ["--batches", str(max_batches)]
    log(f"raw: {model} in a subprocess, {threads} threads")
    path = os.pathsep.join(p for p in (str(BENCHMARKS_DIR), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **SERVER_ENV, "PYTHONPATH": path}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"raw worker failed ({done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["command"] = shlex.join(command)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="A model in-process, in batches of 32.")
    parser.add_argument("--model", default="all-minilm-l6-v2")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    print(json.dumps(raw_worker(args.model, args.threads, args.seconds, args.batches)))


if __name__ == "__main__":
    main()
