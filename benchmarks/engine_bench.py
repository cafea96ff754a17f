"""Engine benchmark: the raw model, the server at saturation, batching, and a memory budget.

    python benchmarks/engine_bench.py [--quick]      (or: make bench ARGS=--quick)

One run measures, one after the other so that no two share the cores:

1. raw: all-minilm-l6-v2 loaded in-process (in a subprocess), batches of 32
   sentences of about 20 words, with torch on the server's thread budget;
2. the server at saturation: closed-loop load of one-sentence /v1/embeddings
   requests at concurrency 32 and 64; its throughput against the raw one;
3. batching: the same load at concurrency 32 on a copy of the model with
   ``max_batch_size: 1`` (an extra model repository that replaces its descriptor);
4. cycling every default model under ``--memory-budget 700MiB`` while
   ``/admin/residency`` is polled every 100 ms: peak bytes against the budget,
   loads, evictions and failures.

It prints a table of each figure against its bar and writes JSON and Markdown
to ``benchmarks/results/engine-YYYY-MM-DD[-N].{json,md}`` (never overwriting).
The load generator runs on the same machine as the server: its CPU use is
reported next to each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from harness.inputs import sentences
from harness.machine import machine_info
from harness.raw import BATCH_SIZE, run_raw
from harness.report import output_stem, table
from harness.servers import RunningServer, log, running_tessera

EMBED_MODEL = "all-minilm-l6-v2"
BUDGET = "700MiB"
BUDGET_BYTES = 700 * 1024**2
RESULTS_DIR = Path(__file__).resolve().parent / "results"
BAR_SERVER_RAW = 0.85
BAR_BATCHING = 2.0


@dataclass(frozen=True)
class Settings:
    """How long and how hard each phase runs."""

    quick: bool
    threads: int  # the server's default thread budget: every core
    raw_seconds: float
    raw_max_batches: int
    warmup_requests: int
    warmup_seconds: float
    load_requests: int
    load_seconds: float
    concurrencies: tuple[int, ...]
    cycle_rounds: int

    @classmethod
    def make(cls, quick: bool) -> Settings:
        threads = os.cpu_count() or 1
        if quick:
            return cls(True, threads, 6.0, 60, 100, 3.0, 600, 10.0, (32, 64), 2)
        return cls(False, threads, 20.0, 200, 200, 5.0, 2000, 30.0, (32, 64), 3)


# --- servers -------------------------------------------------------------------------


def batch1_repository(work: Path) -> Path:
    """A repository whose all-minilm-l6-v2 descriptor says ``max_batch_size: 1``."""
    from tessera.repository import default_repository_path

    source = default_repository_path() / EMBED_MODEL / "model.yaml"
    raw = yaml.safe_load(source.read_text(encoding="utf-8"))
    raw.setdefault("batching", {})["max_batch_size"] = 1
    folder = work / "repo-batch1" / EMBED_MODEL
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.yaml").write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return folder.parent


# --- phases 2 and 3: closed-loop load ------------------------------------------------


@dataclass
class LoadResult:
    label: str
    concurrency: int
    ok: int
    failures: int
    seconds: float
    req_per_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    server_cpu_cores: float  # server CPU seconds / wall seconds
    client_cpu_cores: float  # this process's CPU seconds / wall seconds
    other_cpu_cores: float  # every other process on the machine (should be ~0)
    errors: dict[str, int] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class _Tally:
    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    issued: int = 0


async def closed_loop(
    clients: list[httpx.AsyncClient], texts: list[str], count: int, seconds: float
) -> tuple[_Tally, float]:
    """One caller per client, each sending its next request as soon as the last
    answers, until ``count`` requests were sent or ``seconds`` passed."""
    tally = _Tally()
    deadline = time.perf_counter() + seconds

    async def caller(client: httpx.AsyncClient) -> None:
        while tally.issued < count and time.perf_counter() < deadline:
            body = {"model": EMBED_MODEL, "input": texts[tally.issued % len(texts)]}
            tally.issued += 1
            start = time.perf_counter()
            try:
                response = await client.post("/v1/embeddings", json=body)
            except httpx.HTTPError as e:
                tally.errors[type(e).__name__] += 1
                continue
            if response.status_code == 200 and b'"embedding"' in response.content:
                tally.latencies.append(time.perf_counter() - start)
            else:
                tally.errors[f"http {response.status_code}"] += 1

    start = time.perf_counter()
    await asyncio.gather(*(caller(client) for client in clients))
    return tally, time.perf_counter() - start


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot."""
    t = psutil.cpu_times()
    return sum(getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))


