"""The model repository: a folder per model with a ``model.yaml`` descriptor."""

from tessera.repository.repository import (
    ModelRepository,
    default_repository_path,
    model_dirs,
    read_spec,
    read_versions,
)
from tessera.repository.spec import (
    BatchingSpec,
    ModelSpec,
    SourceSpec,
    VersionPolicy,
    package_dir,
    parse_spec,
)

__all__ = [
    "BatchingSpec",
    "ModelRepository",
    "ModelSpec",
    "SourceSpec",
    "VersionPolicy",
    "default_repository_path",
    "model_dirs",
    "package_dir",
    "parse_spec",
    "read_spec",
    "read_versions",
]
