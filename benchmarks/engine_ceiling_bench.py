"""The engine's own ceiling: requests a second with a model that costs nothing.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/engine_ceiling_bench.py \
        [--concurrency 256] [--models 1] [--holds H] [--zipf S] [--seconds 5] \
        [--rounds 3] [--out benchmarks/results]

What the server costs per request before any model runs, in two forms, in
turn for ``--rounds`` rounds: ``engine``, an ``Engine`` in this process over
a ``fake`` embedding model (no sleep; batches of up to 64, 2 ms to gather)
driven by ``--concurrency`` coroutines calling ``asubmit`` and ``wait``, one
sentence each (validation, admission, the fair queue, the batcher, the
executor's thread, the answer); ``core``, the same engine behind its
``EngineCore`` in a second process, driven through a ``RemoteEngine`` from
this one (the process split's engine side, and one gateway's socket end,
without HTTP). On this 2-core machine the driver and the engine share the
cores. With ``--models N`` (N > 1) there are N such models, all resident,
and the callers take them round robin (each request the next model): the
engine's cost per *batch* when batches hold one request each, as for 100
resident models round robin at c=64 (``engine-ceiling-models`` reports).
With ``--holds H`` as well, the budget holds H of them (each 1 MiB, the
budget H + 0.5 MiB) and an evicted one waits in the host tier: nearly every
batch is a swap-in and an eviction, costing nothing but the engine's own
bookkeeping (``engine-ceiling-swaps`` reports), as for 100 models under a
budget that holds 20. With ``--zipf S`` the callers pick each request's
model by Zipf(S) popularity (seeded) instead of round robin: the issue's
Zipf(1.1) bar, under swaps against all resident.
Writes ``OUT/engine-ceiling[-models]-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.driver import zipf_weights
from harness.report import write_report
from tessera import residency
from tessera.engine import Engine, EngineConfig, ServingEngine
from tessera.repository import ModelRepository
from tessera.tasks.types import Task, TextInput

BATCHING = {"max_batch_size": 64, "max_wait_ms": 2}
# Milliseconds a swap's copy out to the host tier and back take (--swap-ms), or none.
Swap = tuple[float, float] | None


@asynccontextmanager
async def fake_engine(
    root: Path, models: int, holds: int | None = None, swap_ms: Swap = None, stack: int = 0
) -> AsyncIterator[Engine]:
    options: dict[str, object] = {"own_bytes": 1000}
    budget = 64 * 2**20
    if holds is not None:
        options = {"own_bytes": 2**20, "host_tier": True}
        if swap_ms is not None:
            options.update(offload_s=swap_ms[0] / 1000, restore_s=swap_ms[1] / 1000)
        budget = int((holds + 0.5) * 2**20)
    if stack:
        options["stack"] = stack
    for name in model_names(models):
        folder = root / "repo" / name
        folder.mkdir(parents=True)
        card: dict[str, object] = {"name": name, "task": "embedding", "runtime": "torch"}
        card["adapter"] = "fake"
        card.update(preload=holds is None, batching=BATCHING, options=options)
        (folder / "model.yaml").write_text(json.dumps(card))
    repository = ModelRepository.from_folders([root / "repo"])
    config = EngineConfig(
        memory_budget_bytes=budget,
        host_memory_budget_bytes=models * 2**20,
        device="cpu",
        num_threads=2,
        fill=False,
    )
    bound = getattr(residency, "MAX_HOST_LOADS", None)  # a tree before the bound has none
    if swap_ms is not None and bound is not None:
        # A device's copies, one at a time each way: its bound on loads from
        # the host tier too (CUDA's).
        config = replace(config, max_host_loads=bound)
    engine = Engine(repository, config)
    await engine.preload()
    try:
        yield engine
    finally:
        await engine.close()


def model_names(models: int) -> list[str]:
    return ["echo"] if models == 1 else [f"echo-{i}" for i in range(models)]


async def drive(
    engine: ServingEngine, models: int, concurrency: int, seconds: float, zipf: float | None = None
) -> float:
    """Requests a second from ``concurrency`` callers for ``seconds``, each
    request for the next of ``models`` models, or (``zipf``) one drawn by
    Zipf popularity."""
    names = model_names(models)
    if zipf is not None:
        names = random.Random(7).choices(names, zipf_weights(len(names), zipf), k=1 << 16)
    stop = time.perf_counter() + seconds
    done = 0
    sent = 0

    async def caller() -> None:
        nonlocal done, sent
        items = [TextInput("hello world")]
        while time.perf_counter() < stop:
            name = names[sent % len(names)]
            sent += 1
            submission = await engine.asubmit(name, Task.EMBEDDING, items)
            await engine.wait(submission)
            done += 1

    began = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return done / (time.perf_counter() - began)


@dataclass(frozen=True)
class Run:
    """One run's load: its models, the budget, the callers, how long, how models are picked."""

    models: int
    holds: int | None
    concurrency: int
    seconds: float
    zipf: float | None
    swap_ms: Swap = None
    stack: int = 0  # the fakes' batches meet in rounds of up to this many (0: none)


