"""Builders for test objects (as vLLM's tests/v1/core/utils.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tessera.repository.spec import BatchingSpec, ModelSpec
from tessera.tasks.types import Task


def make_spec(
    name: str,
    own_bytes: int = 100,
    *,
    task: Task = Task.EMBEDDING,
    shared: dict[str, int] | None = None,
    max_bytes: int | None = None,
    batching: BatchingSpec | None = None,
    **options: Any,
) -> ModelSpec:
    """A ``fake``-adapter model spec that reports ``own_bytes``."""
    return ModelSpec(
        name=name,
        task=task,
        runtime="torch",
        adapter="fake",
        folder=Path("/nonexistent"),
        batching=batching or BatchingSpec(),
        max_bytes=max_bytes,
        options={"own_bytes": own_bytes, "shared": shared or {}, **options},
    )
