"""The server's cost per HTTP request, with a model that costs nothing, side by
side with other source trees.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/gateway_ceiling_bench.py \
        [--against SRC ...] [--gateways 0] [--concurrency 64] [--seconds 5] \
        [--rounds 3] [--out benchmarks/results]

For each round, for each source tree in turn (this checkout's ``src``, then
each ``--against`` folder, e.g. ``src`` of a ``git worktree`` of an older
commit, put first on ``PYTHONPATH``), one ``tessera serve --no-auth
--gateways N`` over one ``fake`` embedding model (no sleep, batches of up to
64 within 2 ms), driven from this process by ``--concurrency`` keep-alive
HTTP/1.1 connections, each sending ``POST /v1/embeddings`` with one sentence
and waiting for the answer, for ``--seconds`` after a warm-up of 1 s. What it
measures is what the server costs around the model: HTTP, the app, its
middleware, JSON, the engine. Reports requests a second and the server's CPU
milliseconds a request (user + system of its processes over the run, divided
by the answers): on this shared 2-core machine, where the client takes a core
too, the CPU a request is the steadier figure, and each round's ratio to this
checkout in the same round the fairest. Writes
``OUT/gateway-ceiling-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_ceiling_bench import BATCHING
from harness.probes import CpuMeter
from harness.report import write_report
from harness.servers import running_tessera
from harness.trees import rerun_command, tree_sources

BODY = json.dumps({"model": "echo", "input": "hello world"}).encode()


def request_bytes() -> bytes:
    head = (
        "POST /v1/embeddings HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"content-type: application/json\r\ncontent-length: {len(BODY)}\r\n\r\n"
    )
    return head.encode() + BODY


async def connection(port: int, stop: float, counts: list[int]) -> None:
    """One keep-alive connection sending requests until ``stop``; counts[0]
    answers with 200, counts[1] any other."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = request_bytes()
    try:
        while time.perf_counter() < stop:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            counts[0 if head.startswith(b"HTTP/1.1 200") else 1] += 1
    finally:
        writer.close()


async def drive(port: int, concurrency: int, seconds: float) -> tuple[int, int, float]:
    counts = [0, 0]
    began = time.perf_counter()
    stop = began + seconds
    await asyncio.gather(*(connection(port, stop, counts) for _ in range(concurrency)))
    return counts[0], counts[1], time.perf_counter() - began


def fake_repository(root: Path) -> Path:
    folder = root / "repo" / "echo"
    folder.mkdir(parents=True)
    card: dict[str, object] = {"name": "echo", "task": "embedding", "runtime": "torch"}
    card["adapter"] = "fake"
    card.update(preload=True, batching=BATCHING, options={"own_bytes": 1000})
    (folder / "model.yaml").write_text(json.dumps(card))
    return root / "repo"


def one_run(
    work: Path, label: str, source: Path | None, gateways: int, concurrency: int, seconds: float
) -> dict[str, Any]:
    args = ["--no-auth", "--model-repository", str(fake_repository(work / label))]
    args += ["--preload", "echo", "--no-fill", "--device", "cpu", "--gateways", str(gateways)]
    env = {"PYTHONPATH": str(source)} if source is not None else None
    with running_tessera(work, label, args, env) as server:
        port = int(server.base_url.rsplit(":", 1)[1])
        asyncio.run(drive(port, concurrency, 1.0))  # warm-up
        meter = CpuMeter(server.processes)
        meter.start()
        ok, other, elapsed = asyncio.run(drive(port, concurrency, seconds))
        cpu_s = meter.stop()
    return {
        "req_per_s": ok / elapsed,
        "not_ok": other,
        "server_cpu_ms_per_request": 1000 * cpu_s / max(ok, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", type=Path, nargs="*", default=[])
    parser.add_argument("--gateways", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    sources = tree_sources(args.against)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(1, args.rounds + 1):
            for index, (name, source) in enumerate(sources):
                work = Path(tmp) / f"r{round_}-s{index}"
                run = one_run(work, "server", source, args.gateways, args.concurrency, args.seconds)
                run.update(round=round_, source=name)
                runs.append(run)
                print(
                    f"round {round_}, {name}: {run['req_per_s']:.0f} req/s,"
                    f" {run['server_cpu_ms_per_request']:.3f} server CPU ms a request",
                    flush=True,
                )
    names = [name for name, _ in sources]
    medians = {
        name: {
            key: statistics.median(r[key] for r in runs if r["source"] == name)
            for key in ("req_per_s", "server_cpu_ms_per_request")
        }
        for name in names
    }
    ratios = {
        name: statistics.median(
            mine["req_per_s"] / theirs["req_per_s"]
            for mine, theirs in zip(
                (r for r in runs if r["source"] == names[0]),
                (r for r in runs if r["source"] == name),
                strict=True,
            )
        )
        for name in names[1:]
    }
    date = datetime.date.today().isoformat()
    rerun = rerun_command(__file__, args.against)
    rerun += f" --gateways {args.gateways} --concurrency {args.concurrency}"
    lines = [
        f"# The server's cost per HTTP request, {date}",
        "",
        f"`tessera serve --no-auth --gateways {args.gateways}` over one `fake` embedding model"
        f" that costs nothing; {args.concurrency} keep-alive connections from the benchmark's"
        f" process, one sentence a request, {args.seconds:g} s a run ({os.cpu_count()} cores,"
        " shared with the client). Rerun:",
        f"`HF_HUB_OFFLINE=1 .venv/bin/python {rerun}`.",
        "",
        "| round | source | req/s | not 200 | server CPU ms a request |",
        "|---|---|---|---|---|",
        *(
            f"| {r['round']} | {r['source']} | {r['req_per_s']:.0f} | {r['not_ok']} |"
            f" {r['server_cpu_ms_per_request']:.3f} |"
            for r in runs
        ),
        "",
        "Medians: "
        + "; ".join(
            f"{name} {m['req_per_s']:.0f} req/s, {m['server_cpu_ms_per_request']:.3f} CPU ms"
            for name, m in medians.items()
        )
        + ".",
        *(
            f"This checkout / {name}, median of the rounds' ratios: {ratio:.2f}x req/s."
            for name, ratio in ratios.items()
        ),
        "",
    ]
    figures = {"gateways": args.gateways, "runs": runs, "medians": medians, "ratios": ratios}
    figures["python"] = sys.version.split()[0]
    write_report(args.out, date, "gateway-ceiling", figures, "\n".join(lines))


if __name__ == "__main__":
    main()
