"""What the servers under test cost while a step runs: CPU, PSS, budget use, loads.

CPU comes from the processes' own accounting (user + system seconds, summed
over a server's process tree); PSS from ``/proc/PID/smaps_rollup`` (shared
pages divided among the processes that map them, so a sum over processes
counts each byte once); budget use, loads and evictions from each tessera
server's ``/admin/residency``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

SAMPLE_EVERY_S = 0.5


def pss_bytes(pid: int) -> int:
    """Proportional set size of one process; 0 when it cannot be read."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(processes: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for process in processes:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            out[process.pid] = times.user + times.system
    return out


@dataclass
class CpuMeter:
    """CPU seconds a set of processes spent between ``start`` and ``stop``."""

    processes: Callable[[], list[psutil.Process]]
    _before: dict[int, float] = field(default_factory=dict)
    _after: dict[int, float] = field(default_factory=dict)

    def start(self) -> None:
        self._before = cpu_seconds(self.processes())

    def stop(self) -> float:
        self._after = cpu_seconds(self.processes())
        return sum(v - self._before.get(pid, 0.0) for pid, v in self._after.items())


@dataclass(frozen=True)
class Residency:
    """Where to ask one tessera server for its residency."""

    url: str
    headers: dict[str, str]


@dataclass
class Sample:
    t_s: float
    pss_bytes: int
    used_bytes: int | None  # sum over tessera servers; None where there are none
    budget_bytes: int | None
    loads_total: int | None
    evictions_total: int | None


@dataclass
class Sampler:
    """Samples PSS and residency every ``every_s`` until stopped."""

    processes: Callable[[], list[psutil.Process]]
    residencies: list[Residency]
    every_s: float = SAMPLE_EVERY_S
    samples: list[Sample] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None
    _start: float = 0.0

    async def _residency(self, client: httpx.AsyncClient) -> tuple[int, int, int, int] | None:
        if not self.residencies:
            return None
        totals = [0, 0, 0, 0]
        for residency in self.residencies:
            response = await client.get(residency.url, headers=residency.headers)
            response.raise_for_status()
            body = response.json()
            keys = ("used_bytes", "budget_bytes", "loads_total", "evictions_total")
            for i, key in enumerate(keys):
                totals[i] += int(body[key])
        return totals[0], totals[1], totals[2], totals[3]

    async def sample(self, client: httpx.AsyncClient) -> Sample:
        pss = sum(pss_bytes(p.pid) for p in self.processes())
        residency = await self._residency(client)
        used, budget, loads, evictions = residency or (None, None, None, None)
        return Sample(time.perf_counter() - self._start, pss, used, budget, loads, evictions)

    async def _loop(self) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    self.samples.append(await self.sample(client))
                await asyncio.sleep(self.every_s)

    def start(self) -> None:
        self._start = time.perf_counter()
        self.samples = []
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        """Stop, taking one last sample so that counters cover the whole step."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        async with httpx.AsyncClient(timeout=30) as client:
            with contextlib.suppress(httpx.HTTPError):
                self.samples.append(await self.sample(client))


def time_average(samples: list[Sample], value: Callable[[Sample], float | None]) -> float | None:
    """The mean of ``value`` over time (each sample held until the next)."""
    points = [(s.t_s, v) for s in samples if (v := value(s)) is not None]
    if len(points) < 2:
        return points[0][1] if points else None
    area = sum(v * (t2 - t1) for (t1, v), (t2, _) in itertools.pairwise(points))
    span = points[-1][0] - points[0][0]
    return area / span if span > 0 else points[0][1]


async def batch_sizes(base_url: str, headers: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per model, the cumulative count of batches at each size bucket, from /metrics."""
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(f"{base_url}/metrics", headers=headers)
    if response.status_code != 200:
        return {}
    out: dict[str, dict[str, float]] = {}
    for line in response.text.splitlines():
        if not line.startswith("tessera_batch_size_bucket{"):
            continue
        labels, value = line[len("tessera_batch_size_bucket{") :].rsplit("} ", 1)
        parts = dict(part.split("=", 1) for part in labels.split(","))
        model, le = parts["model"].strip('"'), parts["le"].strip('"')
        out.setdefault(model, {})[le] = float(value)
    return out


def histogram_delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Batches per size bucket (not cumulative) during a step, per model."""
    out: dict[str, dict[str, float]] = {}
    for model, buckets in after.items():
        previous, cumulative = 0.0, []
        for le, count in buckets.items():
            cumulative.append((le, count - before.get(model, {}).get(le, 0.0)))
        per_bucket = {}
        for le, count in cumulative:
            per_bucket[le] = count - previous
            previous = count
        if previous > 0:
            out[model] = per_bucket
    return out


def scrape_batches(base_url: str, headers: dict[str, str]) -> Any:
    """``/admin/batches`` now (batch counts, sizes and run-time quantiles)."""
    response = httpx.get(f"{base_url}/admin/batches", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()
