"""Long work beside short work: embeddings' latency alone and beside a stream of
OCR pages and chat answers, with long work in steps and in a lane of its own,
side by side in one run.

    HF_HUB_OFFLINE=1 [nice] .venv/bin/python benchmarks/long_short_bench.py \
        [--threads 2] [--requests 150] [--rate 8] [--rounds 2] [--out benchmarks/results]

The two modes are the engine's ``long_work`` setting: ``lane``, the behaviour
before (long batches on threads of their own beside the short batches'
workers, the operating system sharing the cores at one priority), and
``steps``, the default (compute slots: short batches never wait for long
ones, which step aside at their next step boundary and run at a lower CPU
priority). Run with or without ``nice`` (the report says which): long work's
threads are niced relative to the process either way.

Each mode runs in a fresh process of its own, the modes in turn for
``--rounds`` rounds (this machine is shared and noisy: a round's two runs are
minutes apart, not hours). A run is an in-process ``Engine`` (no HTTP: the
engine's scheduling alone) with ``--threads`` threads and as many workers
(the server's defaults), serving
all-minilm-l6-v2 (the short work), pp-ocrv6 and SmolLM2-135M-Instruct
through ``hf-causal-lm`` (transformers in the server's process, whose decode
steps are steps; the shipped card runs it through llama.cpp, an engine
process of its own). A warm-up runs each model so that the run-time
predictor knows it (an unpredicted batch counts as short). Then four scenes:
embeddings alone, beside a closed loop of OCR pages (a rendered 16-line
page, 1000 x 1400), beside a closed loop of chat answers (200 new tokens,
greedy), beside both. In each, ``--requests`` embedding requests of one
sentence arrive at ``--rate`` a second (Poisson); the figures are their
latency p50/p99, where it went (p99 of the time queued in the model's
batcher; p50/p99 of the batch's run, which CPU contention lengthens; p50/p99
of the rest: waiting for a worker or a slot, and the event loop), and for the
long work its progress during the scene: pages
finished a second, and chat pieces streamed a second (about one a generated
token). Long loops are cancelled at a scene's end and 3 s pass before the next.

Prints a Markdown table and writes it with the figures to
``OUT/long-short-DATE[-N].{md,json}`` (never over an earlier run's).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

MODES = ("lane", "steps")
SCENES = ("alone", "ocr", "chat", "ocr+chat")
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank today."
STORY = "Write a short story about a robot and a cat."
CHAT_TOKENS = 200
SETTLE_S = 3.0


def page() -> Any:
    """A white page of 16 lines of dark text, 1000 x 1400, BGR uint8."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (1000, 1400), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=30)
    for i in range(16):
        draw.text(
            (40, 60 + i * 80),
            f"Item {i + 1:02d}  Widget model {7 * i}  {3.5 * i:.2f} EUR",
            font=font,
            fill="black",
        )
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8)[:, :, ::-1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class LongLoop:
    """A closed loop of one kind of long request, and when it made progress
    (a page finished, a chat piece streamed)."""

    def __init__(self, run_one: Callable[[LongLoop], Awaitable[None]]) -> None:
        self._run_one = run_one
        self.progress: list[float] = []  # perf_counter times; appended from any thread
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    def tick(self) -> None:
        self.progress.append(time.perf_counter())

    async def _loop(self) -> None:
        while True:
            await self._run_one(self)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def rate(self, start: float, end: float) -> float | None:
        """Progress a second between ``start`` and ``end``; None if it never ran."""
        if self._task is None:
            return None
        return sum(1 for t in self.progress if start <= t <= end) / (end - start)


async def scene(engine: Any, name: str, requests: int, rate: float, seed: int) -> dict[str, Any]:
    """One scene: the long loops it names, and the embedding stream beside them."""
    from tessera.engine import RequestTrace
    from tessera.tasks.types import ChatInput, ChatMessage, OcrInput, Task, TextInput

    image = page()

    async def one_page(loop: LongLoop) -> None:
        await engine.infer("pp-ocrv6", Task.OCR, [OcrInput(image, "page")])
        loop.tick()

    async def one_chat(loop: LongLoop) -> None:
        def on_text(piece: str) -> None:
            loop.tick()

        item = ChatInput((ChatMessage("user", STORY),), max_tokens=CHAT_TOKENS, on_text=on_text)
        await engine.infer("smollm2-135m", Task.GENERATE, [item])

    loops = {"ocr": LongLoop(one_page), "chat": LongLoop(one_chat)}
    running = [loops[kind] for kind in name.split("+") if kind in loops]
    for loop in running:
        loop.start()
    if running:
        await asyncio.sleep(1.0)  # the long work is under way
    latencies: list[float] = []
    queued: list[float] = []
    runs: list[float] = []
    rests: list[float] = []

    async def embed() -> None:
        trace = RequestTrace()
        begun = time.perf_counter()
        await engine.infer("all-minilm-l6-v2", Task.EMBEDDING, [TextInput(SENTENCE)], trace=trace)
        latency = time.perf_counter() - begun
        latencies.append(latency)
        queued.append(trace.queued_s)
        runs.append(trace.run_s)
        rests.append(latency - trace.queued_s - trace.run_s)

    rng = random.Random(seed)
    start = time.perf_counter()
    pending = []
    for _ in range(requests):
        pending.append(asyncio.ensure_future(embed()))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*pending)
    end = time.perf_counter()
    for loop in running:
        await loop.stop()
    await asyncio.sleep(SETTLE_S)  # a cancelled page finishes its batch meanwhile
    return {
        "scene": name,
        "seconds": end - start,
        "embed_p50_ms": 1000 * percentile(latencies, 0.50),
        "embed_p99_ms": 1000 * percentile(latencies, 0.99),
        "embed_mean_ms": 1000 * statistics.mean(latencies),
        "embed_queued_p99_ms": 1000 * percentile(queued, 0.99),
        "embed_run_p50_ms": 1000 * percentile(runs, 0.50),
        "embed_run_p99_ms": 1000 * percentile(runs, 0.99),
        "embed_rest_p50_ms": 1000 * percentile(rests, 0.50),
        "embed_rest_p99_ms": 1000 * percentile(rests, 0.99),
        "embed_requests": len(latencies),
        "pages_per_s": loops["ocr"].rate(start, end),
        "chat_pieces_per_s": loops["chat"].rate(start, end),
    }


