"""The repository watcher: which model folders to hand to ``add_model``, and when."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from builders import write_fake_repository
from tessera.repository.watch import RepositoryWatcher, signature


def _touch(path: Path, mtime_ns: int) -> None:
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_what_the_server_read_at_start_is_served(tmp_path: Path) -> None:
    repo = write_fake_repository(tmp_path / "repo", {"a": {}, "b": {}})
    (repo / "a" / "1").mkdir()
    watcher = RepositoryWatcher([repo, tmp_path / "missing"])
    assert watcher.poll() == []
    assert watcher.poll() == []


def test_a_new_version_folder_is_handed_on_once_two_polls_saw_it_the_same(
    tmp_path: Path,
) -> None:
    repo = write_fake_repository(tmp_path / "repo", {"a": {}, "b": {}})
    watcher = RepositoryWatcher([repo])
    (repo / "a" / "2").mkdir()
    assert watcher.poll() == []  # seen once: it may still be being copied in
    assert watcher.poll() == [repo / "a"]
    assert watcher.poll() == []  # served now


def test_a_folder_still_changing_waits_until_it_settles(tmp_path: Path) -> None:
    repo = write_fake_repository(tmp_path / "repo", {"a": {}})
    watcher = RepositoryWatcher([repo])
    version = repo / "a" / "2"
    version.mkdir()
    assert watcher.poll() == []
    (version / "model.yaml").write_text(yaml.safe_dump({"options": {"scale": 2.0}}))
    _touch(version / "model.yaml", 10**18)
    assert watcher.poll() == []  # changed since the last poll
    assert watcher.poll() == [repo / "a"]


def test_a_new_model_a_changed_card_and_a_removed_version_are_handed_on(tmp_path: Path) -> None:
    repo = write_fake_repository(tmp_path / "repo", {"a": {}})
    (repo / "a" / "1").mkdir()
    (repo / "a" / "2").mkdir()
    watcher = RepositoryWatcher([repo])
    write_fake_repository(repo, {"new": {}})
    _touch(repo / "a" / "model.yaml", 10**18)
    (repo / "a" / "2").rmdir()
    assert watcher.poll() == []
    assert sorted(watcher.poll()) == [repo / "a", repo / "new"]


def test_a_folder_that_goes_before_it_settles_is_forgotten(tmp_path: Path) -> None:
    repo = write_fake_repository(tmp_path / "repo", {"a": {}})
    watcher = RepositoryWatcher([repo])
    write_fake_repository(repo, {"brief": {}})
    card = repo / "brief" / "model.yaml"
    text, mtime_ns = card.read_text(), card.stat().st_mtime_ns
    assert watcher.poll() == []
    card.unlink()
    assert watcher.poll() == []
    card.write_text(text)
    _touch(card, mtime_ns)  # the very folder seen before it went
    assert watcher.poll() == []  # pending anew, not acted on from the earlier sighting
    assert watcher.poll() == [repo / "brief"]


def test_the_signature_names_the_card_and_each_version_folder(tmp_path: Path) -> None:
    repo = write_fake_repository(tmp_path / "repo", {"a": {}})
    (repo / "a" / "3").mkdir()
    (repo / "a" / "3" / "model.yaml").write_text("{}\n")
    (repo / "a" / "weights").mkdir()  # not a version folder
    assert [name for name, _ in signature(repo / "a")] == ["model.yaml", "3", "3/model.yaml"]
