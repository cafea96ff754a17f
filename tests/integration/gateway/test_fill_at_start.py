"""The budget filled at start (``EngineConfig.fill``) through the real engine
and engine host over fake models: what fits is ready before the server is,
demand remembered from the audit log comes first, an explicit preload list
means exactly those models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from builders import fake_engine, write_fake_repository
from harness.fake_models import FAKE_ADAPTERS
from tessera.engine import Engine, EngineConfig
from tessera.repository import ModelRepository

MIB = 1024**2
# 100 MiB of weights in a 64 MiB budget: the fill stops at 90% of it.
MODELS: dict[str, dict[str, Any]] = {
    "small": {"task": "embedding", "options": {"own_bytes": 10 * MIB}},
    "medium": {"task": "embedding", "options": {"own_bytes": 20 * MIB}},
    "large": {"task": "embedding", "options": {"own_bytes": 30 * MIB}},
    "huge": {"task": "embedding", "options": {"own_bytes": 40 * MIB}},
}


def ready(engine: Engine) -> set[str]:
    return {m.name for m in engine.snapshot().models if m.state == "ready"}


async def test_the_default_fills_the_budget_smallest_first_before_ready(tmp_path: Path) -> None:
    async with fake_engine(tmp_path / "repo", MODELS, fill=None) as engine:
        assert engine.ready
        assert ready(engine) == {"small", "medium"}  # 30 MiB; with large 60, over 57.6
        assert engine.snapshot().evictions_total == 0


async def test_remembered_demand_is_loaded_first(tmp_path: Path) -> None:
    repository = ModelRepository.from_folders([write_fake_repository(tmp_path / "repo", MODELS)])
    config = EngineConfig(
        memory_budget_bytes=64 * MIB, device="cpu", num_threads=2, adapters=FAKE_ADAPTERS
    )
    engine = Engine(repository, config)
    try:
        engine.seed_demand({"huge@1": 5, "huge": 3, "small": 1})
        await engine.preload()
        assert ready(engine) == {"huge", "small"}  # 50 MiB; medium would pass 57.6
    finally:
        await engine.close()


async def test_an_explicit_preload_list_is_exactly_what_loads(tmp_path: Path) -> None:
    async with fake_engine(tmp_path / "repo", MODELS, fill=None, preload=("medium",)) as engine:
        assert ready(engine) == {"medium"}
