"""The model repository: folders of ``model.yaml`` descriptors.

The default set ships inside tessera (``tessera/models/``); more folders can
be added with ``--model-repository``. A later folder's model of the same name
replaces an earlier one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from importlib.resources import files
from pathlib import Path

import yaml

from tessera.errors import ConfigError, ModelNotFoundError
from tessera.repository.spec import ModelSpec, parse_spec


def default_repository_path() -> Path:
    """The folder of the default model set shipped with tessera."""
    return Path(str(files("tessera") / "models"))


class ModelRepository:
    """Model specs by name, read once from one or more folders."""

    def __init__(self, specs: Iterable[ModelSpec]) -> None:
        self._specs: dict[str, ModelSpec] = {}
        for spec in specs:
            self._specs[spec.name] = spec

    @classmethod
    def from_folders(cls, folders: Iterable[Path]) -> ModelRepository:
        specs: list[ModelSpec] = []
        for folder in folders:
            if not folder.is_dir():
                raise ConfigError(f"model repository {folder} is not a folder")
            for model_dir in sorted(p for p in folder.iterdir() if (p / "model.yaml").is_file()):
                specs.append(read_spec(model_dir))
        return cls(specs)

    def get(self, name: str) -> ModelSpec:
        try:
            return self._specs[name]
        except KeyError as e:
            raise ModelNotFoundError(name) from e

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[ModelSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def names(self) -> list[str]:
        return list(self._specs)


def read_spec(model_dir: Path) -> ModelSpec:
    path = model_dir / "model.yaml"
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from e
    return parse_spec(raw, model_dir)
