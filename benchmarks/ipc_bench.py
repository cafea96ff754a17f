"""What a request's messages between a gateway and the engine process cost:
the typed messages (``engine/messages.py``) against the pickled tuples they
replaced.

    .venv/bin/python benchmarks/ipc_bench.py [--rounds 200] [--slice-ms 2] \
        [--models 20] [--out benchmarks/results/DATE-ipc]

Each representative message is built from its values, framed and read back:
by the old encoding (a pickle, protocol 5, of the positional tuple, framed
and read as ``engine/ipc.py`` did, reproduced here) and by the new one (a
typed message through ``ipc.encode`` and ``ipc.decode``). In each of
``--rounds`` rounds, every message makes as many round trips as take about
``--slice-ms`` the old way, old and new interleaved, each first in every
other round; the median round (and the quartiles), in CPU µs per message
(this thread's time: a busy machine's other processes are not counted), and
new/old. The messages: a submit of one short text and of 32 (with a
tenant's caller), its ``queued``, its ``done`` with a 384-float embedding per
item, a ``settled``, and an engine's state of ``--models`` fake embedding
models (the interval's: the batches run since the last; and a whole one,
with the served models, as a gateway's first and a call's). A request is its
submit, queued and done. Writes ``OUT.txt`` and ``OUT.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pickle
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from tessera.admission import TenantLimits
from tessera.engine import Caller
from tessera.engine.ipc import decode, encode
from tessera.engine.lifecycle import ServedModel
from tessera.engine.messages import (
    Done,
    Message,
    Payload,
    Queued,
    Settled,
    State,
    Submit,
    to_engine,
    to_gateway,
)
from tessera.metrics import EngineStats
from tessera.tasks.types import Task, TextInput

DIMENSIONS = 384
_LENGTH = struct.Struct("!I")


def old_frame(message: tuple[Any, ...]) -> bytes:
    """The old frame: a pickle of the tuple, behind its length."""
    body = pickle.dumps(message, protocol=5)
    return _LENGTH.pack(len(body)) + body


def old_read(frame: bytes) -> tuple[Any, ...]:
    message = pickle.loads(frame[_LENGTH.size :])
    if not isinstance(message, tuple) or not message:
        raise ValueError("a frame is a non-empty tuple")
    return message


@dataclass(frozen=True)
class Case:
    """One message, built from its values the old way and the new."""

    name: str
    old: Callable[[], tuple[Any, ...]]
    new: Callable[[], Message]
    decoder: msgspec.msgpack.Decoder[Any]

    def old_round_trip(self) -> object:
        return old_read(old_frame(self.old()))

    def new_round_trip(self) -> object:
        return decode(encode(self.new())[_LENGTH.size :], self.decoder)


def request_cases(num_items: int) -> list[Case]:
    """A request of ``num_items`` short texts: its submit, queued and done."""
    texts = [
        TextInput(f"the quick brown fox jumps over the lazy dog {i}") for i in range(num_items)
    ]
    caller = Caller(TenantLimits("tenant-7", qps=50.0, burst=100, max_concurrency=8))
    # A runtime's outputs: rows of one batch's matrix.
    rng = np.random.default_rng(7)
    outputs = list(rng.standard_normal((num_items, DIMENSIONS), dtype=np.float32))
    request_id = "01JEXAMPLE7Q3V9K2M4N6P8R0T"
    units = float(num_items)
    label = f"{num_items} text" + ("s" if num_items > 1 else "")
    return [
        Case(
            f"submit, {label}",
            lambda: (
                "submit",
                17,
                "minilm",
                Task.EMBEDDING,
                list(texts),
                30.0,
                caller,
                request_id,
                (),
            ),
            lambda: Submit(
                17, "minilm", Task.EMBEDDING, Payload(list(texts)), 30.0, caller, request_id, ()
            ),
            to_engine,
        ),
        Case(
            f"queued, {label}",
            lambda: ("queued", 17, "minilm", "1", units, 30.0),
            lambda: Queued(17, "minilm", "1", units, 30.0),
            to_gateway,
        ),
        Case(
            f"done, {label}",
            lambda: ("done", 17, outputs, 0.004, 0.012, num_items, units),
            lambda: Done(17, Payload(outputs), 0.004, 0.012, num_items, units, 0.003),
            to_gateway,
        ),
    ]


async def engine_state(num_models: int) -> tuple[str, dict[str, ServedModel], EngineStats]:
    """A fake engine's phase, served models and interval snapshot, after a
    few batches on every model."""
    from engine_ceiling_bench import fake_engine, model_names

    with tempfile.TemporaryDirectory() as tmp:
        async with fake_engine(Path(tmp), num_models) as engine:
            names = model_names(num_models)
            items = [TextInput("a")]
            for _ in range(4):
                await asyncio.gather(*(engine.infer(n, Task.EMBEDDING, items) for n in names))
            pushed = {model.name: model.num_batches for model in engine.snapshot().models}
            for name in names[: num_models // 2]:
                await engine.infer(name, Task.EMBEDDING, items)
            return engine.phase, engine.served_models(), engine.snapshot(batches_since=pushed)


def other_cases(phase: str, served: dict[str, ServedModel], snapshot: EngineStats) -> list[Case]:
    return [
        Case("settled", lambda: ("settled", 17, 3.5), lambda: Settled(17, 3.5, 0.003), to_gateway),
        Case(
            "state, the interval's",
            lambda: ("state", phase, None, snapshot, False),
            lambda: State(phase, None, Payload(snapshot), whole=False),
            to_gateway,
        ),
        Case(
            "state, whole",
            lambda: ("state", phase, served, snapshot, True),
            lambda: State(phase, Payload(served), Payload(snapshot), whole=True),
            to_gateway,
        ),
    ]


def per_message_us(run: Callable[[], object], number: int) -> float:
    """CPU µs per ``run()``: this thread's own time, so that what the
    scheduler gives other processes on a shared machine is not counted."""
    began = time.thread_time()
    for _ in range(number):
        run()
    return (time.thread_time() - began) / number * 1e6


def measure(cases: list[Case], rounds: int, slice_s: float) -> list[dict[str, Any]]:
    """Each case's old and new µs per message, interleaved (module notes)."""
    numbers: dict[str, int] = {}
    for case in cases:  # a warm-up (first calls build caches), and each case's count
        per_message_us(case.old_round_trip, 10)
        took_us = per_message_us(case.old_round_trip, 10)
        numbers[case.name] = max(3, round(slice_s * 1e6 / took_us))
    times: dict[str, tuple[list[float], list[float]]] = {case.name: ([], []) for case in cases}
    for round_ in range(rounds):
        for case in cases:
            olds, news = times[case.name]
            number = numbers[case.name]
            if round_ % 2:
                news.append(per_message_us(case.new_round_trip, number))
                olds.append(per_message_us(case.old_round_trip, number))
            else:
                olds.append(per_message_us(case.old_round_trip, number))
                news.append(per_message_us(case.new_round_trip, number))
    rows = []
    for case in cases:
        olds, news = times[case.name]
        old_q = statistics.quantiles(olds, n=4)
        new_q = statistics.quantiles(news, n=4)
        old_us, new_us = statistics.median(olds), statistics.median(news)
        rows.append(
            {
                "message": case.name,
                "number": numbers[case.name],
                "old_bytes": len(old_frame(case.old())),
                "new_bytes": len(encode(case.new())),
                "old_us": old_us,
                "old_q1_us": old_q[0],
                "old_q3_us": old_q[2],
                "new_us": new_us,
                "new_q1_us": new_q[0],
                "new_q3_us": new_q[2],
                "ratio": new_us / old_us,
            }
        )
    return rows


