"""The engine's own ceiling: requests a second with a model that costs nothing.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/engine_ceiling_bench.py \
        [--concurrency 256] [--models 1] [--holds H] [--zipf S] [--seconds 5] \
        [--swap-ms OUT,BACK] [--device CALLS,MS[,ROUND_CALLS,ROUND_MS]] \
        [--stack N [--lane-threads T ...]] [--forms engine core] \
        [--engine-loops patient asyncio uvloop] \
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

With ``--device`` the fakes model a GPU's host side (options ``host_calls``,
``device_s``): each batch makes CALLS calls that hand the interpreter lock to
a waiting thread (``time.sleep(0)``, as each torch call that launches work
does) and then takes MS ms of one device (a sleep under one lock); a
stacked round (``--stack N``: the fakes' batches meet in rounds of up to N)
makes ROUND_CALLS calls and takes ROUND_MS once, its device time after the
lead is handed on, as a real round's wait for its vectors. On the H200 the
100-model round robin's batches took 2.49 ms on workers that were on a core
a quarter of the time: waits for the lock, each torch call a chance for the
engine's loop to run a slice of its work first. ``--lane-threads`` runs a
stacked form for each count of the executor's threads for batches across
models; in-process forms report the rounds' mean batches. ``--engine-loops``
runs the core form once for each event loop of the engine process (its
``engine_loop``, ``engine/loop.py``; default: the server's default alone).
Writes ``OUT/engine-ceiling[-models]-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
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
from harness.fake_models import FAKE_ADAPTERS
from harness.report import write_report
from tessera import residency
from tessera.admission.limits import TenantLimits
from tessera.engine import Engine, EngineConfig, ServingEngine
from tessera.engine.loop import DEFAULT_ENGINE_LOOP, ENGINE_LOOPS, loop_factory
from tessera.engine.types import Caller
from tessera.repository import ModelRepository
from tessera.tasks.types import Task, TextInput

BATCHING = {"max_batch_size": 64, "max_wait_ms": 2}
# Milliseconds a swap's copy out to the host tier and back take (--swap-ms), and
# optionally the calls each copy makes first, or none.
Swap = tuple[float, ...] | None
# A GPU's host side as the fakes model it (--device): calls that hand the
# interpreter lock over and device ms, a batch's, then a stacked round's.
DeviceModel = tuple[int, float, int, float] | None


def device_model(text: str) -> tuple[int, float, int, float]:
    """``CALLS,MS[,ROUND_CALLS,ROUND_MS]`` (a round's default: a batch's)."""
    values = [float(v) for v in text.split(",")]
    if len(values) not in (2, 4):
        raise argparse.ArgumentTypeError("CALLS,MS or CALLS,MS,ROUND_CALLS,ROUND_MS")
    calls, ms = int(values[0]), values[1]
    return (calls, ms, int(values[2]), values[3]) if len(values) == 4 else (calls, ms, calls, ms)


@asynccontextmanager
async def fake_engine(
    root: Path,
    models: int,
    holds: int | None = None,
    swap_ms: Swap = None,
    stack: int = 0,
    device: DeviceModel = None,
    lane_threads: int | None = None,
    target_ms: float | None = None,
) -> AsyncIterator[Engine]:
    options: dict[str, object] = {"own_bytes": 1000}
    budget = 64 * 2**20
    if holds is not None:
        options = {"own_bytes": 2**20, "host_tier": True}
        if swap_ms is not None:
            options.update(offload_s=swap_ms[0] / 1000, restore_s=swap_ms[1] / 1000)
            if len(swap_ms) > 2:
                options.update(copy_calls=int(swap_ms[2]))
        budget = int((holds + 0.5) * 2**20)
    if stack:
        options["stack"] = stack
    if device is not None:
        options.update(host_calls=device[0], device_s=device[1] / 1000)
        options.update(round_host_calls=device[2], round_device_s=device[3] / 1000)
    for name in model_names(models):
        folder = root / "repo" / name
        folder.mkdir(parents=True)
        card: dict[str, object] = {"name": name, "task": "embedding", "runtime": "torch"}
        card["adapter"] = "fake"
        card.update(preload=holds is None, batching=BATCHING, options=options)
        if target_ms is not None:
            card["latency_target_ms"] = target_ms
        (folder / "model.yaml").write_text(json.dumps(card))
    repository = ModelRepository.from_folders([root / "repo"])
    config = EngineConfig(
        memory_budget_bytes=budget,
        host_memory_budget_bytes=models * 2**20,
        device="cpu",
        num_threads=2,
        fill=False,
        adapters=FAKE_ADAPTERS,
    )
    if lane_threads is not None:
        config = replace(config, across_models_threads=lane_threads)
    bound = getattr(residency, "MAX_HOST_LOADS", None)  # a tree before the bound has none
    if swap_ms is not None and bound is not None:
        # A device's copies, one at a time each way: its bound on loads from
        # the host tier too (CUDA's).
        config = replace(config, max_host_loads=bound)
    engine = Engine(repository, config)
    await engine.preload()
    if holds is not None:
        # Each model's first load before the measured window, as the GPU
        # check's first requests: the first from files imports torch (1.3 s
        # here), and each load of a model not loaded before is a cold one,
        # not a swap. Runs before 2026-12-04, late, counted both, their first
        # rounds the lowest; the socket's forms, a process a run, each time.
        for name in model_names(models):
            await engine.infer(name, Task.EMBEDDING, [TextInput("warm up")])
    try:
        yield engine
    finally:
        await engine.close()


def model_names(models: int) -> list[str]:
    return ["echo"] if models == 1 else [f"echo-{i}" for i in range(models)]


async def drive(
    engine: ServingEngine,
    models: int,
    concurrency: int,
    seconds: float,
    zipf: float | None = None,
    tenants: int = 0,
) -> tuple[float, list[float]]:
    """Requests a second from ``concurrency`` callers for ``seconds``, each
    request for the next of ``models`` models, or (``zipf``) one drawn by
    Zipf popularity, and (``tenants``) from the next of that many tenants
    (none: no caller, as a server without tenants); and each request's seconds."""
    names = model_names(models)
    callers: list[Caller | None] = [Caller(TenantLimits(f"tenant-{i}")) for i in range(tenants)]
    callers = callers or [None]
    if zipf is not None:
        names = random.Random(7).choices(names, zipf_weights(len(names), zipf), k=1 << 16)
    stop = time.perf_counter() + seconds
    sent = 0
    took: list[float] = []

    async def caller() -> None:
        nonlocal sent
        items = [TextInput("hello world")]
        while (asked := time.perf_counter()) < stop:
            name = names[sent % len(names)]
            caller = callers[sent % len(callers)]
            sent += 1
            submission = await engine.asubmit(name, Task.EMBEDDING, items, caller=caller)
            await engine.wait(submission)
            took.append(time.perf_counter() - asked)

    began = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return len(took) / (time.perf_counter() - began), took


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
    device: DeviceModel = None
    lane_threads: int | None = None  # the executor's threads for batches across models
    engine_loop: str = DEFAULT_ENGINE_LOOP  # the engine process's event loop (core form)
    target_ms: float | None = None  # the cards' latency target (None: the default's)
    tenants: int = 0  # requests from this many tenants in turn (0: no caller)


