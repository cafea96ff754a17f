"""``tessera bench --scenario FILE``: run a scenario and write its report."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

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
    # Compact: a scenario's samples and timelines are hundreds of KiB, and the
    # working tree travels to the GPU machine within 64 MiB (docs/benchmarks.md).
    text = json.dumps(results, separators=(",", ":"))
    stem.with_suffix(".json").write_text(text + "\n", encoding="utf-8")
    plots = draw_all(results, stem)
    stem.with_suffix(".md").write_text(render(results, plots), encoding="utf-8")
    for figure, measured, bar, verdict in bars(results):
        log(f"{verdict:4}  {figure}: {measured} (bar {bar})")
    log(f"wrote {stem}.json, {stem}.md and {len(plots)} plots")
    return stem
