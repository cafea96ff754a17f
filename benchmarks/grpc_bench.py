"""KServe v2 over gRPC against the same over HTTP, one server, side by side.

    HF_HUB_OFFLINE=1 nice .venv/bin/python benchmarks/grpc_bench.py [--requests 300] \
        [--rounds 3] [--concurrency 1 8] [--out benchmarks/results]

Starts ``tessera serve`` on loopback (no keys, ``all-minilm-l6-v2`` preloaded,
``--grpc-port``), then, for each round and each concurrency, sends the same
one-sentence embedding requests through ``tritonclient.http`` and
``tritonclient.grpc`` (one client a thread, the requests split between the
threads), one protocol after the other. The gRPC calls go through the app's
HTTP routes in process (``gateway/grpc_kserve.py``): the ratio is what that
translation costs, or saves, against HTTP's own parsing. Reports requests a
second and p50 / p99 latency a protocol, and the gRPC / HTTP throughput
ratio; writes ``OUT/grpc-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from harness.report import output_stem

MODEL = "all-minilm-l6-v2"
SENTENCE = b"A quick brown fox jumps over the lazy dog near the river bank today."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(work: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    http_port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "tessera", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(http_port), "--grpc-port", str(grpc_port), "--no-auth"]
    command += ["--data-dir", str(work / "data"), "--preload", MODEL]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with (work / "server.log").open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{http_port}/v2/health/ready").status_code == 200:
                return process, http_port, grpc_port
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    raise RuntimeError(f"the server did not get ready; see {work / 'server.log'}")


def http_caller(port: int) -> Callable[[], None]:
    import tritonclient.http as triton

    client = triton.InferenceServerClient(f"127.0.0.1:{port}")
    tensor = triton.InferInput("TEXT", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([SENTENCE], dtype=object))
    return lambda: client.infer(MODEL, [tensor]).as_numpy("EMBEDDING")


def grpc_caller(port: int) -> Callable[[], None]:
    import tritonclient.grpc as triton

    client = triton.InferenceServerClient(f"127.0.0.1:{port}")
    tensor = triton.InferInput("TEXT", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([SENTENCE], dtype=object))
    return lambda: client.infer(MODEL, [tensor]).as_numpy("EMBEDDING")


def run(make: Callable[[], Callable[[], None]], requests: int, concurrency: int) -> dict[str, Any]:
    """``requests`` calls over ``concurrency`` threads, each with a client of its
    own made in it (tritonclient's HTTP client is gevent's: one thread each)."""
    latencies: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    started: list[float] = []
    ready = threading.Barrier(concurrency, action=lambda: started.append(time.perf_counter()))

    def work(count: int) -> None:
        try:
            call = make()
            call()  # connected and warm
        except BaseException as e:
            errors.append(e)
            ready.abort()
            return
        ready.wait()
        mine = []
        for _ in range(count):
            start = time.perf_counter()
            call()
            mine.append(time.perf_counter() - start)
        with lock:
            latencies.extend(mine)

    shares = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
    threads = [threading.Thread(target=work, args=(n,)) for n in shares]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors or len(latencies) != requests:
        raise RuntimeError(f"{requests - len(latencies)} calls failed: {errors[:1]}")
    seconds = time.perf_counter() - started[0]
    ordered = sorted(latencies)
    return {
        "rps": requests / seconds,
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="grpc-bench-"))
    process, http_port, grpc_port = start_server(work)
    rows: list[dict[str, Any]] = []
    try:
        for round_ in range(1, args.rounds + 1):
            for concurrency in args.concurrency:
                for protocol, make in (
                    ("http", lambda: http_caller(http_port)),
                    ("grpc", lambda: grpc_caller(grpc_port)),
                ):
                    figures = run(make, args.requests, concurrency)
                    row = {"round": round_, "c": concurrency, "protocol": protocol, **figures}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    lines = [
        "| round | c | HTTP req/s | gRPC req/s | gRPC / HTTP | HTTP p50 / p99 ms "
        "| gRPC p50 / p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for round_ in range(1, args.rounds + 1):
        for concurrency in args.concurrency:
            pick = {
                r["protocol"]: r for r in rows if r["round"] == round_ and r["c"] == concurrency
            }
            h, g = pick["http"], pick["grpc"]
            lines.append(
                f"| {round_} | {concurrency} | {h['rps']:.0f} | {g['rps']:.0f} "
                f"| {g['rps'] / h['rps']:.2f} | {h['p50_ms']:.1f} / {h['p99_ms']:.1f} "
                f"| {g['p50_ms']:.1f} / {g['p99_ms']:.1f} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    date = datetime.date.today().isoformat()
    stem = output_stem(args.out, date, "grpc")
    rerun = "HF_HUB_OFFLINE=1 nice .venv/bin/python benchmarks/grpc_bench.py"
    stem.with_suffix(".md").write_text(
        f"# KServe v2 over gRPC against HTTP, {date}\n\n"
        f"One server ({MODEL}, no keys), one-sentence embedding requests through"
        f" tritonclient's HTTP and gRPC clients, one protocol after the other,"
        f" {args.requests} requests a run.\n\n"
        f"Rerun: `{rerun} --requests {args.requests} --rounds {args.rounds}"
        f" --concurrency {' '.join(map(str, args.concurrency))}`\n\n{text}"
    )
    machine = {"cpus": os.cpu_count(), "platform": platform.platform()}
    report = {"date": date, "requests": args.requests, "machine": machine, "rows": rows}
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