async def measure_async(
    mode: str, threads: int, requests: int, rate: float, cache: str
) -> dict[str, Any]:
    import dataclasses

    from tessera.engine import Engine, EngineConfig
    from tessera.repository import ModelRepository, default_repository_path, read_spec
    from tessera.tasks.types import ChatInput, ChatMessage, OcrInput, Task, TextInput

    root = default_repository_path()
    chat = dataclasses.replace(
        read_spec(root / "smollm2-135m"), runtime="torch", adapter="hf-causal-lm"
    )
    specs = [read_spec(root / "all-minilm-l6-v2"), read_spec(root / "pp-ocrv6"), chat]
    config = EngineConfig(
        device="cpu",
        num_threads=threads,
        memory_budget_bytes=4 * 2**30,
        preload=tuple(s.name for s in specs),
        long_work=mode,
        cache_dir=Path(cache),
    )
    engine = Engine(ModelRepository(specs), config)
    await engine.preload()
    try:
        # Warm-up: every model runs, so the predictor knows each (long: >= 0.5 s).
        for _ in range(10):
            await engine.infer("all-minilm-l6-v2", Task.EMBEDDING, [TextInput(SENTENCE)])
        await engine.infer("pp-ocrv6", Task.OCR, [OcrInput(page(), "page")])
        story = ChatInput((ChatMessage("user", STORY),), max_tokens=32)
        for _ in range(2):
            await engine.infer("smollm2-135m", Task.GENERATE, [story])
        scenes = [
            await scene(engine, name, requests, rate, seed) for seed, name in enumerate(SCENES)
        ]
    finally:
        await engine.close()
    return {"mode": mode, "scenes": scenes}


def measure(mode: str, threads: int, requests: int, rate: float, cache: str) -> dict[str, Any]:
    """Run in a child process: one mode's scenes, as a dict."""
    return asyncio.run(measure_async(mode, threads, requests, rate, cache))


