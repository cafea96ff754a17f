"""``tessera bench``: drive a running tessera with a bounded load and report it.

Closed loop (``--concurrency`` callers, each sending its next request when the
last is answered) or open loop (``--rate`` requests a second, Poisson arrivals),
bounded by ``--requests`` and ``--duration``, loopback or any URL you run.
Each request is a real one for the model's task (a sentence, a query and
documents, a rendered page, a line of speech, a short chat). Progress is a rich
bar in a terminal and plain lines otherwise; the result is a table, and JSON
with ``--out``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from tessera.tasks.samples import SENTENCE, sample_page

PLAIN_PROGRESS_EVERY_S = 2.0


@dataclass(frozen=True)
class BenchPlan:
    url: str
    model: str
    key: str | None = None
    concurrency: int = 8
    rate: float | None = None  # open loop when set
    requests: int = 200
    duration_s: float = 30.0
    seed: int = 0


@dataclass
class BenchResult:
    model: str
    task: str
    mode: str
    requests: int
    ok: int
    failed: int
    seconds: float
    req_per_s: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    statuses: dict[str, int] = field(default_factory=dict)


def _png_base64() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(sample_page()[:, :, ::-1]).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def request_for(task: str, model: str, n: int) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of the ``n``-th request for a model of ``task``."""
    sentence = f"{SENTENCE} ({n})"
    match task:
        case "embedding":
            return "/v1/embeddings", {"model": model, "input": sentence}
        case "classify":
            return "/v1/classify", {"model": model, "input": sentence}
        case "rerank":
            documents = [sentence, "Paris is the capital of France.", "Bread needs flour."]
            return "/v1/rerank", {
                "model": model,
                "query": "Where does the fox jump?",
                "documents": documents,
            }
        case "translate":
            return "/v1/translate", {"model": model, "input": f"The weather is nice today ({n})."}
        case "tts":
            return "/v1/audio/speech", {"model": model, "input": "Hello from tessera."}
        case "ocr":
            return "/v1/ocr", {"model": model, "image": _png_base64()}
        case "generate":
            messages = [{"role": "user", "content": f"Say a word about number {n}."}]
            return "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 8}
    raise ValueError(f"tessera bench does not know task {task!r}")


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 1)


class BenchProgress:
    """A rich bar on a terminal, a plain line every few seconds otherwise."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self._total, self._stream, self._done = total, stream, 0
        self._last_line = time.perf_counter()
        self._bar: Any = None
        if stream.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self._bar = Progress("bench", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self._task = self._bar.add_task("", total=total)
            self._bar.start()

    def advance(self) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(self._task, completed=self._done)
        elif time.perf_counter() - self._last_line >= PLAIN_PROGRESS_EVERY_S:
            self._last_line = time.perf_counter()
            print(f"bench: {self._done}/{self._total} requests", file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
        print(f"bench: {self._done}/{self._total} requests done", file=self._stream, flush=True)


async def _task_of(client: httpx.AsyncClient, model: str) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    for entry in response.json()["data"]:
        if entry["id"] == model:
            return str(entry["task"])
    raise ValueError(f"model {model!r} is not served there (or not to this key)")


async def run_bench(plan: BenchPlan, stream: TextIO = sys.stderr) -> BenchResult:
    headers = {"Authorization": f"Bearer {plan.key}"} if plan.key else {}
    limits = httpx.Limits(max_connections=max(plan.concurrency, 1) * 2)
    async with httpx.AsyncClient(
        base_url=plan.url, headers=headers, timeout=120, limits=limits
    ) as client:
        task = await _task_of(client, plan.model)
        latencies: list[float] = []
        statuses: Counter[str] = Counter()
        issued = 0
        progress = BenchProgress(plan.requests, stream)
        deadline = time.perf_counter() + plan.duration_s

        async def one(n: int) -> None:
            path, body = request_for(task, plan.model, n)
            start = time.perf_counter()
            try:
                response = await client.post(path, json=body)
                statuses[str(response.status_code)] += 1
                if response.status_code == 200:
                    latencies.append(time.perf_counter() - start)
            except httpx.HTTPError as e:
                statuses[type(e).__name__] += 1
            progress.advance()

        async def caller() -> None:
            nonlocal issued
            while issued < plan.requests and time.perf_counter() < deadline:
                issued += 1
                await one(issued)

        start = time.perf_counter()
        if plan.rate is None:
            await asyncio.gather(*(caller() for _ in range(plan.concurrency)))
        else:
            rng = random.Random(plan.seed)
            running: list[asyncio.Task[None]] = []
            while issued < plan.requests and time.perf_counter() < deadline:
                issued += 1
                running.append(asyncio.ensure_future(one(issued)))
                await asyncio.sleep(rng.expovariate(plan.rate))
            await asyncio.gather(*running)
        seconds = time.perf_counter() - start
        progress.close()
    ok = len(latencies)
    return BenchResult(
        model=plan.model,
        task=task,
        mode="closed" if plan.rate is None else "open",
        requests=issued,
        ok=ok,
        failed=issued - ok,
        seconds=round(seconds, 3),
        req_per_s=round(ok / seconds, 2) if seconds > 0 else 0.0,
        p50_ms=_percentile(latencies, 0.50),
        p95_ms=_percentile(latencies, 0.95),
        p99_ms=_percentile(latencies, 0.99),
        mean_ms=round(1000 * sum(latencies) / ok, 1) if ok else None,
        statuses=dict(statuses),
    )


def report(result: BenchResult, out: Path | None) -> None:
    """Print the result as a table; write it as JSON to ``out`` if given."""
    from rich.console import Console
    from rich.table import Table

    table = Table("figure", "value")
    for name, value in asdict(result).items():
        table.add_row(name, json.dumps(value) if isinstance(value, dict) else str(value))
    Console().print(table)
    if out is not None:
        out.write_text(json.dumps(asdict(result), indent=2) + "\n", encoding="utf-8")
