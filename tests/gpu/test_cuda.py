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


def test_the_encoder_on_cuda_runs_float16_graphs_that_answer_as_float32_does() -> None:
    import numpy as np

    from tessera.repository import default_repository_path, read_spec
    from tessera.runtimes.graphs import BATCH_BUCKETS, CHECK_TEXTS, LENGTH_BUCKETS
    from tessera.runtimes.hf import SentenceEncoder

    folder = read_spec(default_repository_path() / "all-minilm-l6-v2").resolve_source()
    reference = SentenceEncoder.from_folder(folder, "cpu")
    encoder = SentenceEncoder.from_folder(folder, "cuda")  # dtype auto, graphs on
    try:
        assert next(encoder.model.parameters()).dtype == torch.float16
        assert encoder.graphs is not None
        assert encoder.graphs.num_runners == len(BATCH_BUCKETS) * len(LENGTH_BUCKETS)
        texts = list(CHECK_TEXTS)
        want = reference.encode(texts)
        for size in (1, 3, len(texts)):  # through buckets of 1, 4 and 8 rows
            got = encoder.encode(texts[:size])
            assert np.min(np.sum(got * want[:size], axis=1)) >= 0.999
        for size in (12, 32):  # through buckets of 16 and 32 rows
            many = (texts * 4)[:size]
            got = encoder.encode(many)
            assert np.min(np.sum(got * reference.encode(many), axis=1)) >= 0.999
        assert encoder.offload() is not None  # the graphs go with the weights
        assert encoder.graphs.num_runners == 0
        encoder.restore()
        got = encoder.encode(texts)  # captured again as needed
        assert np.min(np.sum(got * want, axis=1)) >= 0.999
    finally:
        encoder.close()
        reference.close()