def run_child(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import long_short_bench as b; "
        "print(json.dumps(b.measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), "
        "float(sys.argv[5]), sys.argv[6])))"
    )
    here = str(Path(__file__).parent)
    argv = [mode, str(args.threads), str(args.requests), str(args.rate), str(args.cache_dir)]
    out = subprocess.run(
        [sys.executable, "-c", code, here, *argv], check=True, capture_output=True, text=True
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _figure(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| round | mode | scene | embed p50 ms | embed p99 ms | queued p99 | run p50 / p99 "
        "| rest p50 / p99 | OCR pages/s | chat pieces/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for s in run["scenes"]:
            lines.append(
                f"| {run['round']} | {run['mode']} | {s['scene']} "
                f"| {_figure(s['embed_p50_ms'])} | {_figure(s['embed_p99_ms'])} "
                f"| {_figure(s['embed_queued_p99_ms'])} "
                f"| {_figure(s['embed_run_p50_ms'])} / {_figure(s['embed_run_p99_ms'])} "
                f"| {_figure(s['embed_rest_p50_ms'])} / {_figure(s['embed_rest_p99_ms'])} "
                f"| {_figure(s['pages_per_s'], 2)} | {_figure(s['chat_pieces_per_s'], 1)} |"
            )
    return "\n".join(lines) + "\n"


def ratios(runs: list[dict[str, Any]]) -> str:
    """steps / lane for each scene's embedding p50 and p99, round by round."""
    by_run = {(r["round"], r["mode"]): {s["scene"]: s for s in r["scenes"]} for r in runs}
    rounds = sorted({r["round"] for r in runs})
    lines = [
        "| round | scene | embed p50, steps / lane | embed p99, steps / lane "
        "| OCR pages/s, steps / lane | chat pieces/s, steps / lane |",
        "|---|---|---|---|---|---|",
    ]
    for number in rounds:
        for name in SCENES:
            lane, steps = by_run[(number, "lane")][name], by_run[(number, "steps")][name]
            figures = [
                _ratio(steps[key], lane[key])
                for key in ("embed_p50_ms", "embed_p99_ms", "pages_per_s", "chat_pieces_per_s")
            ]
            lines.append(f"| {number} | {name} | {' | '.join(figures)} |")
    return "\n".join(lines) + "\n"


def _ratio(after: float | None, before: float | None) -> str:
    return "-" if after is None or not before else f"{after / before:.2f}"


def output_base(out: Path, date: str) -> Path:
    """``OUT/long-short-DATE``, or ``-N`` after it when an earlier run holds that name."""
    base = out / f"long-short-{date}"
    number = 2
    while base.with_suffix(".json").exists():
        base = out / f"long-short-{date}-{number}"
        number += 1
    return base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path.home() / ".cache" / "tessera" / "bench-cache",
        help="where the engine keeps SmolLM2's converted weights between runs",
    )
    args = parser.parse_args()
    begun = time.perf_counter()
    runs = [
        {"round": number, **run_child(mode, args)}
        for number in range(1, args.rounds + 1)
        for mode in MODES
    ]
    text = table(runs) + "\n" + ratios(runs)
    print(text)
    date = datetime.date.today().isoformat()
    base = output_base(args.out, date)
    niced = "nice " if os.nice(0) > 0 else ""  # as this run was
    rerun = f"HF_HUB_OFFLINE=1 {niced}.venv/bin/python benchmarks/long_short_bench.py"
    options = (
        f"--threads {args.threads} --requests {args.requests} --rate {args.rate:g}"
        f" --rounds {args.rounds}"
    )
    base.with_suffix(".md").write_text(
        f"# Long work beside short work: long_work lane vs steps, {date}\n\n"
        f"Rerun: `{rerun} {options}`\n\n"
        f"{args.requests} embedding requests of one sentence at {args.rate:g}/s (Poisson) a "
        f"scene; {args.threads} threads and workers; OCR pages 1000 x 1400 (16 lines), chat "
        f"answers of {CHAT_TOKENS} tokens (SmolLM2 through hf-causal-lm), each a closed loop "
        "of one.\n\n"
        f"{text}"
    )
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "nice": os.nice(0)}
    report = {
        "date": date,
        "threads": args.threads,
        "requests": args.requests,
        "rate": args.rate,
        "rounds": args.rounds,
        "chat_tokens": CHAT_TOKENS,
        "machine": machine,
        "wall_s": time.perf_counter() - begun,
    }
    base.with_suffix(".json").write_text(json.dumps({**report, "runs": runs}, indent=2) + "\n")
    print(f"wrote {base}.md and .json")


if __name__ == "__main__":
    main()
