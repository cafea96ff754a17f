"""The engine ceiling bench runs its device model (fake options host_calls and
device_s) and counts its stacked rounds, in process and through the socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench]

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "engine_ceiling_bench.py"


def run_bench(out: Path, *args: str) -> None:
    """The bench with ``args``, half a second a form, one round, reports in ``out``."""
    command = [sys.executable, str(BENCH), *args]
    command += ["--seconds", "0.5", "--rounds", "1", "--out", str(out)]
    done = subprocess.run(
        command,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parents[1],
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_device_model_with_stacked_rounds(tmp_path: Path) -> None:
    run_bench(
        tmp_path,
        *("--models", "8", "--concurrency", "8", "--device", "2,0.1,3,0.2"),
        *("--stack", "4", "--lane-threads", "8"),
    )
    (report,) = tmp_path.glob("engine-ceiling-models-device-stacked-*.json")
    figures = json.loads(report.read_text())
    assert figures["device"] == [2, 0.1, 3, 0.2]
    forms = {r["form"]: r for r in figures["runs"]}
    assert set(forms) == {
        "engine",
        "core",
        "engine, stacked 4, 8 threads",
        "core, stacked 4, 8 threads",
    }
    assert all(r["req_per_s"] > 0 for r in forms.values())
    assert forms["engine"]["round_batches"] is None  # no stacking: no rounds
    assert forms["engine, stacked 4, 8 threads"]["round_batches"] >= 2  # 8 callers met


def test_the_core_form_on_each_engine_loop(tmp_path: Path) -> None:
    run_bench(
        tmp_path,
        *("--models", "4", "--concurrency", "4", "--device", "1,0.1", "--forms", "core"),
        *("--engine-loops", "patient", "uvloop"),
    )
    (report,) = tmp_path.glob("engine-ceiling-models-device-*.json")
    figures = json.loads(report.read_text())
    assert figures["engine_loops"] == ["patient", "uvloop"]
    forms = {r["form"]: r for r in figures["runs"]}
    assert set(forms) == {"core (loop: patient)", "core (loop: uvloop)"}
    assert all(r["req_per_s"] > 0 and r["loop_us"] > 0 for r in forms.values())
    markdown = report.with_suffix(".md").read_text()
    assert "--engine-loops patient uvloop" in markdown
