"""Builders for test objects (as vLLM's tests/v1/core/utils.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

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


def write_fake_repository(
    root: Path, models: dict[str, dict[str, Any]], *, batching: dict[str, Any] | None = None
) -> Path:
    """A model repository of ``fake``-adapter models: ``{name: descriptor fields}``
    over defaults (1000 own bytes; ``batching`` for models that give none)."""
    for name, extra in models.items():
        folder = root / name
        folder.mkdir(parents=True)
        descriptor = {
            "name": name,
            "runtime": "torch",
            "adapter": "fake",
            "batching": batching or {"max_batch_size": 16, "max_wait_ms": 20},
            **extra,
            "options": {"own_bytes": 1000, **extra.get("options", {})},
        }
        (folder / "model.yaml").write_text(yaml.safe_dump(descriptor))
    return root


# The metric families the observability issue names (and a few more we promise).
ISSUE_FAMILIES = frozenset(
    {
        "tessera_requests_total",
        "tessera_request_duration_seconds",
        "tessera_queue_duration_seconds",
        "tessera_batch_size",
        "tessera_batch_duration_seconds",
        "tessera_queue_depth",
        "tessera_memory_budget_bytes",
        "tessera_memory_used_bytes",
        "tessera_memory_peak_used_bytes",
        "tessera_model_resident_bytes",
        "tessera_model_state",
        "tessera_model_loads_total",
        "tessera_model_evictions_total",
        "tessera_model_load_seconds",
        "tessera_rejected_requests_total",
        "tessera_slo_target_seconds",
        "tessera_slo_requests_total",
        "tessera_device_memory_used_bytes",
        "tessera_device_memory_total_bytes",
        "tessera_device_utilization_ratio",
        "tessera_process_resident_bytes",
        "tessera_process_cpu_seconds_total",
    }
)