@dataclass(frozen=True)
class Measured:
    rate: float  # requests a second
    swaps: float | None = None  # loads from the host tier a request (in process only)
    round_batches: float | None = None  # batches a stacked round (in process only)
    loop_us: float | None = None  # the engine process's loop thread's CPU a request (core only)
    p50_ms: float = math.nan  # the requests' latency
    p99_ms: float = math.nan


def latency(took: list[float]) -> dict[str, float]:
    """The p50 and p99 of ``took`` (seconds) in ms, as ``Measured`` fields."""
    if len(took) < 2:
        return {}
    cuts = statistics.quantiles(took, n=100)
    return {"p50_ms": cuts[49] * 1000, "p99_ms": cuts[98] * 1000}


def run_engine(root: Path, run: Run) -> contextlib.AbstractAsyncContextManager[Engine]:
    """``fake_engine`` for ``run``'s load, its folders under ``root``."""
    return fake_engine(
        root,
        run.models,
        run.holds,
        run.swap_ms,
        run.stack,
        run.device,
        run.lane_threads,
        run.target_ms,
    )


async def engine_only(run: Run) -> Measured:
    """Requests a second, loads from the host tier a request (swaps), and the
    stacked rounds' mean batches."""
    with tempfile.TemporaryDirectory() as tmp:
        engine_of = run_engine(Path(tmp), run)
        async with engine_of as engine:
            before = engine.snapshot()
            began = time.perf_counter()
            rate, took = await drive(
                engine, run.models, run.concurrency, run.seconds, run.zipf, run.tenants
            )
            answered = rate * (time.perf_counter() - began)
            after = engine.snapshot()
            swaps = after.host_loads_total - before.host_loads_total
            rounds = after.stacked_rounds_total - before.stacked_rounds_total
            batches = after.stacked_batches_total - before.stacked_batches_total
            return Measured(
                rate,
                swaps / answered if answered else None,
                batches / rounds if rounds else None,
                **latency(took),
            )


