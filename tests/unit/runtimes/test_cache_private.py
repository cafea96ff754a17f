"""Folders the server makes for its cache are its owner's alone (0700)
whatever the umask: under umask 000 ``mkdir -p`` made them 0777."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.runtimes.cache import private_dirs
from tessera.runtimes.onnx_quant import _write_atomic


@pytest.fixture
def open_umask() -> Iterator[None]:
    before = os.umask(0)
    try:
        yield
    finally:
        os.umask(before)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.usefixtures("open_umask")
def test_missing_folders_are_made_0700_under_umask_000(tmp_path: Path) -> None:
    private_dirs(tmp_path / "cache" / "kind" / "entry")
    for folder in ("cache", "cache/kind", "cache/kind/entry"):
        assert mode(tmp_path / folder) == 0o700, folder
    private_dirs(tmp_path / "cache" / "kind")  # there already: nothing changes
    assert mode(tmp_path / "cache" / "kind") == 0o700


@pytest.mark.usefixtures("open_umask")
def test_a_converted_graph_lands_in_private_folders(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere" / "cache" / "onnx-int8" / "graph.onnx"
    _write_atomic(target, b"graph")
    assert target.read_bytes() == b"graph"
    for folder in (target.parent, target.parent.parent, target.parent.parent.parent):
        assert mode(folder) == 0o700, folder
    assert mode(target) & 0o077 == 0
