"""The benchmark of the host's work around a graph replay runs in its child
form (its stand-in runner takes the bucket's step as tessera's graphs pass
it), and the tokenised-ahead route stays a handful of operators a batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "graph_host_bench.py"


def test_the_child_counts_a_batchs_operators() -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, str(BENCH), "--child", "2", "--seconds", "0.2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    assert figures["rows"] == 2
    assert figures["calls"] > 0
    assert figures["us_per_batch"] > 0
    # Copies in, a cut and a clone of the pooled rows (13 on 2026-12-04);
    # padding, masking and pooling around the replay were 33.
    assert 0 < figures["ops_per_batch"] <= 16