async def serve_core(socket_path: Path, run: Run) -> None:
    """The engine process: serve until killed."""
    from tessera.engine.core import EngineCore

    with tempfile.TemporaryDirectory() as tmp:
        engine_of = run_engine(Path(tmp), run)
        async with engine_of as engine:
            core = EngineCore(engine)
            await core.start(socket_path)
            print("ready", flush=True)
            await asyncio.Event().wait()


async def through_core(run: Run) -> Measured:
    from tessera.engine.remote import RemoteEngine

    with tempfile.TemporaryDirectory() as tmp:
        socket_path = Path(tmp) / "engine.sock"
        command = [sys.executable, __file__, "--serve", str(socket_path)]
        command += ["--models", str(run.models), "--stack", str(run.stack)]
        command += ["--serve-loop", run.engine_loop]
        if run.holds is not None:
            command += ["--holds", str(run.holds)]
        if run.swap_ms is not None:
            command += ["--swap-ms", ",".join(map(str, run.swap_ms))]
        if run.device is not None:
            command += ["--device", ",".join(map(str, run.device))]
        if run.lane_threads is not None:
            command += ["--serve-lane-threads", str(run.lane_threads)]
        if run.target_ms is not None:
            command += ["--target-ms", str(run.target_ms)]
        server = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
        try:
            assert server.stdout is not None
            assert (await server.stdout.readline()).strip() == b"ready"
            remote = RemoteEngine(socket_path)
            await remote.connect(timeout_s=30)
            try:
                loop_s = thread_cpu_s(server.pid)
                began = time.perf_counter()
                rate, took = await drive(remote, run.models, run.concurrency, run.seconds, run.zipf)
                answered = rate * (time.perf_counter() - began)
                loop_us = (thread_cpu_s(server.pid) - loop_s) / answered * 1e6 if answered else None
                # The engine's counters are the other process's.
                return Measured(rate, loop_us=loop_us, **latency(took))
            finally:
                await remote.close()
        finally:
            server.kill()
            await server.wait()


