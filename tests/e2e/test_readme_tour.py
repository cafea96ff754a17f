"""The README's short tour works as written, against a live server.

Its shell and Python blocks run in order from the repository root, with the
server's address in place of 127.0.0.1:8000, this interpreter in place of
.venv's, and the server's data folder given to ``tessera keys``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from serverproc import Server, start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]


def tour_blocks() -> list[tuple[str, str]]:
    """The (language, code) of each fenced block of the README's tour."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    tour = readme.split("## A short tour", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(sh|python)\n(.*?)```", tour, re.S)


@pytest.fixture(scope="module")
def tour_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    tmp = tmp_path_factory.mktemp("tour")
    process, server = start_server(tmp, "--memory-budget", "3GiB", "--preload", "all-minilm-l6-v2")
    try:
        yield server, tmp / "data"
    finally:
        stop_server(process)


def _localised(code: str, server: Server, data_dir: Path) -> str:
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    code = code.replace(".venv/bin/tessera", f"{sys.executable} -m tessera")
    return code.replace("--admin", f"--admin --data-dir {data_dir}")


def test_the_readme_tour_runs_as_written(tour_server: tuple[Server, Path]) -> None:
    server, data_dir = tour_server
    blocks = tour_blocks()
    assert [lang for lang, _ in blocks] == ["sh", "sh", "python", "sh"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for lang, code in blocks:
        code = _localised(code, server, data_dir)
        if lang == "sh":
            command = ["bash", "-euo", "pipefail", "-c", code + '\nprintf "\\nKEY=%s" "$KEY"']
        else:
            command = [sys.executable, "-c", code]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{code}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        if lang == "sh":
            key = done.stdout.rsplit("KEY=", 1)[1].strip()
            assert key.startswith("tsk_"), done.stdout[-500:]
            env["KEY"] = key
