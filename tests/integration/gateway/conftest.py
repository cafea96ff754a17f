"""The real app in-process over fake models (no weights), through httpx."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

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


# Tests whose requests leave nothing that another test reads (refusals, answers
# of the fake models) share one engine a module: an engine's close runs a full
# garbage collection (``EngineHost.shutdown``), about 0.4 s in a test process,
# most of such a test's time. Its leak checks run at the module's end.
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Engine]:
    root = tmp_path_factory.mktemp("shared") / "repo"
    async with fake_engine(root, FAKE_MODELS, max_queue=8) as engine:
        yield engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_client(shared_engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(shared_engine, max_body_bytes=64 * 1024)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
        yield client