def thread_cpu_s(pid: int) -> float:
    """The CPU seconds (user and system) of process ``pid``'s main thread: in
    the engine process, its event loop's (Linux's ``/proc``, in clock ticks)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
        help="with --holds: OUT,BACK[,CALLS] ms each swap's copies take (the H200's:"
        " 2.15,1.71; a kept buffer: 0 out), and the calls each makes first that hand the"
        " interpreter lock over (fake option copy_calls; a MiniLM in 4 MiB pieces: 12)",
    )
    parser.add_argument(
        "--stack",
        type=int,
        default=0,
        help="also each form with the fakes' batches meeting in rounds of up to N",
    )
    parser.add_argument(
        "--device",
        type=device_model,
        help="CALLS,MS[,ROUND_CALLS,ROUND_MS]: each batch (stacked round) makes CALLS calls"
        " that hand the interpreter lock over and takes MS ms of one device (fake options"
        " host_calls, device_s): a GPU's host side",
    )
    parser.add_argument(
        "--lane-threads",
        type=int,
        nargs="*",
        default=[],
        help="with --stack: a stacked form for each count of the executor's threads for"
        " batches across models (default: the engine's)",
    )
    parser.add_argument(
        "--forms", nargs="*", choices=["engine", "core"], default=["engine", "core"]
    )
    parser.add_argument(
        "--engine-loops",
        nargs="*",
        choices=ENGINE_LOOPS,
        default=[DEFAULT_ENGINE_LOOP],
        help="the core form once with each of these event loops in the engine process",
    )
    parser.add_argument(
        "--target-ms",
        type=float,
        help="the cards' latency target (the MiniLM card's: 200; default: none, the"
        " engine's default target); under a budget, patience is a share of it",
    )
    parser.add_argument(
        "--tenants",
        type=int,
        default=0,
        help="requests from this many tenants in turn, each a caller without limits"
        " (default: none, requests without a caller)",
    )
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--serve-loop", default=DEFAULT_ENGINE_LOOP, help=argparse.SUPPRESS)
    parser.add_argument("--serve-lane-threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    load = Run(
        args.models,
        args.holds,
        args.concurrency,
        args.seconds,
        args.zipf,
        args.swap_ms,
        device=args.device,
        target_ms=args.target_ms,
        tenants=args.tenants,
    )
    if args.serve is not None:
        run = replace(load, stack=args.stack, lane_threads=args.serve_lane_threads)
        with asyncio.Runner(loop_factory=loop_factory(args.serve_loop)) as runner:
            runner.run(serve_core(args.serve, run))
        return
    runs: list[dict[str, Any]] = []
    loads = [("", load)]
    if args.stack:
        for threads in args.lane_threads or [None]:
            label = f", stacked {args.stack}"
            if threads is not None:
                label += f", {threads} threads"
            loads.append((label, replace(load, stack=args.stack, lane_threads=threads)))
    forms: list[tuple[str, Any, Run]] = []
    for label, each_load in loads:
        if "engine" in args.forms:
            forms.append((f"engine{label}", engine_only, each_load))
        if "core" in args.forms:
            for loop in args.engine_loops:
                named = f" (loop: {loop})" if args.engine_loops != [DEFAULT_ENGINE_LOOP] else ""
                core_load = replace(each_load, engine_loop=loop)
                forms.append((f"core{label}{named}", through_core, core_load))
    for round_ in range(1, args.rounds + 1):
        for form, measure, run in forms:
            got = asyncio.run(measure(run))
            runs.append(
                {
                    "round": round_,
                    "form": form,
                    "req_per_s": got.rate,
                    "swaps": got.swaps,
                    "round_batches": got.round_batches,
                    "loop_us": got.loop_us,
                    "p50_ms": got.p50_ms,
                    "p99_ms": got.p99_ms,
                }
            )
            each = f" ({got.swaps:.3f} swaps a request)" if got.swaps is not None else ""
            if got.round_batches is not None:
                each += f" ({got.round_batches:.1f} batches a round)"
            if got.loop_us is not None:
                each += f" (the engine's loop {got.loop_us:.0f} us a request)"
            each += f" (p50 {got.p50_ms:.1f} ms, p99 {got.p99_ms:.1f} ms)"
            print(f"round {round_}, {form}: {got.rate:.0f} req/s{each}", flush=True)
    medians = {
        form: statistics.median(r["req_per_s"] for r in runs if r["form"] == form)
        for form, _, _ in forms
    }
    date = datetime.date.today().isoformat()
    many = args.models > 1
    cost = "that cost nothing" if args.device is None else "with a GPU's host side modelled"
    what = (
        f"{args.models} `fake` embedding models {cost}, taken "
        + ("round robin" if args.zipf is None else f"by Zipf({args.zipf:g}) popularity")
        if many
        else f"A `fake` embedding model {cost}"
    )
    if args.device is not None:
        calls, ms, round_calls, round_ms = args.device
        what += (
            f" (each batch makes {calls} calls that hand the interpreter lock to a waiting"
            f" thread and takes {ms:g} ms of one device, a stacked round {round_calls} calls"
            f" and {round_ms:g} ms: fake options host_calls and device_s)"
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
        if len(args.swap_ms) > 2:
            what += f", each copy first making {args.swap_ms[2]:g} calls that hand the lock over"
    rerun = "benchmarks/engine_ceiling_bench.py"
    if many:
        rerun += f" --models {args.models} --concurrency {args.concurrency}"
    if args.holds is not None:
        rerun += f" --holds {args.holds}"
    if args.zipf is not None:
        rerun += f" --zipf {args.zipf:g}"
    if args.holds is not None and args.swap_ms is not None:
        rerun += " --swap-ms " + ",".join(f"{v:g}" for v in args.swap_ms)
    if args.device is not None:
        rerun += " --device " + ",".join(f"{v:g}" for v in args.device)
    if args.tenants:
        rerun += f" --tenants {args.tenants}"
        what += f"; the requests from {args.tenants} tenants in turn"
    if args.target_ms is not None:
        rerun += f" --target-ms {args.target_ms:g}"
        what += f"; each card's latency target {args.target_ms:g} ms"
    if args.forms != ["engine", "core"]:
        rerun += " --forms " + " ".join(args.forms)
    if args.engine_loops != [DEFAULT_ENGINE_LOOP]:
        rerun += " --engine-loops " + " ".join(args.engine_loops)
    if args.stack:
        rerun += f" --stack {args.stack}"
        if args.lane_threads:
            rerun += " --lane-threads " + " ".join(map(str, args.lane_threads))
        what += (
            f"; the forms marked stacked with the fakes' option stack: {args.stack} (their"
            " batches meet in rounds, runtimes/stacking.Rendezvous, on the executor's"
            " threads for batches across models)"
        )
    if "core" in args.forms:
        what += "; the core form's engine process on the event loop " + (
            ", then ".join(f"`{loop}`" for loop in args.engine_loops) + " (its `engine_loop`)"
        )
    title = " under swaps" if args.holds is not None else " over many models" if many else ""
    lines = [
        f"# The engine's ceiling{title}, {date}",
        "",
        f"{what}, {args.concurrency} callers, {args.seconds:g} s a run. Rerun:",
        f"`HF_HUB_OFFLINE=1 .venv/bin/python {rerun}`.",
        "",
        "| round | form | req/s | p50 / p99 ms | loads from the host tier a request |"
        " batches a stacked round | the engine's loop, CPU us a request |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['round']} | {r['form']} | {r['req_per_s']:.0f} |"
            f" {r['p50_ms']:.1f} / {r['p99_ms']:.1f} |"
            f" {'-' if r['swaps'] is None else format(r['swaps'], '.3f')} |"
            f" {'-' if r['round_batches'] is None else format(r['round_batches'], '.1f')} |"
            f" {'-' if r['loop_us'] is None else format(r['loop_us'], '.0f')} |"
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
        "device": args.device,
        "lane_threads": args.lane_threads,
        "engine_loops": args.engine_loops,
        "runs": runs,
        "medians": medians,
    }
    name = "engine-ceiling-models" if many else "engine-ceiling"
    if args.holds is not None:
        name = "engine-ceiling-swaps" if args.swap_ms is None else "engine-ceiling-copies"
    if args.zipf is not None:
        name += "-zipf"
    if args.device is not None:
        name += "-device"
    if args.stack:
        name += "-stacked"
    write_report(args.out, date, name, figures, "\n".join(lines))


if __name__ == "__main__":
    main()
