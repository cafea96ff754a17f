"""The model repository: folders of ``model.yaml`` descriptors.

The default set ships inside tessera (``tessera/models/``); more folders can
be added with ``--model-repository``. A later folder's model of the same name
replaces an earlier one. Each model's served versions are those its
``version_policy`` chooses among its version folders (``read_versions``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from tessera.errors import ConfigError, ModelNotFoundError
from tessera.repository.spec import ModelSpec, parse_spec


def default_repository_path() -> Path:
    """The folder of the default model set shipped with tessera."""
    return Path(str(files("tessera") / "models"))


class ModelRepository:
    """Model specs by name, read once from one or more folders: each model's
    current (latest served) version, and every version its policy serves."""

    def __init__(self, specs: Iterable[ModelSpec]) -> None:
        by_name: dict[str, dict[int | None, ModelSpec]] = {}
        for spec in specs:  # a later spec of the same name and version replaces one
            by_name.setdefault(spec.name, {})[spec.version] = spec
        self._versions = {
            name: sorted(served.values(), key=lambda s: s.version or 0)
            for name, served in by_name.items()
        }
        self._specs = {name: served[-1] for name, served in self._versions.items()}

    @classmethod
    def from_folders(cls, folders: Iterable[Path]) -> ModelRepository:
        specs: dict[str, list[ModelSpec]] = {}
        for folder in folders:
            for model_dir in model_dirs(folder):
                served = read_versions(model_dir)
                specs[served[0].name] = served
        return cls(s for served in specs.values() for s in served)

    def get(self, name: str) -> ModelSpec:
        try:
            return self._specs[name]
        except KeyError as e:
            raise ModelNotFoundError(name) from e

    def versions(self, name: str) -> list[ModelSpec]:
        """The versions of ``name`` its policy serves, oldest first."""
        self.get(name)
        return list(self._versions[name])

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[ModelSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def names(self) -> list[str]:
        return list(self._specs)


def model_dirs(folder: Path) -> list[Path]:
    """The model folders (those with a ``model.yaml``) in a repository folder."""
    if not folder.is_dir():
        raise ConfigError(f"model repository {folder} is not a folder")
    return sorted(p for p in folder.iterdir() if (p / "model.yaml").is_file())


def read_spec(model_dir: Path) -> ModelSpec:
    """The model's current version: the latest its policy serves."""
    return read_versions(model_dir)[-1]


def read_versions(model_dir: Path) -> list[ModelSpec]:
    """Every version of the model in ``model_dir`` that its policy serves,
    oldest first: one spec per version folder, the model's ``model.yaml``
    with the folder's own ``model.yaml`` (if any) over it. ``ConfigError``
    if the descriptor is bad or the policy serves none."""
    if not (model_dir / "model.yaml").is_file():
        raise ConfigError(f"{model_dir} has no model.yaml")
    raw = _load_yaml(model_dir / "model.yaml")
    base = parse_spec(raw, model_dir)
    if not base.versions or "version" in raw:
        return [base]  # no version folders, or the card pins one
    chosen = base.version_policy.choose(base.versions)
    if not chosen:
        raise ConfigError(f"{model_dir}: its version_policy serves none of {list(base.versions)}")
    return [
        parse_spec(_version_raw(raw, model_dir / str(v), v), model_dir, _where(model_dir, v))
        for v in chosen
    ]


def _where(model_dir: Path, version: int) -> str:
    """A version's card, for errors: the model's, with the version folder's over it."""
    own = model_dir / str(version) / "model.yaml"
    card = str(model_dir / "model.yaml")
    return f"{card} (with {own} over it)" if own.is_file() else card


def _version_raw(raw: dict[str, Any], version_dir: Path, version: int) -> dict[str, Any]:
    own_path = version_dir / "model.yaml"
    own = _load_yaml(own_path) if own_path.is_file() else {}
    if not isinstance(own, dict):
        raise ConfigError(f"{own_path}: expected a mapping")
    merged = {**raw, **own, "version": version}
    merged["options"] = {**(raw.get("options") or {}), **(own.get("options") or {})}
    return merged


def _load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from e