async def engine_only(run: Run) -> tuple[float, float | None]:
    """Requests a second, and loads from the host tier a request (swaps)."""
    with tempfile.TemporaryDirectory() as tmp:
        async with fake_engine(Path(tmp), run.models, run.holds, run.swap_ms, run.stack) as engine:
            before = engine.snapshot().host_loads_total
            began = time.perf_counter()
            rate = await drive(engine, run.models, run.concurrency, run.seconds, run.zipf)
            answered = rate * (time.perf_counter() - began)
            swaps = engine.snapshot().host_loads_total - before
            return rate, swaps / answered if answered else None


async def serve_core(
    socket_path: Path, models: int, holds: int | None, swap_ms: Swap = None, stack: int = 0
) -> None:
    """The engine process: serve until killed."""
    from tessera.engine.core import EngineCore

    with tempfile.TemporaryDirectory() as tmp:
        async with fake_engine(Path(tmp), models, holds, swap_ms, stack) as engine:
            core = EngineCore(engine)
            await core.start(socket_path)
            print("ready", flush=True)
            await asyncio.Event().wait()


async def through_core(run: Run) -> tuple[float, float | None]:
    from tessera.engine.remote import RemoteEngine

    with tempfile.TemporaryDirectory() as tmp:
        socket_path = Path(tmp) / "engine.sock"
        command = [sys.executable, __file__, "--serve", str(socket_path)]
        command += ["--models", str(run.models), "--stack", str(run.stack)]
        if run.holds is not None:
            command += ["--holds", str(run.holds)]
        if run.swap_ms is not None:
            command += ["--swap-ms", f"{run.swap_ms[0]},{run.swap_ms[1]}"]
        server = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
        try:
            assert server.stdout is not None
            assert (await server.stdout.readline()).strip() == b"ready"
            remote = RemoteEngine(socket_path)
            await remote.connect(timeout_s=30)
            try:
                rate = await drive(remote, run.models, run.concurrency, run.seconds, run.zipf)
                return rate, None  # the engine's counters are the other process's
            finally:
                await remote.close()
        finally:
            server.kill()
            await server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--models", type=int, default=1)
    parser.add_argument("--holds", type=int, default=None)
    parser.add_argument("--zipf", type=float, default=None)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument(
        "--swap-ms",
        type=lambda v: tuple(float(x) for x in v.split(",")),
        help="with --holds: OUT,BACK ms each swap's copies take (the H200's: 2.15,1.71)",
    )
    parser.add_argument(
        "--stack",
        type=int,
        default=0,
        help="also each form with the fakes' batches meeting in rounds of up to N",
    )
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        asyncio.run(serve_core(args.serve, args.models, args.holds, args.swap_ms, args.stack))
        return
    runs: list[dict[str, Any]] = []
    load = Run(args.models, args.holds, args.concurrency, args.seconds, args.zipf, args.swap_ms)
    forms = [("engine", engine_only, load), ("core", through_core, load)]
    if args.stack:
        stacked = replace(load, stack=args.stack)
        label = f"stacked {args.stack}"
        forms += [(f"engine, {label}", engine_only, stacked)]
        forms += [(f"core, {label}", through_core, stacked)]
    for round_ in range(1, args.rounds + 1):
        for form, measure, run in forms:
            rate, swaps = asyncio.run(measure(run))
            runs.append({"round": round_, "form": form, "req_per_s": rate, "swaps": swaps})
            each = f" ({swaps:.3f} swaps a request)" if swaps is not None else ""
            print(f"round {round_}, {form}: {rate:.0f} req/s{each}", flush=True)
    medians = {
        form: statistics.median(r["req_per_s"] for r in runs if r["form"] == form)
        for form, _, _ in forms
    }
    date = datetime.date.today().isoformat()
    many = args.models > 1
    what = (
        f"{args.models} `fake` embedding models that cost nothing, taken "
        + ("round robin" if args.zipf is None else f"by Zipf({args.zipf:g}) popularity")
        if many
        else "A `fake` embedding model that costs nothing"
    )
    if args.holds is not None:
        what += (
            f", under a budget that holds {args.holds} (1 MiB each, the budget"
            f" {args.holds + 0.5:g} MiB; evicted ones wait in the host tier)"
        )
    if args.holds is not None and args.swap_ms is not None:
        what += (
            f"; each move to the host tier takes {args.swap_ms[0]:g} ms and each return"
            f" {args.swap_ms[1]:g} ms (the fake's sleeps in the copy thread, a device's copies)"
        )
    rerun = "benchmarks/engine_ceiling_bench.py"
    if many:
        rerun += f" --models {args.models} --concurrency {args.concurrency}"
    if args.holds is not None:
        rerun += f" --holds {args.holds}"
    if args.zipf is not None:
        rerun += f" --zipf {args.zipf:g}"
    if args.holds is not None and args.swap_ms is not None:
        rerun += f" --swap-ms {args.swap_ms[0]:g},{args.swap_ms[1]:g}"
    if args.stack:
        rerun += f" --stack {args.stack}"
        what += (
            f"; the forms marked stacked with the fakes' option stack: {args.stack} (their"
            " batches meet in rounds, runtimes/stacking.Rendezvous, on the executor's"
            " threads for batches across models)"
        )
    title = " under swaps" if args.holds is not None else " over many models" if many else ""
    lines = [
        f"# The engine's ceiling{title}, {date}",
        "",
        f"{what}, {args.concurrency} callers, {args.seconds:g} s a run. Rerun:",
        f"`HF_HUB_OFFLINE=1 .venv/bin/python {rerun}`.",
        "",
        "| round | form | req/s | loads from the host tier a request |",
        "|---|---|---|---|",
        *(
            f"| {r['round']} | {r['form']} | {r['req_per_s']:.0f} |"
            f" {'-' if r['swaps'] is None else format(r['swaps'], '.3f')} |"
            for r in runs
        ),
        "",
        "Medians (engine: in process; core: through its socket from another process): "
        + "; ".join(f"{form} {rate:.0f} req/s" for form, rate in medians.items())
        + ".",
        "",
    ]
    figures = {
        "models": args.models,
        "holds": args.holds,
        "zipf": args.zipf,
        "swap_ms": args.swap_ms,
        "stack": args.stack,
        "runs": runs,
        "medians": medians,
    }
    name = "engine-ceiling-models" if many else "engine-ceiling"
    if args.holds is not None:
        name = "engine-ceiling-swaps" if args.swap_ms is None else "engine-ceiling-copies"
    if args.zipf is not None:
        name += "-zipf"
    if args.stack:
        name += "-stacked"
    write_report(args.out, date, name, figures, "\n".join(lines))


if __name__ == "__main__":
    main()
