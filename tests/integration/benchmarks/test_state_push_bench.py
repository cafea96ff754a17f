"""The benchmark of the engine process's state pushes runs in its child
form: a gateway that took the pushes holds each model's whole window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench]

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "state_push_bench.py"


def test_the_child_measures_pushes_a_gateway_keeps_up_with() -> None:
    command = [sys.executable, str(BENCH), "--child", "--models", "5", "--batches", "30"]
    done = subprocess.run(
        [*command, "--pushes", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"HF_HUB_OFFLINE": "1", "PATH": ""},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    assert figures["window"] == 1024
    assert figures["window_matches"] is True
    # Six batches a model between pushes, not each one's whole window (about
    # 13 bytes a batch pickled: 69 KB for these five).
    assert 0 < figures["bytes"] < 20_000
    assert figures["engine_ms"] > 0
    assert figures["gateway_ms"] > 0
