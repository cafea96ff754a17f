"""The benchmark of the host tier's copies out runs the real pool in its
child form: once each place's model has been restored, no eviction copies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench]

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "host_pool_bench.py"


def test_the_child_counts_each_loads_copies_out() -> None:
    command = [sys.executable, str(BENCH), "--child", "--models", "10", "--holds", "3"]
    done = subprocess.run([*command, "--swaps", "60"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rr, zipf = json.loads(done.stdout.splitlines()[-1])["loads"]
    assert rr["swaps"] == zipf["swaps"] == 60
    # The round robin's first swaps evict the three loaded from files: copied.
    assert (rr["copied_out"], rr["copied_nothing"], rr["pool_buffers"]) == (3, 57, 3)
    assert (zipf["copied_out"], zipf["new_buffers"]) == (0, 0)
