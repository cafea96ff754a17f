"""The server's cost per HTTP request, with a model that costs nothing, side by
side with other source trees.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/gateway_ceiling_bench.py \
        [--against SRC ...] [--gateways 0] [--concurrency 64] [--seconds 5] \
        [--rounds 3] [--tenants N] [--out benchmarks/results]

For each round, for each source tree in turn (this checkout's ``src``, then
each ``--against`` folder, e.g. ``src`` of a ``git worktree`` of an older
commit, put first on ``PYTHONPATH``), one ``tessera serve --no-auth
--gateways N`` over one ``fake`` embedding model (no sleep, batches of up to
64 within 2 ms), driven from this process by ``--concurrency`` keep-alive
HTTP/1.1 connections, each sending ``POST /v1/embeddings`` with one sentence
and waiting for the answer, for ``--seconds`` after a warm-up of 1 s (with
``--tenants N``, a server with authentication and N tenants made through
its admin API, a key each, and each request with the next tenant's key:
what many tenants cost in the server). What it
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
from harness.fake_models import fake_adapter_args, harness_pythonpath
from harness.probes import CpuMeter
from harness.report import write_report
from harness.servers import running_tessera
from harness.trees import rerun_command, tree_sources

BODY = json.dumps({"model": "echo", "input": "hello world"}).encode()


def request_bytes(key: str | None = None) -> bytes:
    """One request, with ``key`` as its bearer token where given."""
    auth = f"authorization: Bearer {key}\r\n" if key is not None else ""
    head = (
        "POST /v1/embeddings HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"{auth}content-type: application/json\r\ncontent-length: {len(BODY)}\r\n\r\n"
    )
    return head.encode() + BODY


async def connection(
    port: int, stop: float, counts: list[int], requests: list[bytes], first: int = 0
) -> None:
    """One keep-alive connection sending ``requests`` in turn from ``first``
    until ``stop``; counts[0] answers with 200, counts[1] any other."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = first
    try:
        while time.perf_counter() < stop:
            writer.write(requests[sent % len(requests)])
            sent += 1
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


async def drive(
    port: int, concurrency: int, seconds: float, requests: list[bytes]
) -> tuple[int, int, float]:
    counts = [0, 0]
    began = time.perf_counter()
    stop = began + seconds
    spread = max(1, len(requests) // concurrency)  # each connection from its own tenant on
    await asyncio.gather(
        *(connection(port, stop, counts, requests, i * spread) for i in range(concurrency))
    )
    return counts[0], counts[1], time.perf_counter() - began


def tenant_keys(base_url: str, admin_key: str, tenants: int) -> list[str]:
    """``tenants`` tenants made through the admin API, and a key for each."""
    import httpx

    keys = []
    with httpx.Client(base_url=base_url, headers={"authorization": f"Bearer {admin_key}"}) as http:
        for i in range(tenants):
            http.post("/admin/tenants", json={"name": f"tenant-{i}"}).raise_for_status()
            made = http.post("/admin/keys", json={"tenant": f"tenant-{i}"})
            made.raise_for_status()
            keys.append(made.json()["key"])
    return keys


def fake_repository(root: Path) -> Path:
    folder = root / "repo" / "echo"
    folder.mkdir(parents=True)
    card: dict[str, object] = {"name": "echo", "task": "embedding", "runtime": "torch"}
    card["adapter"] = "fake"
    card.update(preload=True, batching=BATCHING, options={"own_bytes": 1000})
    (folder / "model.yaml").write_text(json.dumps(card))
    return root / "repo"


def one_run(
    work: Path,
    label: str,
    source: Path | None,
    gateways: int,
    concurrency: int,
    seconds: float,
    tenants: int = 0,
) -> dict[str, Any]:
    args = [] if tenants else ["--no-auth"]
    args += ["--model-repository", str(fake_repository(work / label))]
    args += ["--preload", "echo", "--no-fill", "--device", "cpu", "--gateways", str(gateways)]
    args += fake_adapter_args()
    path = {"PYTHONPATH": str(source)} if source is not None else os.environ
    env = {"PYTHONPATH": harness_pythonpath(path)}
    with running_tessera(work, label, args, env) as server:
        port = int(server.base_url.rsplit(":", 1)[1])
        requests = [request_bytes()]
        if tenants:
            assert server.key is not None, "the server printed no admin key"
            keys = tenant_keys(server.base_url, server.key, tenants)
            requests = [request_bytes(key) for key in keys]
        asyncio.run(drive(port, concurrency, 1.0, requests))  # warm-up
        meter = CpuMeter(server.processes)
        meter.start()
        ok, other, elapsed = asyncio.run(drive(port, concurrency, seconds, requests))
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
    parser.add_argument(
        "--tenants", type=int, default=0, help="requests from N tenants in turn (0: no auth)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    sources = tree_sources(args.against)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(1, args.rounds + 1):
            for index, (name, source) in enumerate(sources):
                work = Path(tmp) / f"r{round_}-s{index}"
                run = one_run(
                    work,
                    "server",
                    source,
                    args.gateways,
                    args.concurrency,
                    args.seconds,
                    args.tenants,
                )
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
    served = "--no-auth " if not args.tenants else ""
    each = f", each request with the next of {args.tenants} tenants' keys" if args.tenants else ""
    if args.tenants:
        rerun += f" --tenants {args.tenants}"
    if args.rounds != 3:
        rerun += f" --rounds {args.rounds}"
    lines = [
        f"# The server's cost per HTTP request, {date}",
        "",
        f"`tessera serve {served}--gateways {args.gateways}` over one `fake` embedding model"
        f" that costs nothing{each}; {args.concurrency} keep-alive connections from the benchmark's"
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
