"""The working tree leaves room for what the GPU check carries beside it.

The `run` tool takes the working tree and `.gpu/` (`make gpu-build`: about 38
MiB of wheels and stand-in weights) to the GPU machine within 64 MiB, and a GPU
machine is lent rarely: a tree grown past its share (benchmark reports add up)
would be found only then, by `scripts/gpu-build.sh` refusing. This finds it here.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CARRY_LIMIT = 64 * 2**20
GPU_KIT = 40 * 2**20  # .gpu/ as built (37.3 MiB), and some room


def test_the_working_tree_leaves_room_for_the_gpu_kit() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    paths = [ROOT / name.decode() for name in listed if name]
    tree = sum(p.stat().st_size for p in paths if p.is_file())
    assert tree + GPU_KIT <= CARRY_LIMIT, (
        f"the working tree is {tree / 2**20:.1f} MiB: with .gpu/ it would not travel"
        " to the GPU machine (docs/benchmarks.md, GPU check); shrink benchmarks/results"
    )
