"""The fair queue's own cost with many tenants: microseconds of scheduling a
request, side by side with other source trees.

    .venv/bin/python benchmarks/fair_queue_bench.py [--against SRC ...] \
        [--tenants 1 10 100 1000] [--requests 20000] [--rounds 3] [--out benchmarks/results]

One model's ``FairQueue`` (the engine's, a quantum of 25 ms, no predictor)
kept about 256 requests deep and served in batches of 32, each request
pushed, its wait estimated (``units_ahead``, as a submit with a deadline
does) and taken in a batch, on one thread with nothing else running: the
work the engine's event loop does for each request of each tenant, apart from
everything else it does. Loads: the requests round robin over N tenants, all
of them backlogged, their waits fitting their deadlines (the submit's bound,
``enough``, where a tree takes one: the default 60 s timeout's case) or
counted exactly (a deadline the whole queue would not fit); and ten tenants
after 10,000 others were each served once and left (what a long-running
server has seen). Each source tree (this
checkout's ``src``, then each ``--against`` folder, first on ``PYTHONPATH`` of
a child process) runs every load ``--rounds`` times; the medians are
reported. Writes ``OUT/fair-queue-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import inspect
import math
import statistics
import time
from pathlib import Path
from typing import Any

DEPTH = 256  # requests queued while the load runs
BATCH = 32  # items a batch takes
SEEN_BEFORE = 10_000  # tenants served once before the "after many" load


def measure(tenants: int, requests: int, seen_before: int = 0, exact: bool = False) -> float:
    """Microseconds a request of scheduling work, over ``requests`` requests
    round robin over ``tenants`` tenants (after ``seen_before`` others), each
    wait counted ``exact``ly or under a bound that the whole queue fits."""
    from tessera.request import QueuedRequest
    from tessera.scheduling.fair import FairQueue

    loop = asyncio.new_event_loop()
    try:
        queue = FairQueue(quantum_s=0.025)
        bounded = not exact and "enough" in inspect.signature(queue.units_ahead).parameters

        def made(i: int, tenant: str) -> QueuedRequest:
            return QueuedRequest([i], 1.0, float(i), loop.create_future(), tenant=tenant)

        for i in range(seen_before):
            queue.push(made(i, f"before-{i}"))
            queue.pop_batch(BATCH, 1e12, float(i))
        timed = [made(seen_before + i, f"t{i % tenants}") for i in range(requests)]
        enough = (math.inf,) if bounded else ()  # a tree before the bound takes none
        began = time.perf_counter()
        pushed = served = 0
        while served < requests:
            while pushed < requests and len(queue) < DEPTH:
                queue.push(timed[pushed])
                queue.units_ahead(timed[pushed], *enough)
                pushed += 1
            served += len(queue.pop_batch(BATCH, 1e12, float(seen_before + pushed)))
        return (time.perf_counter() - began) / requests * 1e6
    finally:
        loop.close()


def loads(tenants: list[int]) -> list[tuple[str, int, int, bool]]:
    return [
        *((f"{n} tenants", n, 0, False) for n in tenants),
        *((f"{n} tenants, waits counted exactly", n, 0, True) for n in tenants if n > 1),
        (f"10 tenants after {SEEN_BEFORE:,} others", 10, SEEN_BEFORE, False),
    ]


def child(tenants: list[int], requests: int, rounds: int) -> dict[str, Any]:
    return {
        "loads": [
            {
                "load": name,
                "us": statistics.median(measure(n, requests, seen, exact) for _ in range(rounds)),
            }
            for name, n, seen, exact in loads(tenants)
        ]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", type=Path, nargs="*", default=[])
    parser.add_argument("--tenants", type=int, nargs="*", default=[1, 10, 100, 1000])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import json

        print(json.dumps(child(args.tenants, args.requests, args.rounds)))
        return
    from harness.report import write_report
    from harness.trees import child_figures, rerun_command, tree_sources

    arguments = ["--tenants", *map(str, args.tenants)]
    arguments += ["--requests", str(args.requests), "--rounds", str(args.rounds)]
    figures: dict[str, dict[str, float]] = {}
    for name, source in tree_sources(args.against):
        got = child_figures(__file__, source, arguments)
        figures[name] = {row["load"]: row["us"] for row in got["loads"]}
        for load, us in figures[name].items():
            print(f"{name}, {load}: {us:.1f} us a request", flush=True)
    names = list(figures)
    date = datetime.date.today().isoformat()
    rerun = rerun_command(__file__, args.against) + " " + " ".join(arguments)
    header = " | ".join(names)
    lines = [
        f"# The fair queue's cost with many tenants, {date}",
        "",
        f"One model's `FairQueue` kept {DEPTH} requests deep, batches of {BATCH}: each"
        " request pushed, its wait estimated (`units_ahead`) and taken, on one thread;"
        f" {args.requests:,} requests a run, the median of {args.rounds} runs, in"
        " microseconds of scheduling a request. Rerun: `.venv/bin/python"
        f" {rerun}`.",
        "",
        f"| load | {header} |",
        "|---|" + "---|" * len(names),
        *(
            f"| {load} | " + " | ".join(f"{figures[n][load]:.1f}" for n in names) + " |"
            for load in figures[names[0]]
        ),
        "",
    ]
    write_report(args.out, date, "fair-queue", figures, "\n".join(lines))


if __name__ == "__main__":
    main()
