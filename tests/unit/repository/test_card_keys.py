"""A ``model.yaml`` key the card does not know is refused, at every level,
naming it and the nearest known key; ``options`` are the adapter's own
(``repository/schema.py``). Every shipped card still loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from builders import write_fake_repository
from tessera.errors import ConfigError, ModelUnavailableError
from tessera.repository import ModelRepository, default_repository_path, read_versions
from tessera.repository.schema import ADAPTER_OPTIONS
from tessera.repository.spec import parse_spec
from tessera.runtimes.registry import ADAPTERS

ENCODER = {"task": "embedding", "runtime": "torch", "adapter": "hf-encoder"}


def card(**fields: Any) -> dict[str, Any]:
    return {**ENCODER, **fields}


@pytest.mark.parametrize(
    ("raw", "where", "key", "nearest"),
    [
        (card(preloads=True), "model.yaml", "preloads", "preload"),
        (card(batching={"max_bach_size": 4}), "batching", "max_bach_size", "max_batch_size"),
        (card(memory={"max_byte": "1GiB"}), "memory", "max_byte", "max_bytes"),
        (card(source={"pth": "w"}), "source", "pth", "path"),
        (card(options={"poolin": "cls"}), "options", "poolin", "pooling"),
        (card(options={"vision": {"patch_sise": 14}}), "vision", "patch_sise", "patch_size"),
        (
            card(version_policy={"latest": {"num_version": 2}}),
            "version_policy: latest",
            "num_version",
            "num_versions",
        ),
        (card(version_policy={"lastest": {}}), "version_policy", "lastest", "latest"),
    ],
)
def test_an_unknown_key_is_named_with_the_nearest_known_one(
    tmp_path: Path, raw: dict[str, Any], where: str, key: str, nearest: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_spec(raw, tmp_path)
    message = str(caught.value)
    assert f"{where}: unknown key {key!r}; did you mean {nearest!r}?" in message


def test_a_key_near_none_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'zzz'; known keys: max_bytes$"):
        parse_spec(card(memory={"zzz": 1}), tmp_path)


def test_options_are_the_adapters_own(tmp_path: Path) -> None:
    assert parse_spec(card(options={"pooling": "cls", "max_length": 128}), tmp_path)
    piper = {"task": "tts", "runtime": "onnx", "adapter": "piper", "options": {"pooling": "cls"}}
    with pytest.raises(ConfigError, match="options: unknown key 'pooling'"):
        parse_spec(piper, tmp_path)  # an encoder's option, not a voice's


def test_an_external_models_options_are_its_engines(tmp_path: Path) -> None:
    external = {"task": "generate", "runtime": "external", "memory": {"max_bytes": "1GiB"}}
    vllm = {**external, "engine": "vllm", "options": {"args": ["--x"], "idle_timeout_s": 5}}
    assert parse_spec(vllm, tmp_path).options["args"] == ["--x"]
    llamacpp = {**external, "engine": "llamacpp", "options": {"args": ["--x"]}}
    with pytest.raises(ConfigError, match="options: unknown key 'args'"):
        parse_spec(llamacpp, tmp_path)


def test_a_version_folders_unknown_key_names_its_file(tmp_path: Path) -> None:
    models = {"m": {"task": "embedding", "adapter": "hf-encoder"}}
    model = write_fake_repository(tmp_path / "repo", models) / "m"
    (model / "1").mkdir()
    (model / "1" / "model.yaml").write_text(yaml.safe_dump({"options": {"poolin": "mean"}}))
    with pytest.raises(ConfigError) as caught:
        read_versions(model)
    assert str(model / "1" / "model.yaml") in str(caught.value)
    assert "unknown key 'poolin'; did you mean 'pooling'?" in str(caught.value)


def test_every_adapter_declares_its_options() -> None:
    assert set(ADAPTER_OPTIONS) == set(ADAPTERS)


def test_an_adapter_from_the_config_reads_its_own_options(tmp_path: Path) -> None:
    spec = parse_spec(card(adapter="mine", options={"anything": 1}), tmp_path)
    assert spec.options == {"anything": 1}


def test_every_shipped_card_loads() -> None:
    assert len(ModelRepository.from_folders([default_repository_path()])) >= 9


def test_an_options_only_version_without_source_says_so(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    (model / "1").mkdir(parents=True)
    (model / "model.yaml").write_text(yaml.safe_dump(ENCODER))
    (model / "1" / "model.yaml").write_text(yaml.safe_dump({"options": {"pooling": "cls"}}))
    (spec,) = read_versions(model)
    with pytest.raises(ModelUnavailableError) as caught:
        spec.resolve_source()
    message = str(caught.value)
    assert f"version folder {model / '1'} holds no weights" in message
    assert "the card gives no source" in message
