"""The cache folder's upkeep (``cache_dir``: what loaders convert once and
keep between loads and restarts).

Each kind of converted weights has a folder of its own under the cache
folder, an entry a file or folder in it whose name hashes its source; a
source that changes (a new file, another library version) gets a new entry
and leaves the old one behind. An entry's modification time is its last
use: loaders mark an entry as they read it (``used``), and at start the
engine removes, in those folders only, the entries unused for longer than
``max_age_s`` and then, while the rest hold more than ``max_bytes``, the
least recently used (``prune``). A write that a crash left half done (a
name starting with ``.``, unused for an hour) goes too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ORT_GRAPHS = "onnx-optimized"  # runtimes/ort_graphs.py
INT8_REWRITES = "onnx-int8"  # runtimes/onnx_quant.py
CAUSAL_LM = "causal-lm"  # runtimes/causal_lm.py
KINDS = (ORT_GRAPHS, INT8_REWRITES, CAUSAL_LM)
# A hidden entry is a write in progress (or a crash's leftover) while this young.
UNFINISHED_S = 3600.0


# Folders the server makes (the cache's, wherever it is): its owner's alone.
PRIVATE_DIR_MODE = 0o700


def private_dirs(path: Path) -> None:
    """Make ``path`` and its missing parents, each ``PRIVATE_DIR_MODE`` whatever
    the umask (``mkdir -p``'s parents take the umask's default: 0777 under
    umask 000, and converted weights are the operator's, not every user's)."""
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=PRIVATE_DIR_MODE)


def used(entry: Path) -> None:
    """Mark ``entry`` as read now (its modification time), so that pruning
    keeps it; a read-only cache stays as it is."""
    with contextlib.suppress(OSError):
        os.utime(entry)


@dataclass(frozen=True, slots=True)
class Pruned:
    removed: int
    removed_bytes: int
    kept: int
    kept_bytes: int


@dataclass(frozen=True, slots=True)
class _Entry:
    path: Path
    last_used: float
    size: int


def prune(
    cache_dir: Path,
    *,
    max_age_s: float | None,
    max_bytes: int | None,
    now: float | None = None,
) -> Pruned:
    """Remove the entries unused for more than ``max_age_s``, then the least
    recently used while the others hold more than ``max_bytes`` (None: no
    bound of that kind); see the module notes."""
    now = time.time() if now is None else now
    entries = sorted(_entries(cache_dir), key=lambda e: e.last_used, reverse=True)
    kept: list[_Entry] = []
    gone: list[_Entry] = []
    total = 0
    for entry in entries:  # the most recently used first
        age = now - entry.last_used
        stale = max_age_s is not None and age > max_age_s
        unfinished = entry.path.name.startswith(".") and age > UNFINISHED_S
        over = max_bytes is not None and total + entry.size > max_bytes
        if stale or unfinished or over:
            gone.append(entry)
        else:
            kept.append(entry)
            total += entry.size
    removed = [entry for entry in gone if _remove(entry.path)]
    pruned = Pruned(len(removed), sum(e.size for e in removed), len(kept), total)
    if removed:
        log.info(
            "cache %s: removed %d entries (%.1f MiB) unused or over its bound; kept %d (%.1f MiB)",
            cache_dir,
            pruned.removed,
            pruned.removed_bytes / 2**20,
            pruned.kept,
            pruned.kept_bytes / 2**20,
        )
    return pruned


def _entries(cache_dir: Path) -> list[_Entry]:
    found = []
    for kind in KINDS:
        try:
            children = list((cache_dir / kind).iterdir())
        except OSError:  # no such folder yet, or not readable
            continue
        for path in children:
            with contextlib.suppress(OSError):  # gone meanwhile
                found.append(_Entry(path, path.lstat().st_mtime, _size(path)))
    return found


def _size(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _remove(path: Path) -> bool:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as e:
        log.warning("cannot remove the cache entry %s: %s", path, e)
        return False
    return True
