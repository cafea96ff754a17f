"""Content digests: the same bytes under two paths give one key; other bytes do not."""

from __future__ import annotations

import shutil
from pathlib import Path

from tessera.runtimes.digest import content_digest


def model_folder(root: Path, weights: bytes) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"hidden_size": 4}')
    (root / "model.safetensors").write_bytes(weights)
    (root / "README.md").write_text(f"notes on {root.name}")  # not a model file
    return root


def test_a_copied_folder_has_the_digest_of_its_original(tmp_path: Path) -> None:
    original = model_folder(tmp_path / "a", b"\x01" * 4096)
    copy = Path(shutil.copytree(original, tmp_path / "b"))
    (copy / "README.md").write_text("another readme")
    assert content_digest(copy) == content_digest(original)


def test_other_weights_or_config_change_the_digest(tmp_path: Path) -> None:
    original = model_folder(tmp_path / "a", b"\x01" * 4096)
    other_weights = model_folder(tmp_path / "b", b"\x01" * 4095 + b"\x02")
    other_config = Path(shutil.copytree(original, tmp_path / "c"))
    (other_config / "config.json").write_text('{"hidden_size": 8}')
    digests = {content_digest(p) for p in (original, other_weights, other_config)}
    assert len(digests) == 3


def test_a_renamed_file_changes_the_digest(tmp_path: Path) -> None:
    original = model_folder(tmp_path / "a", b"\x01" * 64)
    renamed = Path(shutil.copytree(original, tmp_path / "b"))
    (renamed / "model.safetensors").rename(renamed / "other.safetensors")
    assert content_digest(renamed) != content_digest(original)


def test_a_file_changed_in_place_is_hashed_again(tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "a", b"\x01" * 64)
    before = content_digest(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\x03" * 65)  # another size: the cache cannot return the old digest
    assert content_digest(folder) != before
    assert content_digest(weights) == content_digest(Path(shutil.copy(weights, tmp_path / "w")))
