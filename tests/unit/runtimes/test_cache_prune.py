"""The cache folder's upkeep (``runtimes/cache.py``): entries unused too long
go, then the least recently used over the byte bound, and half-done writes;
nothing outside the loaders' own folders is touched."""

from __future__ import annotations

import os
import time
from pathlib import Path

from builders import fake_engine
from tessera.runtimes.cache import CAUSAL_LM, INT8_REWRITES, ORT_GRAPHS, prune, used

NOW = 10_000_000.0
DAY = 86400.0


def entry(path: Path, size: int, days_ago: float, now: float = NOW) -> Path:
    """A file entry of ``size`` bytes, or (a path without a suffix) a folder
    holding two files of half that each; last used ``days_ago``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix:
        path.write_bytes(b"x" * size)
    else:
        path.mkdir()
        (path / "a.safetensors").write_bytes(b"x" * (size // 2))
        (path / "b.json").write_bytes(b"x" * (size - size // 2))
    stamp = now - days_ago * DAY
    os.utime(path, (stamp, stamp))
    return path


def test_entries_unused_too_long_go_and_the_rest_stay(tmp_path: Path) -> None:
    old_graph = entry(tmp_path / ORT_GRAPHS / "a.onnx", 100, days_ago=40)
    new_graph = entry(tmp_path / ORT_GRAPHS / "b.onnx", 100, days_ago=1)
    old_model = entry(tmp_path / CAUSAL_LM / "k1", 1000, days_ago=31)
    marker = entry(tmp_path / INT8_REWRITES / "c.none", 0, days_ago=2)
    foreign = entry(tmp_path / "someone-else" / "d.bin", 100, days_ago=400)

    pruned = prune(tmp_path, max_age_s=30 * DAY, max_bytes=None, now=NOW)

    assert (pruned.removed, pruned.removed_bytes) == (2, 1100)
    assert (pruned.kept, pruned.kept_bytes) == (2, 100)
    assert not old_graph.exists()
    assert not old_model.exists()
    assert new_graph.exists()
    assert marker.exists()
    assert foreign.exists()  # not a loader's folder


def test_over_the_byte_bound_the_least_recently_used_go(tmp_path: Path) -> None:
    recent = entry(tmp_path / ORT_GRAPHS / "a.onnx", 400, days_ago=0.1)
    middle = entry(tmp_path / CAUSAL_LM / "k1", 500, days_ago=1)
    oldest = entry(tmp_path / INT8_REWRITES / "b.onnx", 300, days_ago=2)
    small = entry(tmp_path / INT8_REWRITES / "c.onnx", 50, days_ago=3)

    pruned = prune(tmp_path, max_age_s=None, max_bytes=1000, now=NOW)

    # 400 + 500 fit; the 300 would not, the 50 still does.
    assert [p.exists() for p in (recent, middle, oldest, small)] == [True, True, False, True]
    assert (pruned.kept_bytes, pruned.removed_bytes) == (950, 300)


def test_a_write_a_crash_left_goes_after_an_hour(tmp_path: Path) -> None:
    left = entry(tmp_path / ORT_GRAPHS / ".tmp-1.onnx", 10, days_ago=2 / 24)
    writing = entry(tmp_path / CAUSAL_LM / ".k2.123-ab.tmp", 10, days_ago=0.5 / 24)

    prune(tmp_path, max_age_s=30 * DAY, max_bytes=None, now=NOW)

    assert not left.exists()
    assert writing.exists()  # perhaps being written now


def test_using_an_entry_keeps_it(tmp_path: Path) -> None:
    graph = entry(tmp_path / ORT_GRAPHS / "a.onnx", 100, days_ago=40)
    used(graph)
    prune(tmp_path, max_age_s=30 * DAY, max_bytes=None)
    assert graph.exists()


def test_no_cache_folder_yet_is_nothing_to_do(tmp_path: Path) -> None:
    pruned = prune(tmp_path / "absent", max_age_s=1.0, max_bytes=0, now=NOW)
    assert (pruned.removed, pruned.kept) == (0, 0)


async def test_the_engine_prunes_its_cache_before_it_loads(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    stale = entry(cache / ORT_GRAPHS / "a.onnx", 100, days_ago=40, now=time.time())
    fresh = entry(cache / CAUSAL_LM / "k1", 100, days_ago=1, now=time.time())
    models = {"embed": {"task": "embedding", "preload": True}}
    async with fake_engine(tmp_path / "repo", models, cache_dir=cache):
        assert not stale.exists()
        assert fresh.exists()
