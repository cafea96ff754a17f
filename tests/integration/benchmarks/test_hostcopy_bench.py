"""The host tier's swap benchmark runs end to end in its child form (its
stand-ins for the device patch tessera's internals, which a change could leave
behind): both paths measured, in CPU ms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench]

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "hostcopy_bench.py"


def test_the_child_measures_both_paths() -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, str(BENCH), "--child", "--cycles", "10"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    keys = {"offload_cpu_ms", "restore_cpu_ms", "cpu_path_offload_ms", "cpu_path_restore_ms"}
    assert set(figures) == keys
    assert all(isinstance(v, float) and v >= 0 for v in figures.values())
    assert figures["cpu_path_offload_ms"] > 0  # the MiniLM's file spans found each time
