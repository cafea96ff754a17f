"""Benchmarks side by side with other source trees: the same measurement run
in a child process with a tree's ``src`` first on ``PYTHONPATH``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def child_figures(
    script: str,
    source: Path | None,
    arguments: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 600,
) -> dict[str, Any]:
    """``script --child ARGUMENTS`` run by this python with ``source`` (a
    tree's ``src``; None: this checkout's) and ``script``'s folder on
    ``PYTHONPATH``: the JSON object on the last line of its output."""
    child_env = dict(os.environ if env is None else env)
    paths = [str(source)] if source is not None else []
    paths.append(str(Path(script).resolve().parent))
    if child_env.get("PYTHONPATH"):
        paths.append(child_env["PYTHONPATH"])
    child_env["PYTHONPATH"] = os.pathsep.join(paths)
    command = [sys.executable, script, "--child", *arguments]
    done = subprocess.run(
        command, env=child_env, capture_output=True, text=True, timeout=timeout_s, check=True
    )
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def tree_sources(against: Sequence[Path]) -> list[tuple[str, Path | None]]:
    """This checkout (None: its own ``src``), then each ``--against`` folder,
    by name and resolved path."""
    return [("this checkout", None), *((str(path), path.resolve()) for path in against)]


def rerun_command(script: str, against: Sequence[Path]) -> str:
    """``script``'s path from the repository root, with its ``--against`` folders."""
    command = f"benchmarks/{Path(script).name}"
    if against:
        command += " --against " + " ".join(map(str, against))
    return command
