"""``scripts/gpu-check.sh`` in its quick CPU mode: every step, both reports, no leftovers.

The GPU check (docs/benchmarks.md, "GPU check") measures on a GPU machine, which is
lent rarely; its quick CPU mode runs the same steps with this venv's python and no
install (real servers, real MiniLM, about 2 minutes on 2 cores), so that the script
and its report keep working between those runs. Its figures are not asserted: on a
CPU every bar is reported as not applicable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[3]
STEPS = (
    "env",
    "pytest",
    "torch",
    "one_model",
    "many_all",
    "many_variant",
    "many_variant_2",
    "many_budget",
    "one_model_g0",
    "peer",
)

pytestmark = [pytest.mark.slow, pytest.mark.bench]


def processes_naming(path: Path) -> list[int]:
    """PIDs whose command line names ``path`` (a server or client left running)."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        if any(str(path) in part for part in process.info["cmdline"] or ()):
            found.append(process.info["pid"])
    return found


def test_quick_cpu_run_measures_every_step_and_reports_each_bar(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {
        **os.environ,
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_QUICK": "1",
        "GPU_CHECK_PYTHON": sys.executable,
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        # The all-resident load again: one worker, the cards stacking in rounds of two.
        "GPU_CHECK_VARIANT": '{"num_workers": 1}',
        "GPU_CHECK_VARIANT_CARD": '{"stack": 2}',
        # And again through the process split, its engine process on asyncio's own loop.
        "GPU_CHECK_VARIANT_2": '{"engine_loop": "asyncio", "gateways": 1}',
        "OUT": str(out),
    }
    command = ["bash", "scripts/gpu-check.sh"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert processes_naming(tmp_path) == []

    report = json.loads((out / "gpu-check.json").read_text())
    assert {s["step"]: s["rc"] for s in report["steps"]} == dict.fromkeys(STEPS, 0)
    assert report["pytest"]["failures"] == report["pytest"]["errors"] == 0
    assert report["torch"]["sentences_per_s"]["32"] > 0
    assert report["one_model"]["levels"]["1"]["ok"] > 0
    assert report["one_model_g0"]["gateways"] == "0"
    assert report["one_model_g0"]["levels"]["8"]["ok"] > 0  # one process, the top level
    assert report["many_budget"]["swap_ins"]["loads"] > 0  # the budget made it swap
    assert report["many_variant"]["config"] == {"num_workers": 1}
    assert report["many_variant"]["card"] == {"stack": 2}
    assert report["many_variant"]["rr"]["ok"] > 0
    assert report["many_variant"]["rr"]["failed"] == 0
    assert "stacked_rounds" in report["many_variant"]["rr"]["batches"]
    assert "card" not in report["many_all"]
    assert report["many_variant_2"]["config"] == {"engine_loop": "asyncio", "gateways": 1}
    assert report["many_variant_2"]["rr"]["ok"] > 0
    assert report["many_variant_2"]["rr"]["failed"] == 0
    assert len(report["bars"]) == 9
    bars = {b["figure"]: b["status"] for b in report["bars"]}
    # The peer runs where make bench-peers installed LitServe, and is skipped elsewhere (CI).
    peer_bar = bars.pop(next(f for f in bars if "the peer's best" in f))
    if "skipped" in report["peer"]:
        assert peer_bar == "not measured"
    else:
        assert peer_bar == "n/a (not a GPU)"
        assert report["peer"]["levels"]["8"]["ok"] > 0
        assert report["peer"]["levels"]["8"]["failed"] == 0
    assert set(bars.values()) == {"n/a (not a GPU)"}  # each one measured
    markdown = (out / "gpu-check.md").read_text()
    assert "| one model, p50 at c=1 |" in markdown
    assert "| one model (0 gateway processes), c=8 |" in markdown
    assert '| all resident, a variant ({"num_workers": 1}) (cards: {"stack": 2}): rr |' in markdown
    second = '| all resident, a second variant ({"engine_loop": "asyncio", "gateways": 1}): rr |'
    assert second in markdown
    assert "## Plain torch and transformers, no tessera (same run)" in markdown
    assert (out / "servers.log").stat().st_size > 0
