"""Where a CUDA device is present: the device, the budget, and a model on it.

Skipped without CUDA (CI has none); run on a machine with a GPU with
``pytest -m gpu tests/gpu``. Not yet run on a GPU: no device was lent when
these were written.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_device_reports_memory_and_an_80_percent_budget() -> None:
    from tessera.device import CUDA_BUDGET_SHARE, CudaDevice

    device = CudaDevice(0)
    total = device.total_bytes()
    assert total > 0
    assert device.default_budget_bytes() == int(total * CUDA_BUDGET_SHARE)
    stats = device.stats()
    assert 0 < stats.used_bytes <= stats.total_bytes


async def test_embedding_model_runs_on_cuda_within_the_budget() -> None:
    from tessera.engine import Engine, EngineConfig
    from tessera.repository import ModelRepository, default_repository_path
    from tessera.tasks.types import Task, TextInput

    repository = ModelRepository.from_folders([default_repository_path()])
    engine = Engine(repository, EngineConfig(device="cuda", memory_budget_bytes=2 * 1024**3))
    try:
        outputs = await engine.infer(
            "all-minilm-l6-v2", Task.EMBEDDING, [TextInput("hello"), TextInput("world")]
        )
        assert len(outputs) == 2
        assert len(outputs[0]) == 384
        stats = engine.snapshot()
        assert 0 < stats.used_bytes <= stats.budget_bytes
        resident = stats.model("all-minilm-l6-v2")
        assert resident is not None
        assert resident.measured_by is not None
        assert "torch tensors" in resident.measured_by
        # The allocator measured an activation peak for the warm-up batch.
        assert resident.activation_bytes_per_unit is not None
    finally:
        await engine.close()
