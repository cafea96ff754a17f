"""Queues bounded by time against queues bounded by count, at c=256 on one model.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/queue_bound_bench.py \
        [--concurrency 256] [--requests 3000] [--out benchmarks/results]

One `tessera serve` with only ``all-minilm-l6-v2`` (one sentence a request,
no keys), driven by ``tessera bench`` in a closed loop of ``--concurrency``
callers, twice, one server after the other: first with ``max_queue: 100`` (the
old default: the queue bound by count, which the time bound never reaches
first at that size), then with the default (time: a request is refused only
when the batches ahead of it would start it after its deadline, 60 s here;
``max_queue`` 1000 only bounds memory). Reports requests answered, 503s,
throughput and p50/p99 of each. Writes ``OUT/queue-bound-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from harness.report import write_report
from harness.servers import running_tessera, tessera_command

MODEL = "all-minilm-l6-v2"
CONFIGS = {"count (max_queue 100)": {"max_queue": 100}, "time (default)": {}}


def markdown(figures: dict[str, Any], date: str, concurrency: int) -> str:
    lines = [
        f"# Queue bound at c={concurrency}, {date}",
        "",
        f"`{MODEL}`, one sentence a request, a closed loop of {concurrency} callers,",
        "one server after the other on this machine. Rerun:",
        "`HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/queue_bound_bench.py`.",
        "",
        "| queue bound | requests | 200 | 503 | req/s | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, f in figures.items():
        statuses = f["statuses"]
        lines.append(
            f"| {label} | {f['requests']} | {statuses.get('200', 0)} | {statuses.get('503', 0)}"
            f" | {f['req_per_s']:.0f} | {f['p50_ms']:.0f} | {f['p99_ms']:.0f} |"
        )
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tessera-queue-") as tmp:
        work = Path(tmp)
        for label, extra in CONFIGS.items():
            config = work / f"{len(figures)}.yaml"
            config.write_text(json.dumps({"preload": [MODEL], **extra}))
            slug = f"server-{len(figures)}"
            with running_tessera(work, slug, ["--config", str(config), "--no-auth"]) as server:
                out = work / f"{slug}.json"
                subprocess.run(
                    [*tessera_command(), "bench", "--model", MODEL, "--url", server.base_url,
                     "--concurrency", str(args.concurrency), "--requests", str(args.requests),
                     "--duration", "120", "--out", str(out)],
                    check=True,
                )  # fmt: skip
                figures[label] = json.loads(out.read_text())
    date = datetime.date.today().isoformat()
    write_report(args.out, date, "queue-bound", figures, markdown(figures, date, args.concurrency))


if __name__ == "__main__":
    main()