@dataclass
class CpuMeter:
    """CPU cores used by the server, this process, and everything else, over a span."""

    server: psutil.Process
    start_wall: float = field(default_factory=time.perf_counter)
    start_server: float = 0.0
    start_self: float = field(default_factory=time.process_time)
    start_busy: float = field(default_factory=busy_cpu_seconds)

    def __post_init__(self) -> None:
        self.start_server = sum(self.server.cpu_times()[:2])

    def cores(self) -> tuple[float, float, float]:
        """(server, client, other) cores since the meter started."""
        wall = time.perf_counter() - self.start_wall
        server = sum(self.server.cpu_times()[:2]) - self.start_server
        client = time.process_time() - self.start_self
        other = max(0.0, busy_cpu_seconds() - self.start_busy - server - client)
        return server / wall, client / wall, other / wall


async def measure_load(
    server: RunningServer, label: str, concurrency: int, settings: Settings
) -> LoadResult:
    texts = sentences()
    # One client (one connection) per caller: httpx's shared pool costs ~2-3 ms of
    # client CPU per request at 32-64 connections, which would starve the server.
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=120)
            )
            for _ in range(concurrency)
        ]
        await closed_loop(clients, texts[::-1], settings.warmup_requests, settings.warmup_seconds)
        meter = CpuMeter(psutil.Process(server.process.pid))
        tally, elapsed = await closed_loop(
            clients, texts, settings.load_requests, settings.load_seconds
        )
        server_cores, client_cores, other_cores = meter.cores()
    ms = [1000 * s for s in tally.latencies]
    return LoadResult(
        label=label,
        concurrency=concurrency,
        ok=len(ms),
        failures=sum(tally.errors.values()),
        seconds=round(elapsed, 3),
        req_per_s=len(ms) / elapsed,
        p50_ms=percentile(ms, 0.50),
        p99_ms=percentile(ms, 0.99),
        mean_ms=sum(ms) / len(ms) if ms else float("nan"),
        server_cpu_cores=server_cores,
        client_cpu_cores=client_cores,
        other_cpu_cores=other_cores,
        errors=dict(tally.errors),
    )


def run_load_phase(
    work: Path, label: str, server_args: list[str], concurrencies: tuple[int, ...], s: Settings
) -> tuple[list[LoadResult], dict[str, Any]]:
    results = []
    with running_tessera(work, label, server_args) as server:
        info = {
            "command": shlex.join(server.command),
            "startup_s": round(server.startup_s, 2),
            "api_key": server.key is not None,
        }
        for concurrency in concurrencies:
            log(f"  load on {label}: concurrency {concurrency}")
            result = asyncio.run(measure_load(server, label, concurrency, s))
            log(f"    {result.req_per_s:.1f} req/s, p50 {result.p50_ms:.0f} ms")
            results.append(result)
    return results, info


# --- phase 4: every default model under a budget -------------------------------------


