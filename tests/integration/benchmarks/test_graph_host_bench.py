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

pytestmark = [pytest.mark.slow, pytest.mark.bench]

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "graph_host_bench.py"


@pytest.mark.parametrize("models", [1, 2])
def test_the_child_counts_a_batchs_operators(models: int) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, str(BENCH), "--child", "2", "--seconds", "0.2", "--models", str(models)],
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
    # One block of inputs copied in, a cut and a clone of the pooled rows,
    # and with two models in turn one copy of the other's weights (10 and 11;
    # padding, masking and pooling around the replay would be many more).
    assert 0 < figures["ops_per_batch"] <= 12
