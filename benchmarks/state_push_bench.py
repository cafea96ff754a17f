"""The engine process's state pushes to its gateways: what one costs the
engine (its loop, the interpreter lock held) and each gateway, side by side
with other source trees.

    .venv/bin/python benchmarks/state_push_bench.py [--against SRC ...] \
        [--models 100] [--batches 250] [--pushes 40] [--out benchmarks/results]

Four times a second the engine process (``engine/core.py``) sends every
gateway a state: the phase, the served models when they changed, and the
engine's snapshot (every model's figures, and its recent batches for
``/admin/batches``). ``--models`` fake embedding models (this checkout's
engine, as ``engine_ceiling_bench.py`` makes them), each with a full window
of recent batches (a server that has run a while: 1,024 batches each, run
first, a minute for a hundred models), then
``--pushes`` interval pushes with ``--batches`` more batches between each
(spread over the models in turn: 1,000 batches a second between pushes a
quarter of a second apart). Per push: the engine's time to make and encode
the state (ms), its bytes, and a gateway's time to decode and take it (ms,
the snapshot then read once, as a health probe does). Each source tree
(this checkout's ``src``, then each ``--against`` folder, first on
``PYTHONPATH`` of a child process) runs the same steps; medians of the
pushes. Writes ``OUT/state-push-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


async def child(models: int, batches: int, pushes: int) -> dict[str, Any]:
    from engine_ceiling_bench import fake_engine, model_names
    from tessera.engine import Engine
    from tessera.engine.core import EngineCore
    from tessera.engine.counters import RECENT_BATCHES
    from tessera.engine.ipc import encode
    from tessera.engine.remote import RemoteEngine
    from tessera.tasks.types import Task, TextInput

    names = model_names(models)
    items = [TextInput("a")]

    async def run(engine: Engine, count: int, first: int = 0) -> None:
        """``count`` batches, one a model at a time, from model ``first`` on."""
        for start in range(first, first + count, len(names)):
            picked = [
                names[i % len(names)] for i in range(start, min(start + len(names), first + count))
            ]
            await asyncio.gather(*(engine.infer(name, Task.EMBEDDING, items) for name in picked))

    with tempfile.TemporaryDirectory() as tmp:
        async with fake_engine(Path(tmp), models) as engine:
            await run(engine, RECENT_BATCHES * models)  # every window full
            core = EngineCore(engine)
            gateway = RemoteEngine(Path(tmp) / "unused.sock")
            gateway._on_message(core._state())  # a gateway's first, whole state
            made, took, sizes = [], [], []
            for push in range(pushes + 1):
                await run(engine, batches, push * batches)
                began = time.perf_counter()
                frame = encode(core._state(changed_only=True))
                mid = time.perf_counter()
                gateway._on_message(_decoded(frame))
                gateway.snapshot()
                ended = time.perf_counter()
                if push:  # the first carried the served models
                    made.append((mid - began) * 1000)
                    took.append((ended - mid) * 1000)
                    sizes.append(len(frame))
            window = gateway.snapshot().models[0].recent_batches
            return {
                "engine_ms": statistics.median(made),
                "bytes": statistics.median(sizes),
                "gateway_ms": statistics.median(took),
                "window": len(window),
                "window_matches": window == engine.snapshot().models[0].recent_batches,
            }


def _decoded(frame: bytes) -> Any:
    """A frame's message, as the tree under test encodes them."""
    try:
        from tessera.engine.messages import to_gateway
    except ImportError:  # a tree from before typed messages: pickled tuples
        import pickle

        return pickle.loads(frame[4:])
    from tessera.engine.ipc import decode

    return decode(frame[4:], to_gateway)


def run_child(source: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    from harness.trees import child_figures

    arguments = ["--models", str(args.models), "--batches", str(args.batches)]
    return child_figures(__file__, source, [*arguments, "--pushes", str(args.pushes)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", type=Path, nargs="*", default=[])
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--batches", type=int, default=250)
    parser.add_argument("--pushes", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args.models, args.batches, args.pushes))))
        return
    from harness.report import write_report
    from harness.trees import rerun_command, tree_sources

    rows = []
    for name, source in tree_sources(args.against):
        figures = run_child(source, args)
        rows.append({"source": name, **figures})
        print(
            f"{name}: the engine {figures['engine_ms']:.2f} ms, {figures['bytes']:,.0f} bytes,"
            f" a gateway {figures['gateway_ms']:.2f} ms; its window"
            f" {'matches' if figures['window_matches'] else 'DIFFERS from'} the engine's",
            flush=True,
        )
    date = datetime.date.today().isoformat()
    rerun = rerun_command(__file__, args.against)
    rerun += f" --models {args.models} --batches {args.batches} --pushes {args.pushes}"
    lines = [
        f"# The engine process's state pushes, {date}",
        "",
        f"{args.models} fake models, each with a full window of recent batches, then"
        f" {args.pushes} interval pushes with {args.batches} more batches between each;"
        " medians of the pushes. The engine: making and encoding the state (its loop"
        " and the interpreter lock held); a gateway: decoding and taking it, then"
        f" reading the snapshot once. Rerun: `HF_HUB_OFFLINE=1 .venv/bin/python {rerun}`.",
        "",
        "| source | the engine, ms | bytes | a gateway, ms | a model's window there |"
        " same as the engine's |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['source']} | {r['engine_ms']:.2f} | {r['bytes']:,.0f} |"
            f" {r['gateway_ms']:.2f} | {r['window']} | {'yes' if r['window_matches'] else 'no'} |"
            for r in rows
        ),
    ]
    write_report(args.out, date, "state-push", {"rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