def ocr_page_png() -> str:
    from PIL import Image

    from tessera.tasks.samples import sample_page

    buffer = io.BytesIO()
    Image.fromarray(sample_page()[:, :, ::-1].copy()).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def cycle_plan() -> list[tuple[str, str, dict[str, Any]]]:
    """(model, path, body): a realistic small request for each default model."""
    sentence = sentences(1, seed=11)[0]
    docs = [
        "The fox is a small wild animal that jumps over fences at night.",
        "Interest rates rose again this quarter, the central bank said.",
        "A recipe for bread needs flour, water, yeast and salt.",
    ]
    return [
        (EMBED_MODEL, "/v1/embeddings", {"input": sentence}),
        ("all-minilm-l6-v2-int8", "/v1/embeddings", {"input": sentence}),
        ("minilm-rerank", "/v1/rerank", {"query": "What does the fox do?", "documents": docs}),
        ("intent-minilm", "/v1/classify", {"input": "I need to reset my online banking password"}),
        ("pp-ocrv6", "/v1/ocr", {"image": ocr_page_png(), "mode": "page"}),
        ("piper-joe", "/v1/audio/speech", {"input": "Your order has shipped and arrives soon."}),
        ("bergamot-en-pt", "/v1/translate", {"input": "The weather is nice today."}),
        ("bergamot-pt-en", "/v1/translate", {"input": "O tempo está bom hoje."}),
        (
            "smollm2-135m",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8},
        ),
    ]


def summarise(path: str, response: httpx.Response) -> str:
    """A few words from a response, to show the answer was real."""
    if path == "/v1/audio/speech":
        return f"{len(response.content)} bytes of {response.headers.get('content-type')}"
    body = response.json()
    summaries: dict[str, Callable[[], str]] = {
        "/v1/embeddings": lambda: f"dim {len(body['data'][0]['embedding'])}",
        "/v1/rerank": lambda: f"top doc {body['results'][0]['index']}",
        "/v1/classify": lambda: str(body["data"][0]["label"]),
        "/v1/ocr": lambda: repr(body["text"][:60]),
        "/v1/translate": lambda: repr(body["data"][0]["translation"]),
        "/v1/chat/completions": lambda: repr(body["choices"][0]["message"]["content"]),
    }
    return summaries[path]()


@dataclass
class CycleRequest:
    round: int
    model: str
    status: int
    latency_s: float
    summary: str


@dataclass
class _Poll:
    max_used: int = 0
    max_rss: int = 0
    polls: int = 0
    errors: int = 0


async def poll_residency(client: httpx.AsyncClient, pid: int, poll: _Poll) -> None:
    server = psutil.Process(pid)
    while True:
        try:
            response = await client.get("/admin/residency")
            poll.max_used = max(poll.max_used, int(response.json()["used_bytes"]))
            poll.polls += 1
        except (httpx.HTTPError, ValueError, KeyError):
            poll.errors += 1
        with contextlib.suppress(psutil.Error):
            poll.max_rss = max(poll.max_rss, server.memory_info().rss)
        await asyncio.sleep(0.1)


async def one_request(
    client: httpx.AsyncClient, index: int, step: tuple[str, str, dict[str, Any]]
) -> CycleRequest:
    model, path, body = step
    start = time.perf_counter()
    try:
        response = await client.post(path, json={**body, "model": model})
    except httpx.HTTPError as e:
        return CycleRequest(index, model, 0, time.perf_counter() - start, type(e).__name__)
    latency = time.perf_counter() - start
    if response.status_code != 200:
        return CycleRequest(index, model, response.status_code, latency, response.text[:200])
    return CycleRequest(index, model, 200, latency, summarise(path, response))


async def cycle_models(server: RunningServer, rounds: int) -> dict[str, Any]:
    plan = cycle_plan()
    poll = _Poll()
    pid = server.process.pid
    headers = server.headers
    async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=300) as client:
        for _ in range(5):  # warm-up of the HTTP path only: no model is loaded by it
            (await client.get("/v1/models")).raise_for_status()
        poller = asyncio.create_task(poll_residency(client, pid, poll))
        requests = []
        try:
            for index in range(1, rounds + 1):
                for step in plan:
                    requests.append(await one_request(client, index, step))
                    log(f"    round {index} {step[0]}: {requests[-1].status}")
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        final = (await client.get("/admin/residency")).json()
    return {
        "requests": [asdict(r) for r in requests],
        "failures": sum(1 for r in requests if r.status != 200),
        "polled_max_used_bytes": poll.max_used,
        "polled_max_rss_bytes": poll.max_rss,
        "polls": poll.polls,
        "poll_errors": poll.errors,
        "residency": final,
    }


