"""A keyless client streaming a huge request head, against a tenant's embeddings.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/head_flood.py \
        [--head-mib 100] [--requests 200] [--out benchmarks/results]

One `tessera serve` (keys on, ``all-minilm-l6-v2`` preloaded, nothing else
filled), a tenant and its key made through the admin API. The tenant sends
``--requests`` embeddings of one sentence, one at a time, alone; then the
same while another process, without a key, streams a head of one header
line ``--head-mib`` MiB long as fast as the server reads it, connecting
again each time the server cuts it. Reports the tenant's p50 and p99 alone
and under the flood (and their ratio), and for the streamer: the heads it
began, their answers' statuses, the bytes each sent before its cut, and the
seconds from its first byte to its answer (p50, max). Bars: p50 under the
flood within 2x alone; every streamer answered 431/400 within 1 s. Writes
``OUT/head-flood-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import multiprocessing.synchronize
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from harness.report import write_report
from harness.servers import running_tessera

MODEL = "all-minilm-l6-v2"
SENTENCE = "The quick brown fox jumps over the lazy dog."
HEAD_START = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nX-Flood: "
CHUNK = b"a" * (1 << 20)
P50_BAR = 2.0
ANSWER_BAR_S = 1.0


def flood(port: int, head_bytes: int, stop: multiprocessing.synchronize.Event, out: Any) -> None:
    """In a process of its own: stream heads until ``stop``; their figures to ``out``."""
    heads = []
    while not stop.is_set():
        sent = 0
        began = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.settimeout(30)
            try:
                sock.sendall(HEAD_START)
                while sent < head_bytes and not stop.is_set():
                    sock.sendall(CHUNK)
                    sent += len(CHUNK)
            except OSError:
                pass  # cut: its answer comes next
            answer = b""
            try:
                while chunk := sock.recv(65536):
                    answer += chunk
            except OSError:
                pass
        answered_s = time.perf_counter() - began
        status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
        heads.append({"status": status, "sent_bytes": sent, "answer_s": answered_s})
    out.put(heads)


def embeddings(base_url: str, key: str, count: int) -> list[float]:
    """Seconds of ``count`` embeddings, one after another."""
    seconds = []
    headers = {"authorization": f"Bearer {key}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
        for _ in range(count):
            start = time.perf_counter()
            answer = client.post("/v1/embeddings", json={"model": MODEL, "input": SENTENCE})
            seconds.append(time.perf_counter() - start)
            answer.raise_for_status()
    return seconds


def latency(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def tenant_key(base_url: str, admin_key: str) -> str:
    with httpx.Client(base_url=base_url, headers={"authorization": f"Bearer {admin_key}"}) as http:
        http.post("/admin/tenants", json={"name": "acme"}).raise_for_status()
        made = http.post("/admin/keys", json={"tenant": "acme"})
        made.raise_for_status()
        return str(made.json()["key"])


def measure(base_url: str, key: str, requests: int, head_bytes: int) -> dict[str, Any]:
    embeddings(base_url, key, 20)  # warm: connections, the model's first batches
    alone = embeddings(base_url, key, requests)
    port = int(base_url.rsplit(":", 1)[1])
    context = multiprocessing.get_context("spawn")
    stop, out = context.Event(), context.Queue()
    streamer = context.Process(target=flood, args=(port, head_bytes, stop, out))
    streamer.start()
    try:
        time.sleep(0.5)  # the streamer is connected and sending
        flooded = embeddings(base_url, key, requests)
    finally:
        stop.set()
        heads = out.get(timeout=60)
        streamer.join(timeout=60)
    return {"alone": alone, "flooded": flooded, "heads": heads}


def figures_of(run: dict[str, Any], head_bytes: int) -> dict[str, Any]:
    alone, flooded, heads = latency(run["alone"]), latency(run["flooded"]), run["heads"]
    answers = [h["answer_s"] for h in heads]
    statuses: dict[str, int] = {}
    for h in heads:
        statuses[str(h["status"])] = statuses.get(str(h["status"]), 0) + 1
    return {
        "model": MODEL,
        "requests": len(run["alone"]),
        "head_bytes": head_bytes,
        "alone": alone,
        "flooded": flooded,
        "p50_ratio": flooded["p50_ms"] / alone["p50_ms"],
        "heads": len(heads),
        "head_statuses": statuses,
        "sent_bytes_max": max((h["sent_bytes"] for h in heads), default=0),
        "answer_s_p50": statistics.median(answers) if answers else None,
        "answer_s_max": max(answers, default=None),
    }


def markdown(f: dict[str, Any], date: str) -> str:
    p50_ok = f["p50_ratio"] <= P50_BAR
    answered_ok = (
        f["heads"] > 0
        and set(f["head_statuses"]) <= {"431", "400"}
        and f["answer_s_max"] <= ANSWER_BAR_S
    )
    mib = f["head_bytes"] / (1 << 20)
    return "\n".join(
        [
            f"# A {mib:.0f} MiB request head against a tenant's embeddings, {date}",
            "",
            f"`{MODEL}`, one sentence a request, {f['requests']} one after another, alone",
            f"then while a keyless process streams a {mib:.0f} MiB header line (connecting",
            "again when cut). Rerun: `HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/head_flood.py`.",
            "",
            "| tenant's embeddings | p50 ms | p99 ms |",
            "|---|---|---|",
            f"| alone | {f['alone']['p50_ms']:.1f} | {f['alone']['p99_ms']:.1f} |",
            f"| under the flood | {f['flooded']['p50_ms']:.1f} | {f['flooded']['p99_ms']:.1f} |",
            "",
            f"- p50 under the flood / alone: {f['p50_ratio']:.2f}"
            f" (bar {P50_BAR:g}: {'met' if p50_ok else 'NOT met'})",
            f"- heads streamed: {f['heads']}, answers {f['head_statuses']};"
            f" most sent before a cut: {f['sent_bytes_max'] / (1 << 20):.1f} MiB",
            f"- first byte to answer: p50 {1000 * (f['answer_s_p50'] or 0):.1f} ms,"
            f" max {1000 * (f['answer_s_max'] or 0):.1f} ms"
            f" (bar {ANSWER_BAR_S:g} s: {'met' if answered_ok else 'NOT met'})",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-mib", type=int, default=100)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    head_bytes = args.head_mib << 20
    with tempfile.TemporaryDirectory(prefix="tessera-head-flood-") as tmp:
        serve = ["--preload", MODEL, "--no-fill"]
        with running_tessera(Path(tmp), "server", serve) as server:
            if server.key is None:
                raise RuntimeError("the server printed no admin key")
            key = tenant_key(server.base_url, server.key)
            run = measure(server.base_url, key, args.requests, head_bytes)
    figures = figures_of(run, head_bytes)
    date = datetime.date.today().isoformat()
    write_report(args.out, date, "head-flood", figures, markdown(figures, date))


if __name__ == "__main__":
    main()
