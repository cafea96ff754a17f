"""A model folder's versions: which its ``version_policy`` serves (Triton's
latest N, all, specific), and a version folder's ``model.yaml`` over the model's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from builders import write_fake_repository
from tessera.errors import ConfigError
from tessera.repository import read_versions


def model_with_versions(tmp_path: Path, policy: Any, versions: tuple[int, ...] = (1, 2, 3)) -> Path:
    extra = {"task": "embedding", "options": {"scale": 1.0, "own_bytes": 7}}
    if policy is not None:
        extra["version_policy"] = policy
    model = write_fake_repository(tmp_path / "repo", {"m": extra}) / "m"
    for v in versions:
        (model / str(v)).mkdir()
    return model


@pytest.mark.parametrize(
    ("policy", "served"),
    [
        (None, ["m@3"]),  # latest 1 by default
        ({"latest": {"num_versions": 2}}, ["m@2", "m@3"]),
        ({"latest": {"num_versions": 9}}, ["m@1", "m@2", "m@3"]),
        ({"all": {}}, ["m@1", "m@2", "m@3"]),
        ({"specific": {"versions": [3, 1]}}, ["m@1", "m@3"]),
        ({"specific": {"versions": [2, 7]}}, ["m@2"]),
    ],
)
def test_the_policy_chooses_the_served_versions(
    tmp_path: Path, policy: Any, served: list[str]
) -> None:
    assert [s.key for s in read_versions(model_with_versions(tmp_path, policy))] == served


@pytest.mark.parametrize(
    "policy",
    [
        {"specific": {"versions": [7]}},  # serves none of the folders
        {"specific": {"versions": []}},
        {"specific": {"versions": ["1"]}},
        {"latest": {"num_versions": 0}},
        {"newest": {}},
        {"latest": {}, "all": {}},
        "latest",
    ],
)
def test_a_bad_policy_is_refused(tmp_path: Path, policy: Any) -> None:
    with pytest.raises(ConfigError, match="version_policy"):
        read_versions(model_with_versions(tmp_path, policy))


def test_a_version_folders_card_overrides_the_models_key_by_key(tmp_path: Path) -> None:
    model = model_with_versions(tmp_path, {"all": {}}, versions=(1, 2))
    (model / "2" / "model.yaml").write_text(yaml.safe_dump({"options": {"scale": 2.0}}))
    one, two = read_versions(model)
    assert (one.version_label, one.options) == ("1", {"scale": 1.0, "own_bytes": 7})
    assert (two.version_label, two.options) == ("2", {"scale": 2.0, "own_bytes": 7})
    (model / "2" / "weights.bin").write_bytes(b"")  # its weights: the version folder's
    assert two.resolve_source() == model / "2"


def test_a_model_without_version_folders_is_version_1(tmp_path: Path) -> None:
    (spec,) = read_versions(model_with_versions(tmp_path, None, versions=()))
    assert (spec.key, spec.version_label) == ("m", "1")
