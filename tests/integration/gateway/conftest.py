"""The real app in-process over fake models (no weights), through httpx."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from builders import fake_engine
from tessera.engine import Engine
from tessera.gateway import create_app

FAKE_MODELS: dict[str, dict[str, Any]] = {
    "embed": {"task": "embedding", "preload": True, "max_inputs": 4, "latency_target_ms": 1000},
    "rerank": {"task": "rerank"},
    "intent": {"task": "classify"},
    "ocr": {"task": "ocr"},
    "tts": {"task": "tts"},
    "mt": {"task": "translate"},
    "chat": {"task": "generate"},
    "slow": {
        "task": "embedding",
        "options": {"run_s": 0.1},
        "batching": {"max_batch_size": 1},
        "latency_target_ms": 50,  # it runs 0.1 s: always over
    },
    # Allocates 1.25 MiB per work unit while a batch runs: its warm-up measures that.
    "scratch": {"task": "embedding", "options": {"scratch_bytes_per_unit": 5 * 2**18}},
    # The same, with its items run one after another, each its scratch alone.
    "scratch-alone": {
        "task": "embedding",
        "options": {"scratch_bytes_per_unit": 5 * 2**18, "items_alone": True},
    },
    "broken": {"task": "embedding", "options": {"fail_load": True}},
    "huge": {"task": "embedding", "options": {"own_bytes": 10**12}},
}


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    async with fake_engine(tmp_path / "repo", FAKE_MODELS, max_queue=8) as engine:
        yield engine


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(engine, max_body_bytes=64 * 1024)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
        yield client
