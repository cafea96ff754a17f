"""Soak: one tessera server under a mixed load for a long time, watched for leaks.

    .venv/bin/python benchmarks/soak.py                      (30 minutes)
    .venv/bin/python benchmarks/soak.py --duration-s 300     (a short look)

What it compares is the server with itself over time. One `tessera serve` with
the default models (three tenants with keys, and an admin key) gets a closed-loop
mixed load from ``--concurrency`` callers for ``--duration-s`` seconds: OpenAI
embeddings (two models), rerank, intent classification, KServe v2 infer,
translation, speech, OCR pages, short chat completions, bad requests (400, 404,
413, 415: each must come back as that 4xx) and callers that hang up before the
answer. Every ``--sample-s`` seconds it samples the server's resident set
(its process and every child), open file descriptors and threads.

It reports: requests by status (5xx must be 0), the resident set at 5 minutes
(or a sixth of a shorter run) and at the end (growth must stay under 5%), each
the least of the samples over two minutes from that point (the floor: a single
sample swings with the batches running at that instant), file
descriptors at the same two points, the SQLite files' sizes at the end, and the
server's exit status after SIGTERM. JSON and Markdown go to
``benchmarks/results/soak-YYYY-MM-DD[-N].{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from harness.inputs import sentences
from harness.machine import machine_info
from harness.report import output_stem, table
from harness.servers import RunningServer, log, running_tessera, stop_group
from tessera.tasks.samples import sample_page
from tessera.tenants import TenantStore

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MIB = 1024**2
EARLY_MARK_S = 300.0
WINDOW_S = 120.0
BAR_RSS_GROWTH = 0.05
TENANTS = ("acme", "globex", "initech")


@dataclass
class Sample:
    t_s: float
    rss_bytes: int
    fds: int
    threads: int
    processes: int


@dataclass
class Call:
    """One kind of request: its weight in the mix, and how to send it."""

    name: str
    weight: float
    send: Callable[[httpx.AsyncClient, random.Random], Any]
    expect: int = 200  # the status it must get (a bad request's 4xx)
    hang_up: bool = False  # the caller gives up before the answer


def _png(height: int, width: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(sample_page(height, width)[:, :, ::-1]).save(buffer, format="PNG")
    return buffer.getvalue()


def calls() -> list[Call]:
    texts = sentences(256)
    page = base64.b64encode(_png(240, 480)).decode()

    def pick(rng: random.Random, n: int) -> list[str]:
        return rng.sample(texts, n)

    def post(path: str, body: Callable[[random.Random], dict[str, Any]]) -> Any:
        return lambda client, rng: client.post(path, json=body(rng))

    kserve = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": texts[:2]}]}
    return [
        Call(
            "embeddings",
            30,
            post("/v1/embeddings", lambda r: {"model": "all-minilm-l6-v2", "input": pick(r, 4)}),
        ),
        Call(
            "embeddings-int8",
            6,
            post(
                "/v1/embeddings",
                lambda r: {"model": "all-minilm-l6-v2-int8", "input": pick(r, 1)},
            ),
        ),
        Call(
            "rerank",
            8,
            post(
                "/v1/rerank",
                lambda r: {
                    "model": "minilm-rerank",
                    "query": pick(r, 1)[0],
                    "documents": pick(r, 4),
                },
            ),
        ),
        Call(
            "classify",
            8,
            post("/v1/classify", lambda r: {"model": "intent-minilm", "input": pick(r, 2)}),
        ),
        Call(
            "kserve",
            6,
            lambda c, r: c.post("/v2/models/all-minilm-l6-v2/infer", json=kserve),
        ),
        Call(
            "translate",
            6,
            post("/v1/translate", lambda r: {"model": "bergamot-en-pt", "input": pick(r, 1)[0]}),
        ),
        Call(
            "speech",
            3,
            post(
                "/v1/audio/speech",
                lambda r: {"model": "piper-joe", "voice": "joe", "input": "Your order is ready."},
            ),
        ),
        Call("ocr", 3, post("/v1/ocr", lambda r: {"model": "pp-ocrv6", "image": page})),
        Call(
            "chat",
            3,
            post(
                "/v1/chat/completions",
                lambda r: {
                    "model": "smollm2-135m",
                    "messages": [{"role": "user", "content": "Say hello."}],
                    "max_tokens": 8,
                },
            ),
        ),
        Call(
            "hang-up",
            3,
            post(
                "/v1/chat/completions",
                lambda r: {
                    "model": "smollm2-135m",
                    "messages": [{"role": "user", "content": "Tell a long story."}],
                    "max_tokens": 200,
                },
            ),
            hang_up=True,
        ),
        Call(
            "unknown-model",
            2,
            post("/v1/embeddings", lambda r: {"model": "no-such-model", "input": "x"}),
            expect=404,
        ),
        Call(
            "invalid-json",
            2,
            lambda c, r: c.post(
                "/v1/embeddings",
                content=b'{"model": ',
                headers={"content-type": "application/json"},
            ),
            expect=400,
        ),
        Call(
            "broken-image",
            1,
            post("/v1/ocr", lambda r: {"model": "pp-ocrv6", "image": "R0lGODlhYnJva2Vu"}),
            expect=415,
        ),
        Call(
            "too-many-inputs",
            1,
            post("/v1/embeddings", lambda r: {"model": "all-minilm-l6-v2", "input": ["x"] * 300}),
            expect=413,
        ),
    ]


class Tally:
    def __init__(self) -> None:
        self.by_status: Counter[int] = Counter()
        self.by_call: dict[str, Counter[str]] = {}
        self.unexpected: list[str] = []
        self.hung_up = 0

    def count(self, call: Call, status: int, body: str) -> None:
        self.by_status[status] += 1
        self.by_call.setdefault(call.name, Counter())[str(status)] += 1
        if status != call.expect and len(self.unexpected) < 20:
            self.unexpected.append(f"{call.name}: {status} {body[:200]}")


async def _caller(
    base_url: str, key: str, mix: list[Call], seed: int, until: float, tally: Tally
) -> None:
    rng = random.Random(seed)
    weights = [c.weight for c in mix]
    headers = {"Authorization": f"Bearer {key}"}
    # Idle connections are dropped well before the server's keep-alive timeout
    # (uvicorn's 5 s), so that no request races the server closing its connection.
    limits = httpx.Limits(keepalive_expiry=2.0)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=120, limits=limits
    ) as client:
        while time.monotonic() < until:
            call = rng.choices(mix, weights)[0]
            try:
                if call.hang_up:
                    response = await asyncio.wait_for(call.send(client, rng), timeout=0.3)
                else:
                    response = await call.send(client, rng)
            except TimeoutError:
                tally.hung_up += 1
                continue
            except httpx.HTTPError as e:
                tally.count(call, 0, f"{type(e).__name__}: {e}")
                continue
            tally.count(call, response.status_code, response.text)


def _sample(server: RunningServer, started: float) -> Sample:
    rss = fds = threads = 0
    processes = server.processes()
    for process in processes:
        try:
            rss += process.memory_info().rss
            fds += process.num_fds()
            threads += process.num_threads()
        except psutil.Error:
            continue
    return Sample(round(time.monotonic() - started, 1), rss, fds, threads, len(processes))


async def _sampler(
    server: RunningServer, started: float, every_s: float, until: float, out: list[Sample]
) -> None:
    while time.monotonic() < until:
        out.append(_sample(server, started))
        await asyncio.sleep(every_s)
    out.append(_sample(server, started))


def _window(samples: list[Sample], start_s: float, seconds: float) -> list[Sample]:
    return [s for s in samples if start_s <= s.t_s <= start_s + seconds] or [samples[-1]]


def _floor(window: list[Sample]) -> Sample:
    """The sample of least RSS in a window: what the server keeps, without the
    activations of the batches running at that instant (an OCR page or a chat
    swings a single sample by 100-200 MiB either way)."""
    return min(window, key=lambda s: s.rss_bytes)


def _prepare(data_dir: Path) -> tuple[dict[str, str], str]:
    data_dir.mkdir(parents=True, exist_ok=True)
    with TenantStore(data_dir) as store:
        store.add_tenant("soak-admin")
        admin = store.create_key("soak-admin", admin=True).key
        keys = {}
        for tenant in TENANTS:
            store.add_tenant(tenant)
            keys[tenant] = store.create_key(tenant).key
    return keys, admin


async def _drive(
    server: RunningServer, keys: dict[str, str], args: argparse.Namespace
) -> tuple[Tally, list[Sample], float]:
    mix = calls()
    tally, samples = Tally(), list[Sample]()
    started = time.monotonic()
    until = started + args.duration_s
    callers = [
        _caller(server.base_url, keys[TENANTS[i % len(TENANTS)]], mix, i, until, tally)
        for i in range(args.concurrency)
    ]
    sampler = _sampler(server, started, args.sample_s, until, samples)
    await asyncio.gather(sampler, *callers)
    return tally, samples, time.monotonic() - started


def _sqlite_sizes(data_dir: Path) -> dict[str, int]:
    return {
        p.name: p.stat().st_size
        for p in sorted(data_dir.iterdir())
        if p.is_file() and ".db" in p.name
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="tessera-soak-"))
    keys, admin = _prepare(work / "data-soak")
    serve_args = ["--log-level", "warning"]
    if args.memory_budget:
        serve_args += ["--memory-budget", args.memory_budget]
    with running_tessera(work, "soak", serve_args) as server:
        server.key = admin
        tally, samples, seconds = asyncio.run(_drive(server, keys, args))
        audit_rows = httpx.get(
            f"{server.base_url}/admin/usage", headers=server.headers, timeout=30
        ).json()
        stop_group(server.process)
        exit_status = server.process.returncode
    early_mark = min(EARLY_MARK_S, args.duration_s / 6)
    window_s = min(WINDOW_S, args.duration_s / 6)
    early = _floor(_window(samples, early_mark, window_s))
    end = _floor(_window(samples, samples[-1].t_s - window_s, window_s))
    growth = (end.rss_bytes - early.rss_bytes) / early.rss_bytes
    errors_5xx = sum(n for status, n in tally.by_status.items() if status >= 500 or status == 0)
    return {
        "about": "one tessera server, default models, mixed load; itself over time",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "machine": machine_info(),
        "duration_s": round(seconds, 1),
        "concurrency": args.concurrency,
        "requests": sum(tally.by_status.values()),
        "hung_up": tally.hung_up,
        "by_status": {str(k): v for k, v in sorted(tally.by_status.items())},
        "by_call": {k: dict(v) for k, v in sorted(tally.by_call.items())},
        "unexpected": tally.unexpected,
        "errors_5xx": errors_5xx,
        "early_mark_s": early_mark,
        "window_s": window_s,
        "rss_max_bytes": max(x.rss_bytes for x in samples),
        "rss_early_bytes": early.rss_bytes,
        "rss_end_bytes": end.rss_bytes,
        "rss_growth": round(growth, 4),
        "fds_early": early.fds,
        "fds_end": end.fds,
        "threads_early": early.threads,
        "threads_end": end.threads,
        "sqlite_bytes": _sqlite_sizes(work / "data-soak"),
        "usage": audit_rows,
        "exit_status_after_sigterm": exit_status,
        "samples": [asdict(s) for s in samples],
        "bars": {
            "errors_5xx == 0": errors_5xx == 0,
            f"rss growth < {BAR_RSS_GROWTH:.0%}": growth < BAR_RSS_GROWTH,
            "every request got its expected status": not tally.unexpected,
        },
    }


def markdown(result: dict[str, Any]) -> str:
    rows = [
        ["requests", str(result["requests"])],
        ["callers that hung up", str(result["hung_up"])],
        ["by status", ", ".join(f"{k}: {v}" for k, v in result["by_status"].items())],
        ["5xx (and dropped connections)", str(result["errors_5xx"])],
        [
            f"RSS floor over {result['window_s']:.0f} s from {result['early_mark_s']:.0f} s"
            " / over the last ones",
            f"{result['rss_early_bytes'] / MIB:.0f} / {result['rss_end_bytes'] / MIB:.0f} MiB"
            f" ({result['rss_growth']:+.1%})",
        ],
        ["RSS peak", f"{result['rss_max_bytes'] / MIB:.0f} MiB"],
        ["open fds early / end", f"{result['fds_early']} / {result['fds_end']}"],
        ["threads early / end", f"{result['threads_early']} / {result['threads_end']}"],
        [
            "SQLite files at the end",
            ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in result["sqlite_bytes"].items()),
        ],
        ["exit status after SIGTERM", str(result["exit_status_after_sigterm"])],
    ]
    bars = [[bar, "met" if ok else "MISSED"] for bar, ok in result["bars"].items()]
    calls_rows = [
        [name, ", ".join(f"{s}: {n}" for s, n in counts.items())]
        for name, counts in result["by_call"].items()
    ]
    unexpected = "\n".join(f"- {u}" for u in result["unexpected"]) or "none"
    return "\n\n".join(
        [
            f"# Soak, {result['date']}",
            f"{result['about']}; {result['duration_s']:.0f} s at concurrency"
            f" {result['concurrency']}. Rerun: `{result['command']}`",
            table(["figure", "measured"], rows),
            table(["bar", "verdict"], bars),
            table(["call", "statuses"], calls_rows),
            f"Unexpected statuses (first 20): {unexpected}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--memory-budget", default=None, help="default: the device's share")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    result = run(args)
    day = datetime.now(UTC).date().isoformat()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = output_stem(args.out_dir, day, "soak")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    stem.with_suffix(".md").write_text(text + "\n")
    print(text)
    log(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
