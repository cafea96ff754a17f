"""``tessera bench --scenario FILE``: run a scenario and write its report."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.plots import draw_all
from harness.report import bars, output_stem, render
from harness.runner import run_scenario
from harness.scenario import load_scenario
from harness.servers import log

QUICK_FACTOR = 0.25


def bench_scenario(
    path: Path,
    out_dir: Path,
    only: set[str] | None = None,
    quick: bool = False,
    work_dir: Path | None = None,
) -> Path:
    """Run the scenario at ``path``; write ``NAME-DATE[-N].{json,md}`` and plots; the stem.

    Servers keep their data and logs under ``work_dir`` when given (kept), else
    in a temporary folder (removed).
    """
    scenario = load_scenario(path)
    if quick:
        scenario = scenario.shortened(QUICK_FACTOR)
    if work_dir is not None:
        work = work_dir / f"{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        work.mkdir(parents=True)
        log(f"servers' data and logs: {work}")
        results = run_scenario(scenario, work, only)
    else:
        with tempfile.TemporaryDirectory(prefix=f"tessera-bench-{scenario.name}-") as tmp:
            results = run_scenario(scenario, Path(tmp), only)
    results["quick"] = quick
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = output_stem(out_dir, results["date"], scenario.name)
    plots = draw_all(results, stem)
    stem.with_suffix(".md").write_text(render(results, plots), encoding="utf-8")
    # Compact: a scenario's samples and timelines are hundreds of KiB, and the
    # working tree travels to the GPU machine within 64 MiB (docs/benchmarks.md).
    text = json.dumps(without_model_detail(results), separators=(",", ":"))
    stem.with_suffix(".json").write_text(text + "\n", encoding="utf-8")
    for figure, measured, bar, verdict in bars(results):
        log(f"{verdict:4}  {figure}: {measured} (bar {bar})")
    log(f"wrote {stem}.json, {stem}.md and {len(plots)} plots")
    return stem


# A step's figures per model, kept in the JSON for scenarios of at most this
# many models: with a thousand, they were 7 MiB of a run's 7.3.
MODEL_DETAIL_LIMIT = 20
MODEL_DETAIL = ("per_model", "batches", "batch_size_histogram", "peak_used_bytes")


def without_model_detail(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` as written to JSON: where the scenario serves more than
    ``MODEL_DETAIL_LIMIT`` models, each step without its figures per model
    (the Markdown report, rendered before, has what it draws from them)."""
    if len(results["scenario"].get("models") or ()) <= MODEL_DETAIL_LIMIT:
        return results
    out = dict(results, model_detail_dropped=list(MODEL_DETAIL))
    out["configurations"] = {
        name: dict(
            c,
            steps=[
                {k: v for k, v in s.items() if k not in MODEL_DETAIL} for s in c.get("steps", [])
            ],
        )
        for name, c in results["configurations"].items()
    }
    return out
