"""Where a CUDA device is present: the device, the budget, and a model on it.

Skipped without CUDA (CI has none); run on a machine with a GPU with
``pytest -m gpu tests/gpu`` (scripts/gpu-check.sh runs them).
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
    from tessera.runtimes.base import SharedComponents
    from tessera.runtimes.forward import GraphsPath
    from tessera.runtimes.graph_runner import CAPTURE_ON_USE
    from tessera.runtimes.graphs import BATCH_BUCKETS, LENGTH_BUCKETS, SharedGraphs
    from tessera.runtimes.hf import SentenceEncoder
    from tessera.runtimes.hostcopy import one_block
    from tessera.runtimes.precision import CHECK_TEXTS
    from tessera.runtimes.template import same_layout, weight_tensors

    def graphs_of(encoder: SentenceEncoder) -> SharedGraphs:
        assert isinstance(encoder.path, GraphsPath)
        return encoder.path.hold.graphs

    def cosines(got: np.ndarray, want: np.ndarray) -> float:
        return float(np.min(np.sum(got * want, axis=1)))

    def other_weights(encoder: SentenceEncoder) -> None:
        with torch.no_grad():
            for parameter in encoder.model.parameters():
                parameter.mul_(1.02)

    folder = read_spec(default_repository_path() / "all-minilm-l6-v2").resolve_source()
    shared = SharedComponents()
    reference = SentenceEncoder.from_folder(folder, "cpu")
    encoder = SentenceEncoder.from_folder(folder, "cuda", shared=shared)  # dtype auto, graphs on
    other = SentenceEncoder.from_folder(folder, "cuda", shared=shared)
    other_reference = SentenceEncoder.from_folder(folder, "cpu")
    try:
        assert next(encoder.model.parameters()).dtype == torch.float16
        graphs = graphs_of(encoder)
        assert graphs.graphs.num_runners == len(BATCH_BUCKETS) * len(LENGTH_BUCKETS)
        texts = list(CHECK_TEXTS)
        want = reference.encode(texts)
        for size in (1, 3, len(texts)):  # through buckets of 1, 4 and 8 rows
            assert cosines(encoder.encode(texts[:size]), want[:size]) >= 0.999
        for size in (12, 32):  # through buckets of 16 and 32 rows
            many = (texts * 4)[:size]
            assert cosines(encoder.encode(many), reference.encode(many)) >= 0.999
        # Texts tokenised ahead (the gateways' form): padded on the host, pooled in the graph.
        rows = encoder.tokenizer(texts, truncation=True, max_length=256)["input_ids"]
        ids = [np.array(row, dtype=np.int32) for row in rows]
        for size in (1, 3, len(texts)):
            assert cosines(encoder.encode_ids(ids[:size]), want[:size]) >= 0.999
        first = reference.encode(texts, pooling="cls")
        assert cosines(encoder.encode_ids(ids, pooling="cls"), first) >= 0.999
        # A second model of the architecture replays the same graphs with its own weights.
        assert graphs_of(other) is graphs
        other_weights(other)
        other_weights(other_reference)
        theirs = other_reference.encode(texts)
        assert cosines(want, theirs) < 0.9999  # the weights differ
        assert cosines(other.encode(texts), theirs) >= 0.999
        assert cosines(encoder.encode(texts), want) >= 0.999
        # Each model gathered at its load into one block laid out as the
        # template's: another's weights go in as one copy of its block, and
        # texts tokenised ahead go in as one page-locked block of inputs.
        template = weight_tensors(graphs.template.module)
        for model in (encoder.model, other.model):
            assert one_block(weight_tensors(model)) is not None
            assert same_layout(template, weight_tensors(model))
        assert cosines(other.encode_ids(ids), theirs) >= 0.999
        assert cosines(encoder.encode_ids(ids), want) >= 0.999
        other.close()
        assert encoder.offload() is not None  # the last on the device: the graphs go too
        assert graphs.in_host_tier
        assert graphs.graphs.num_runners == 0
        encoder.restore()
        # Captured again on a bucket's second use, into a new pool: a capture
        # into the old pool's handle fails, and each bucket would run eager.
        for _ in range(CAPTURE_ON_USE):
            got = encoder.encode(texts)
            assert cosines(got, want) >= 0.999
        assert graphs.graphs.num_runners == 1
    finally:
        for each in (encoder, other, reference, other_reference):
            each.close()  # twice for one closed above: a no-op
    assert shared.keys() == []


def test_stacked_rounds_on_cuda_give_each_model_its_own_vectors() -> None:
    # Batching across models (runtimes/stacking.py): three models of the
    # architecture, cards saying `stack: 4`; a round of their batches is one
    # replay of a vmapped forward over their slots, each model's vectors as
    # its float32 forward gives them.
    import numpy as np

    from tessera.repository import default_repository_path, read_spec
    from tessera.runtimes.base import SharedComponents
    from tessera.runtimes.forward import DeviceOptions, StackedGraphsPath
    from tessera.runtimes.graphs import LENGTH_BUCKETS
    from tessera.runtimes.hf import SentenceEncoder
    from tessera.runtimes.precision import CHECK_TEXTS
    from tessera.runtimes.stacking import STACK_ROWS, RoundCall, StackedGraphs

    def cosines(got: np.ndarray, want: np.ndarray) -> float:
        got = got / np.linalg.norm(got, axis=1, keepdims=True)
        want = want / np.linalg.norm(want, axis=1, keepdims=True)
        return float(np.min(np.sum(got * want, axis=1)))

    folder = read_spec(default_repository_path() / "all-minilm-l6-v2").resolve_source()
    shared = SharedComponents()
    options = DeviceOptions(stack=4)
    encoders, references = [], []
    try:
        for n in range(3):
            reference = SentenceEncoder.from_folder(folder, "cpu")
            encoder = SentenceEncoder.from_folder(folder, "cuda", options, shared=shared)
            with torch.no_grad():
                for model in (reference.model, encoder.model):
                    for parameter in model.parameters():
                        parameter.mul_(1 + n / 50)
            encoders.append(encoder)
            references.append(reference)
        paths = [e.path for e in encoders]
        assert all(isinstance(p, StackedGraphsPath) for p in paths)
        graphs = paths[0].hold.graphs
        assert all(p.hold.graphs is graphs for p in paths)
        stacked = graphs.stacked
        assert isinstance(stacked, StackedGraphs)
        buckets = len(stacked.model_buckets) * len(STACK_ROWS) * len(LENGTH_BUCKETS)
        assert stacked.runners.num_runners == buckets  # all captured at the first load
        texts = list(CHECK_TEXTS)[:3]
        rows = encoders[0].tokenizer(texts, truncation=True, max_length=256)["input_ids"]
        ids = [np.array(row, dtype=np.int32) for row in rows]
        wants = [r.encode(texts, normalize=False) for r in references]
        assert cosines(wants[0], wants[2]) < 0.9999  # the weights differ
        for pooling in ("mean", "cls"):
            want_of = [r.encode(texts, pooling=pooling, normalize=False) for r in references]
            calls = [RoundCall(e.model, ids, pooling, lambda: None) for e in encoders]
            with torch.inference_mode():
                got = stacked.launch(calls)()
            for vectors, want in zip(got, want_of, strict=True):
                assert cosines(vectors, want) >= 0.999
        assert stacked.num_copies == 3
        # Through the encoders, as the engine's threads call them.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(6) as pool:
            found = list(pool.map(lambda i: encoders[i % 3].encode_ids(ids), range(6)))
        for i, vectors in enumerate(found):
            assert cosines(vectors, wants[i % 3]) >= 0.999
        # The slots leave with the graphs (the last model to the host tier) and come back empty.
        for encoder in encoders[1:]:
            encoder.close()
        assert encoders[0].offload() is not None
        assert stacked.num_bytes == 0
        encoders[0].restore()
        assert stacked.num_bytes == 4 * stacked.slot_bytes
        assert cosines(encoders[0].encode_ids(ids), wants[0]) >= 0.999
    finally:
        for each in encoders + references:
            each.close()
    assert shared.keys() == []