def per_request(rows: list[dict[str, Any]], label: str) -> dict[str, Any]:
    picked = [r for r in rows if r["message"].endswith(label) and "state" not in r["message"]]
    old_us = sum(r["old_us"] for r in picked)
    new_us = sum(r["new_us"] for r in picked)
    return {"request": label, "old_us": old_us, "new_us": new_us, "ratio": new_us / old_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--slice-ms", type=float, default=2.0)
    parser.add_argument("--models", type=int, default=20)
    date = datetime.date.today().isoformat()
    parser.add_argument("--out", type=Path, default=Path(f"benchmarks/results/{date}-ipc"))
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    phase, served, snapshot = asyncio.run(engine_state(args.models))
    cases = [*request_cases(1), *request_cases(32), *other_cases(phase, served, snapshot)]
    rows = measure(cases, args.rounds, args.slice_ms / 1000)
    requests = [per_request(rows, "1 text"), per_request(rows, "32 texts")]
    load = (load_before, os.getloadavg()[0])

    lines = [
        f"IPC messages, old (pickled tuples) against new (typed messages), {date}",
        f"{args.rounds} rounds; in each, every message's round trips (build, frame, read"
        f" back) for about {args.slice_ms:g} ms the old way and as many the new, interleaved;"
        " the median round, [quartiles], in CPU µs per message (this thread's time).",
        f"State: {args.models} fake embedding models. The machine's load average:"
        f" {load[0]:.1f} before, {load[1]:.1f} after, on {os.cpu_count()} CPUs.",
        "",
        f"{'message':<24} {'old µs':>22} {'new µs':>22} {'new/old':>8} {'bytes, old/new':>16}",
    ]
    for row in rows:
        old = f"{row['old_us']:.2f} [{row['old_q1_us']:.2f}-{row['old_q3_us']:.2f}]"
        new = f"{row['new_us']:.2f} [{row['new_q1_us']:.2f}-{row['new_q3_us']:.2f}]"
        sizes = f"{row['old_bytes']}/{row['new_bytes']}"
        lines.append(f"{row['message']:<24} {old:>22} {new:>22} {row['ratio']:>8.2f} {sizes:>16}")
    lines += ["", "A request (submit, queued, done):"]
    for request in requests:
        lines.append(
            f"{request['request']:<24} {request['old_us']:>22.2f} {request['new_us']:>22.2f}"
            f" {request['ratio']:>8.2f}"
        )
    text = "\n".join(lines) + "\n"
    print(text, end="")
    figures = {
        "date": date,
        "rounds": args.rounds,
        "slice_ms": args.slice_ms,
        "models": args.models,
        "load_average": {"before": load[0], "after": load[1], "cpus": os.cpu_count()},
        "messages": rows,
        "requests": requests,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".txt").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"wrote {args.out}.txt and .json")


if __name__ == "__main__":
    main()
