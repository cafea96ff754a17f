"""The model repository: a folder per model with a ``model.yaml`` descriptor."""

from tessera.repository.repository import ModelRepository, default_repository_path, read_spec
from tessera.repository.spec import BatchingSpec, ModelSpec, SourceSpec, package_dir, parse_spec

__all__ = [
    "BatchingSpec",
    "ModelRepository",
    "ModelSpec",
    "SourceSpec",
    "default_repository_path",
    "package_dir",
    "parse_spec",
    "read_spec",
]