def run_cycle_phase(work: Path, settings: Settings) -> dict[str, Any]:
    with running_tessera(work, "budget", ["--memory-budget", BUDGET]) as server:
        log(f"  cycling {settings.cycle_rounds} rounds under {BUDGET}")
        result = asyncio.run(cycle_models(server, settings.cycle_rounds))
        result["command"] = shlex.join(server.command)
        result["startup_s"] = round(server.startup_s, 2)
        result["api_key"] = server.key is not None
    return result


# --- report --------------------------------------------------------------------------


@dataclass
class Row:
    figure: str
    value: str
    bar: str
    verdict: str  # PASS, MISS, info, or ERROR


def check(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def load_rows(results: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    raw = results.get("raw")
    loads = {(r["label"], r["concurrency"]): r for r in results.get("load", [])}
    if raw:
        raw_rate = raw["main"]["sentences_per_s"]
        rows.append(
            Row(f"raw sentences/s ({raw['threads']} threads)", f"{raw_rate:.1f}", "", "info")
        )
        if "one_thread" in raw:
            one = raw["one_thread"]["sentences_per_s"]
            rows.append(Row("raw sentences/s (1 thread, info)", f"{one:.1f}", "", "info"))
    for (label, concurrency), r in loads.items():
        name = f"{label} c{concurrency}"
        rows.append(Row(f"{name} req/s", f"{r['req_per_s']:.1f}", "", "info"))
        rows.append(
            Row(f"{name} p50 / p99 ms", f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f}", "", "info")
        )
        rows.append(Row(f"{name} failures", str(r["failures"]), "= 0", check(r["failures"] == 0)))
        if label == "server" and raw:
            ratio = r["req_per_s"] / raw["main"]["sentences_per_s"]
            rows.append(
                Row(
                    f"{name} / raw",
                    f"{ratio:.2f}",
                    f">= {BAR_SERVER_RAW}",
                    check(ratio >= BAR_SERVER_RAW),
                )
            )
    batched, single = loads.get(("server", 32)), loads.get(("batch1", 32))
    if batched and single and single["req_per_s"] > 0:
        ratio = batched["req_per_s"] / single["req_per_s"]
        rows.append(
            Row(
                "batched / batch-1 (c32)",
                f"{ratio:.2f}x",
                f">= {BAR_BATCHING}x",
                check(ratio >= BAR_BATCHING),
            )
        )
    return rows


def cycle_rows(cycle: dict[str, Any]) -> list[Row]:
    residency = cycle["residency"]
    budget = residency["budget_bytes"]
    polled, peak = cycle["polled_max_used_bytes"], residency["peak_used_bytes"]
    mib = 1024**2
    return [
        Row("budget (MiB)", f"{budget / mib:.0f}", "", "info"),
        Row(
            "polled max used / budget",
            f"{polled / budget:.3f} ({polled / mib:.0f} MiB)",
            "<= 1.0",
            check(polled <= budget),
        ),
        Row(
            "server peak_used / budget",
            f"{peak / budget:.3f} ({peak / mib:.0f} MiB)",
            "<= 1.0",
            check(peak <= budget),
        ),
        Row("server RSS max (info)", f"{cycle['polled_max_rss_bytes'] / mib:.0f} MiB", "", "info"),
        Row("loads_total", str(residency["loads_total"]), "", "info"),
        Row(
            "evictions_total",
            str(residency["evictions_total"]),
            ">= 1",
            check(residency["evictions_total"] >= 1),
        ),
        Row("cycle failed requests", str(cycle["failures"]), "= 0", check(cycle["failures"] == 0)),
    ]


def all_rows(results: dict[str, Any]) -> list[Row]:
    rows = load_rows(results)
    if results.get("cycle"):
        rows += cycle_rows(results["cycle"])
    rows += [Row(f"{phase} phase", "failed to run", "", "ERROR") for phase in results["errors"]]
    return rows


def cores(value: float) -> str:
    return f"{value:.2f}"


def raw_section(raw: dict[str, Any]) -> list[str]:
    header = ["threads", "batches", "s", "sentences/s", "ms/batch", "own CPU"]
    runs = [(raw["threads"], raw["main"])]
    if "one_thread" in raw:
        runs.append((1, raw["one_thread"]))
    lines = [
        [
            str(threads),
            str(r["batches"]),
            f"{r['seconds']:.1f}",
            f"{r['sentences_per_s']:.1f}",
            f"{r['ms_per_batch']:.1f}",
            cores(r["cpu_cores"]),
        ]
        for threads, r in runs
    ]
    title = f"## Raw model (batches of {BATCH_SIZE}, load {raw['load_s']} s; CPU in cores)"
    return [title, table(header, lines)]


def load_section(loads: list[dict[str, Any]]) -> list[str]:
    header = ["server", "conc.", "ok", "fail", "s", "req/s", "p50 ms", "p99 ms"]
    header += ["server CPU", "client CPU", "other CPU", "errors"]
    lines = [
        [
            r["label"],
            str(r["concurrency"]),
            str(r["ok"]),
            str(r["failures"]),
            f"{r['seconds']:.1f}",
            f"{r['req_per_s']:.1f}",
            f"{r['p50_ms']:.0f}",
            f"{r['p99_ms']:.0f}",
            cores(r["server_cpu_cores"]),
            cores(r["client_cpu_cores"]),
            cores(r["other_cpu_cores"]),
            ", ".join(f"{k}: {v}" for k, v in r["errors"].items()),
        ]
        for r in loads
    ]
    return ["## Load runs (CPU in cores)", table(header, lines)]


def cycle_sections(cycle: dict[str, Any]) -> list[str]:
    lines = [
        [
            str(r["round"]),
            r["model"],
            str(r["status"]),
            f"{1000 * r['latency_s']:.0f}",
            r["summary"].replace("|", "/").replace("\n", " / "),
        ]
        for r in cycle["requests"]
    ]
    models = [
        [m["name"], m["state"], f"{m['bytes'] / 1024**2:.1f}", str(m["loads"]), str(m["evictions"])]
        for m in cycle["residency"]["models"]
    ]
    polls = f"{cycle['polls']} polls of /admin/residency, {cycle['poll_errors']} failed"
    return [
        f"## Cycling requests ({polls})",
        table(["round", "model", "status", "ms", "answer"], lines),
        "## Residency at the end",
        table(["model", "state", "MiB", "loads", "evictions"], models),
    ]


def noise_note(results: dict[str, Any]) -> str:
    """A warning when other processes used the cores during a load run (the raw runs
    do not measure them)."""
    others = [r["other_cpu_cores"] for r in results.get("load", [])]
    worst = max(others, default=0.0)
    if worst > 0.2:
        return f"**Warning:** other processes used up to {worst:.2f} cores during a load run."
    return f"Other processes used at most {worst:.2f} cores during the load runs."


def detail_sections(results: dict[str, Any]) -> list[str]:
    sections = []
    if results.get("raw"):
        sections += raw_section(results["raw"])
    if results.get("load"):
        sections += load_section(results["load"])
    if results.get("cycle"):
        sections += cycle_sections(results["cycle"])
    return sections


def render_markdown(results: dict[str, Any]) -> str:
    rows = all_rows(results)
    machine = results["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
    quick = " (quick)" if results["settings"]["quick"] else ""
    parts = [
        f"# Engine benchmark, {results['date']}{quick}",
        f"Machine: {machine['cpu_count']} CPUs ({machine['cpu_model']}),"
        f" {machine['memory_bytes'] / 1024**3:.1f} GiB, {machine['platform']},"
        f" Python {machine['python']}; {versions}.",
        "The load generator runs on the same cores as the server. " + noise_note(results),
        table(
            ["figure", "value", "bar", "result"],
            [[r.figure, r.value, r.bar, r.verdict] for r in rows],
        ),
        *detail_sections(results),
        "## Commands",
        "\n".join(f"- `{c}`" for c in results["commands"]),
    ]
    if results["errors"]:
        parts += [
            "## Errors",
            "\n".join(f"- {k}: `{v[:500]}`" for k, v in results["errors"].items()),
        ]
    return "\n\n".join(parts) + "\n"


def print_table(rows: list[Row]) -> None:
    width = max(len(r.figure) for r in rows)
    value_width = max(len(r.value) for r in rows)
    for r in rows:
        print(f"{r.figure:<{width}}  {r.value:>{value_width}}  {r.bar:<8}  {r.verdict}")


def wait_for_quiet(max_wait_s: float, threshold: float = 0.15) -> dict[str, Any]:
    """Wait, at most ``max_wait_s``, until the machine has been idle (under
    ``threshold`` of all cores busy) for 3 s in a row: another process's load
    would distort every figure."""
    start, quiet, busy = time.perf_counter(), 0, 0.0
    while quiet < 3 and time.perf_counter() - start < max_wait_s:
        busy = psutil.cpu_percent(interval=1.0) / 100
        quiet = quiet + 1 if busy < threshold else 0
        if quiet == 0 and int(time.perf_counter() - start) % 15 == 0:
            log(f"waiting for a quiet machine: {100 * busy:.0f}% busy")
    waited = round(time.perf_counter() - start, 1)
    if quiet < 3:
        log(f"the machine is still busy ({100 * busy:.0f}%) after {waited} s: measuring anyway")
    return {"waited_s": waited, "quiet": quiet >= 3, "busy_fraction": round(busy, 3)}


def run_phase(results: dict[str, Any], name: str, fn: Callable[[], None]) -> None:
    start = time.perf_counter()
    try:
        fn()
    except Exception as e:  # one broken phase must not lose the others' figures
        log(f"{name} phase failed: {type(e).__name__}: {e}")
        results["errors"][name] = f"{type(e).__name__}: {e}"
    results["phase_seconds"][name] = round(time.perf_counter() - start, 1)


def run_all(settings: Settings, work: Path) -> dict[str, Any]:
    now = datetime.now(UTC).astimezone()
    results: dict[str, Any] = {
        "date": now.date().isoformat(),
        "started": now.isoformat(timespec="seconds"),
        "settings": asdict(settings),
        "machine": machine_info(),
        "commands": [shlex.join([sys.executable, *sys.argv])],
        "errors": {},
        "phase_seconds": {},
        "load": [],
        "servers": {},
    }
    preload = ["--preload", EMBED_MODEL]

    def raw() -> None:
        results["raw"] = run_raw(
            EMBED_MODEL, settings.threads, settings.raw_seconds, settings.raw_max_batches
        )
        results["commands"].append(results["raw"]["command"])

    def server(label: str, args: list[str], concurrencies: tuple[int, ...]) -> Callable[[], None]:
        def phase() -> None:
            loads, info = run_load_phase(work, label, args, concurrencies, settings)
            results["load"] += [asdict(r) for r in loads]
            results["servers"][label] = info
            results["commands"].append(info["command"])

        return phase

    def cycle() -> None:
        results["cycle"] = run_cycle_phase(work, settings)
        results["commands"].append(results["cycle"]["command"])

    run_phase(results, "raw", raw)
    run_phase(results, "server", server("server", preload, settings.concurrencies))
    batch1 = ["--model-repository", str(batch1_repository(work)), *preload]
    run_phase(results, "batch1", server("batch1", batch1, (32,)))
    run_phase(results, "cycle", cycle)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a shorter run (about 2 minutes)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=120.0,
        metavar="S",
        help="wait at most S seconds for other processes to leave the CPUs idle (0: don't)",
    )
    args = parser.parse_args()
    settings = Settings.make(args.quick)
    quiet = wait_for_quiet(args.wait_quiet) if args.wait_quiet > 0 else None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tessera-bench-") as tmp:
        results = run_all(settings, Path(tmp))
    results["total_seconds"] = round(time.perf_counter() - start, 1)
    results["quiet_before_start"] = quiet
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = output_stem(args.out_dir, results["date"], "engine")
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    stem.with_suffix(".md").write_text(render_markdown(results), encoding="utf-8")
    print_table(all_rows(results))
    print(f"\n{results['total_seconds']:.0f} s; wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
