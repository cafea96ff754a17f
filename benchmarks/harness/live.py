"""``tessera bench --model``: drive a running tessera with a bounded load and report it.

Closed loop (``--concurrency`` callers, each sending its next request when the
last is answered) or open loop (``--rate`` requests a second, Poisson arrivals),
bounded by ``--requests`` and ``--duration``, loopback or any URL you run.
Each request is a real one for the model's task (a sentence, a query and
documents, a rendered page, a line of speech, a short chat). Progress is a rich
bar in a terminal and plain lines otherwise; the result is a table, and JSON
with ``--out``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from harness.driver import Driver
from harness.figures import latency_figures
from harness.progress import BenchProgress
from harness.request import request_for
from harness.scenario import RequestShape, TenantLoad


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
    # This client's CPU seconds over the run: near ``seconds``, the client,
    # not the server, set the pace.
    client_cpu_s: float = 0.0


async def _task_of(client: httpx.AsyncClient, model: str) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    for entry in response.json()["data"]:
        if entry["id"] == model:
            return str(entry["task"])
    raise ValueError(f"model {model!r} is not served there (or not to this key)")


@dataclass(frozen=True)
class _RunningServer:
    """The driver's Endpoint for one model of a tessera running at ``url``."""

    url: str
    key: str | None
    task: str

    def route(self, model: str) -> str:
        return self.url

    def headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def call(self, model: str, n: int, shape: RequestShape) -> tuple[str, dict[str, Any]]:
        return request_for(self.task, model, n)

    def ok(self, model: str, status: int, body: bytes) -> bool:
        return status == 200


async def run_bench(plan: BenchPlan, stream: TextIO = sys.stderr) -> BenchResult:
    headers = {"Authorization": f"Bearer {plan.key}"} if plan.key else {}
    async with httpx.AsyncClient(base_url=plan.url, headers=headers, timeout=30) as client:
        task = await _task_of(client, plan.model)
    progress = BenchProgress(plan.requests, stream)
    driver = Driver(
        _RunningServer(plan.url, plan.key, task),
        [plan.model],
        None,
        seed=plan.seed,
        on_answer=progress.advance,
    )
    closed = plan.rate is None
    load = TenantLoad("bench", concurrency=plan.concurrency if closed else None, rate=plan.rate)
    cpu_before = time.process_time()
    result = await driver.run([load], plan.requests, plan.duration_s)
    cpu_s = time.process_time() - cpu_before
    progress.close()
    figures = latency_figures(result.records, result.seconds, {})
    return BenchResult(
        model=plan.model,
        task=task,
        mode="closed" if closed else "open",
        requests=figures["requests"],
        ok=figures["ok"],
        failed=figures["failed"],
        seconds=round(result.seconds, 3),
        req_per_s=figures["req_per_s"],
        p50_ms=figures["p50_ms"],
        p95_ms=figures["p95_ms"],
        p99_ms=figures["p99_ms"],
        mean_ms=figures["mean_ms"],
        statuses=figures["statuses"],
        client_cpu_s=round(cpu_s, 3),
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
