"""The host tier on real torch weights (CPU): a copy held as the mapped
safetensors file (its pages left to the page cache, unmapped from the process)
and mapped again on the way back; then the real MiniLM trio through the
engine, evicted by another model and brought back from the tier with the same
answers. Timing is the benchmark's (benchmarks/reload_bench.py), not asserted.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tessera.engine import Engine, EngineConfig
from tessera.errors import ModelUnavailableError
from tessera.repository import ModelRepository, default_repository_path, read_spec
from tessera.runtimes.filemap import read_regions
from tessera.runtimes.hostcopy import PINNED, HostCopy, HostCopyError
from tessera.tasks.types import ClassifyOutput, RerankInput, Task, TextInput

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.slow
MIB = 1024**2


def tiny_module(folder: Path) -> tuple[Any, Path]:
    """A small tied-weight model whose tensors map ``folder/model.safetensors``,
    as transformers maps them, plus one buffer in process memory."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
    path = folder / "model.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in module.state_dict().items()}, path)
    with safetensors_torch.safe_open(str(path), "pt") as f:
        for name, tensor in module.named_parameters():
            tensor.data = f.get_tensor(name)
    module[1].weight = torch.nn.Parameter(module[0].weight.data)  # tied: one storage, two views
    module.register_buffer("scale", torch.full((64,), 2.0))  # not from a file
    return module.eval(), path


def forward(module: Any) -> Any:
    with torch.inference_mode():
        return module[1](module[0](torch.arange(8))) * module.scale


def mapped(path: Path) -> bool:
    return any(r.path == str(path) for r in read_regions())


def test_a_cpu_copy_unmaps_the_file_and_maps_the_same_bytes_back(tmp_path: Path) -> None:
    module, path = tiny_module(tmp_path)
    before = forward(module)
    assert mapped(path)

    copy = HostCopy.offload([module], "cpu")
    held = copy.footprint()
    assert not mapped(path)  # the pages are the page cache's now, not the process's
    assert module[0].weight.numel() == 0
    assert held.total_bytes == 64 * 16 * 4 + 64 * 4 + 64 * 4  # embedding (tied), bias, buffer
    assert f"mapped weight files ({64 * 16 * 4 + 64 * 4} B)" in held.method
    assert f"process memory ({64 * 4} B)" in held.method

    copy.restore()
    assert mapped(path)
    assert torch.equal(forward(module), before)
    # The tied view shares its storage with the embedding again.
    weight, tied = module[0].weight, module[1].weight
    assert weight.untyped_storage().data_ptr() == tied.untyped_storage().data_ptr()
    with pytest.raises(HostCopyError):
        copy.restore()


def test_a_cpu_copy_whose_file_changed_refuses_to_come_back(tmp_path: Path) -> None:
    module, path = tiny_module(tmp_path)
    copy = HostCopy.offload([module], "cpu")
    os.utime(path, ns=(0, 0))
    with pytest.raises(HostCopyError):
        copy.restore()


class FakeCudart:
    """Stands for torch.cuda.cudart(): records what is page-locked."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


def test_the_pinned_buffer_is_registered_at_its_exact_size_and_unregistered_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The CUDA path's bookkeeping, on CPU tensors: one buffer for every storage,
    # each at an aligned offset, page-locked once at its exact size, unlocked
    # once when freed (and not again when collected) by a pool that keeps none.
    from tessera.runtimes.hostcopy import PinnedPool, _Pinned

    cudart = on_cpu_as_cuda(monkeypatch, PinnedPool(max_buffers=0))
    tensors = [torch.arange(100, dtype=torch.float32), torch.arange(7, dtype=torch.int64)]
    storages = [t.untyped_storage() for t in tensors]
    pinned = _Pinned.copy_of(storages, "cpu")
    assert pinned.nbytes == 512 + 512  # 400 and 56 bytes, each at a 512-byte boundary
    assert list(cudart.registered.values()) == [pinned.nbytes]
    back = pinned.to_device("cpu")  # one storage, laid out as the buffer
    assert pinned.offsets == [0, 512]
    for tensor, offset in zip(tensors, pinned.offsets, strict=True):
        first = offset // tensor.element_size()
        again = torch.empty(0, dtype=tensor.dtype).set_(back, first, tensor.size(), (1,))
        assert torch.equal(again, tensor)
    pinned.free()
    del pinned
    assert cudart.unregistered == list(cudart.registered)


def test_a_restored_copy_leaves_its_page_locked_buffer_to_the_next_copy_of_its_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tessera.runtimes.hostcopy import PinnedPool, _Pinned

    pool = PinnedPool(max_buffers=2)
    cudart = on_cpu_as_cuda(monkeypatch, pool)
    weights = [torch.arange(100, dtype=torch.float32).untyped_storage()]
    first = _Pinned.copy_of(weights, "cpu")
    first.to_device("cpu")
    first.free()
    first.free()  # once only: the pool holds the buffer once
    assert pool.held_bytes() == 512
    second = _Pinned.copy_of(weights, "cpu")  # the same architecture, evicted next
    assert len(cudart.registered) == 1  # the buffer kept, not a new one locked
    assert pool.held_bytes() == 0
    other = _Pinned.copy_of([torch.arange(300, dtype=torch.float32).untyped_storage()], "cpu")
    assert len(cudart.registered) == 2  # another size: a buffer of its own
    second.free()
    other.free()
    third = _Pinned.copy_of([torch.arange(200, dtype=torch.int64).untyped_storage()], "cpu")
    third.free()  # a third buffer kept: the oldest goes
    assert cudart.unregistered == [next(iter(cudart.registered))]
    assert pool.held_bytes() == 1536 + 2048
    pool.clear()
    assert sorted(cudart.unregistered) == sorted(cudart.registered)


def test_a_pinned_copy_comes_back_as_one_block_which_later_swaps_empty_and_refill(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The CUDA path end to end on CPU tensors (the device block allocated in
    # process memory): a model's storages come back as views of one block laid
    # out as the buffer; from then on a swap empties that one storage and fills
    # it again, its views untouched (a view held elsewhere sees it emptied:
    # the bytes are gone). Answers, tied weights and the buffer (from the pool)
    # hold through three swaps.
    from tessera.runtimes import hostcopy
    from tessera.runtimes.hostcopy import PinnedPool, tensors_of

    cudart = on_cpu_as_cuda(monkeypatch, PinnedPool())
    monkeypatch.setattr(
        hostcopy, "device_bytes", lambda n, device: torch.empty(n, dtype=torch.uint8)
    )
    module, _ = tiny_module(tmp_path)
    before = forward(module)
    tensors = tensors_of([module])
    loaded = len({t.untyped_storage().data_ptr() for t in tensors})  # the tied pair as one
    counts = storages_copied(monkeypatch)
    for swap in range(3):
        held_elsewhere = module[1].weight.detach()
        copy = HostCopy.offload([module], "cuda", tensors)
        assert copy.footprint().method == PINNED
        assert module[0].weight.untyped_storage().nbytes() == 0
        assert module.scale.untyped_storage().nbytes() == 0
        emptied = held_elsewhere.untyped_storage().nbytes() == 0
        assert emptied == (swap > 0)  # the first swap replaced the loaded storages
        copy.restore()
        assert torch.equal(forward(module), before)
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        assert len(storages) == 1  # every tensor a view of the one block
        weight, tied = module[0].weight, module[1].weight
        assert weight.data_ptr() == tied.data_ptr()
    assert counts == [loaded, 1, 1]  # storages copied out: each as loaded, then the block
    assert len(cudart.registered) == 1


def test_weights_that_never_change_are_not_copied_out_again_while_their_buffer_waits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A model's own weights (an owner given): its restore leaves the buffer
    # in the pool marked as its, and its next eviction takes it back instead
    # of copying. Another copy of that size takes a new buffer while the pool
    # has room to keep one more; at the pool's bound it takes this one, and
    # the eviction copies again. Answers hold throughout.
    from tessera.runtimes import hostcopy
    from tessera.runtimes.hostcopy import PinnedPool, _Pinned, tensors_of

    pool = PinnedPool()
    cudart = on_cpu_as_cuda(monkeypatch, pool)
    monkeypatch.setattr(
        hostcopy, "device_bytes", lambda n, device: torch.empty(n, dtype=torch.uint8)
    )
    module, _ = tiny_module(tmp_path)
    before = forward(module)
    tensors = tensors_of([module])
    loaded = len({t.untyped_storage().data_ptr() for t in tensors})
    counts = storages_copied(monkeypatch)
    owner = object()
    for _ in range(3):
        copy = HostCopy.offload([module], "cuda", tensors, owner=owner)
        assert module[0].weight.untyped_storage().nbytes() == 0
        assert copy.footprint().method == PINNED
        copy.restore()
        assert torch.equal(forward(module), before)
    assert counts == [loaded]  # copied out once, as loaded; then its buffer taken back
    assert len(cudart.registered) == 1
    size = pool.held_bytes()
    other = _Pinned.copy_of([torch.zeros(size, dtype=torch.uint8).untyped_storage()], "cpu")
    assert pool.held_bytes() == size  # room for one more: the other's is new
    assert len(cudart.registered) == 2
    copy = HostCopy.offload([module], "cuda", tensors, owner=owner)
    assert counts == [loaded, 1]  # the other's copy; this one's buffer taken back
    copy.restore()
    assert torch.equal(forward(module), before)
    pool.max_buffers = 1  # at the bound: no room for another
    third = _Pinned.copy_of([torch.zeros(size, dtype=torch.uint8).untyped_storage()], "cpu")
    assert pool.held_bytes() == 0  # a third model's eviction took the buffer
    copy = HostCopy.offload([module], "cuda", tensors, owner=owner)
    assert counts == [loaded, 1, 1, 1]  # the third's copy, then this one's: copied again
    copy.restore()
    assert torch.equal(forward(module), before)
    other.free()
    third.free()


def test_a_hundred_models_swapping_through_twenty_places_copy_out_only_until_warm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The swaps of 100 models under a budget that holds 20 (least recently
    # used out, round robin then Zipf): once each place's model has been
    # restored, every eviction takes its own buffer back. A pool that gave a
    # marked buffer to any copy that found no unmarked one held about one,
    # and every swap copied out.
    from tessera.runtimes import hostcopy
    from tessera.runtimes.hostcopy import PinnedPool, tensors_of

    pool = PinnedPool()
    on_cpu_as_cuda(monkeypatch, pool)
    monkeypatch.setattr(
        hostcopy, "device_bytes", lambda n, device: torch.empty(n, dtype=torch.uint8)
    )
    counts = storages_copied(monkeypatch)
    modules = [torch.nn.Linear(8, 8) for _ in range(100)]
    tensors = [tensors_of([m]) for m in modules]
    owners = [object() for _ in modules]
    copies: dict[int, HostCopy] = {}
    resident = list(range(100))  # least recently used first
    evictions = [0]

    def use(model: int) -> None:
        if model in resident:
            resident.remove(model)
        else:
            victim = resident.pop(0)
            copies[victim] = HostCopy.offload(
                [modules[victim]], "cuda", tensors[victim], owner=owners[victim]
            )
            evictions[0] += 1
            copies.pop(model).restore()
        resident.append(model)

    while len(resident) > 20:
        victim = resident.pop(0)
        copies[victim] = HostCopy.offload(
            [modules[victim]], "cuda", tensors[victim], owner=owners[victim]
        )
    for model in range(100):  # a round robin: the swaps of the 20 loaded, not restored, copy out
        use(model)
    warm = len(counts)
    assert warm == 80 + 20
    rng = np.random.default_rng(0)
    for model in [*range(100), *rng.zipf(1.1, 2000) % 100]:
        use(int(model))
    assert len(counts) == warm  # no copy out once warm
    assert len(pool._free) == 20  # a buffer for each model on the device
    assert pool.copies() == (warm, 80 + evictions[0] - warm)  # as the metrics count them
    for copy in copies.values():
        copy.close()


def test_the_pool_lets_unmarked_buffers_go_before_a_models_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tessera.runtimes.hostcopy import PinnedPool

    pool = PinnedPool(max_buffers=2)
    cudart = on_cpu_as_cuda(monkeypatch, pool)
    mine, spare, later = (torch.zeros(n, dtype=torch.uint8) for n in (512, 512, 1024))
    owner = object()
    pool.give(mine, owner)
    pool.give(spare)
    pool.give(later)  # over the bound: the unmarked one goes, though not the oldest
    assert pool.held_bytes() == 512 + 1024
    assert cudart.unregistered == [spare.data_ptr()]
    assert pool.reclaim(object(), 512) is None  # marked for another owner
    assert pool.reclaim(owner, 1024) is None  # not of that size
    assert pool.reclaim(owner, 512) is mine
    assert pool.reclaim(owner, 512) is None  # taken back once


def storages_copied(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many storages each pinned copy takes, recorded."""
    from tessera.runtimes.hostcopy import _Pinned

    counts: list[int] = []
    copy_of = _Pinned.copy_of.__func__  # type: ignore[attr-defined]

    def counted(cls: type[_Pinned], storages: list[Any], device: str) -> _Pinned:
        counts.append(len(storages))
        return copy_of(cls, storages, device)  # type: ignore[no-any-return]

    monkeypatch.setattr(_Pinned, "copy_of", classmethod(counted))
    return counts


def test_at_its_bound_the_pool_gives_a_copy_the_buffer_of_the_model_restored_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With no room for a new buffer, a copy out takes a marked one: the
    # newest, whose model (restored last) least-recently-used eviction takes
    # last; the oldest belongs to the model likeliest to go next.
    from tessera.runtimes.hostcopy import PinnedPool

    pool = PinnedPool(max_buffers=2)
    cudart = on_cpu_as_cuda(monkeypatch, pool)
    older, newer = object(), object()
    first, second = (torch.zeros(512, dtype=torch.uint8) for _ in range(2))
    pool.give(first, older)
    pool.give(second, newer)
    assert pool.take(512) is second
    assert pool.reclaim(older, 512) is first
    assert pool.copies() == (1, 1)
    pool.give(first, older)
    assert pool.take(512) is not first  # room again (one waits): a new buffer
    assert len(cudart.registered) == 1


def test_the_pool_keeps_no_more_bytes_than_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from tessera.runtimes.hostcopy import PinnedPool, _Pinned

    pool = PinnedPool(max_buffers=4, max_bytes=1024)
    cudart = on_cpu_as_cuda(monkeypatch, pool)
    for n in (100, 200, 300):  # 512, 1024 and 1536 bytes
        _Pinned.copy_of([torch.zeros(n).untyped_storage()], "cpu").free()
    assert pool.held_bytes() == 0  # the 1536: above the bound alone; each before it pushed out
    assert len(cudart.unregistered) == 3


def on_cpu_as_cuda(monkeypatch: pytest.MonkeyPatch, pool: Any) -> FakeCudart:
    """The pinned path on CPU tensors: a stand-in for ``cudart``, no streams,
    ``pool`` as the process's pool of buffers."""
    from tessera.runtimes import hostcopy

    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)

    @contextlib.contextmanager
    def copying(device: str, direction: str) -> Iterator[Callable[[Any], None]]:
        yield lambda tensor: None

    monkeypatch.setattr(hostcopy, "copying", copying)
    monkeypatch.setattr(hostcopy, "PINNED_POOL", pool)
    return cudart


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_copy_is_pinned_host_memory_and_comes_back_equal(tmp_path: Path) -> None:
    from tessera.runtimes import hostcopy

    module, _ = tiny_module(tmp_path)
    module = module.to("cuda")
    before = forward_on(module, "cuda")
    allocated = torch.cuda.memory_allocated()
    copy = HostCopy.offload([module], "cuda")
    assert copy.footprint().method == PINNED
    assert copy.footprint().total_bytes >= 64 * 16 * 4 + 2 * 64 * 4
    assert module[0].weight.numel() == 0
    assert torch.cuda.memory_allocated() < allocated  # the device storages are gone
    copy.restore()
    assert torch.equal(forward_on(module, "cuda"), before)
    kept = hostcopy.PINNED_POOL.held_bytes()
    assert kept >= copy.footprint().total_bytes  # its buffer waits for the next copy
    again = HostCopy.offload([module], "cuda")
    assert hostcopy.PINNED_POOL.held_bytes() == kept - again.footprint().total_bytes
    again.restore()
    assert torch.equal(forward_on(module, "cuda"), before)


def forward_on(module: Any, device: str) -> Any:
    with torch.inference_mode():
        return module[1](module[0](torch.arange(8, device=device))) * module.scale


def test_a_sequence_classifier_leaves_and_comes_back_with_the_same_answers(
    tmp_path: Path,
) -> None:
    import yaml
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    from tessera.runtimes.base import OffloadingModel, standalone_context
    from tessera.runtimes.registry import get_loader

    weights = tmp_path / "weights"
    weights.mkdir()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "a", "dog"]
    (weights / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(weights / "vocab.txt")).save_pretrained(weights)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    BertForSequenceClassification(config).eval().save_pretrained(weights)
    card = tmp_path / "clf"
    card.mkdir()
    raw = {
        "name": "clf",
        "task": "classify",
        "runtime": "torch",
        "adapter": "hf-sequence-classifier",
        "source": {"path": str(weights)},
    }
    (card / "model.yaml").write_text(yaml.safe_dump(raw))
    spec = read_spec(card)
    model = get_loader(spec.adapter).load(spec, standalone_context())
    items = [TextInput("the cat sat"), TextInput("a dog")]
    try:
        before = model.run(items)
        assert isinstance(model, OffloadingModel)
        held = model.offload()
        assert held is not None
        assert held.total_bytes == model.memory().own_bytes
        assert not mapped(weights / "model.safetensors")
        with pytest.raises(ModelUnavailableError):
            model.run(items)
        model.restore()
        assert model.run(items) == before
    finally:
        model.unload()


# -- the MiniLM trio through the engine -----------------------------------------

TRIO = ("all-minilm-l6-v2", "minilm-rerank", "intent-minilm")
# An ONNX model that does not fit beside them (about 88 MiB) in 120 MiB when run
# dequantised (about 80 MiB; served int8 it takes about 25 MiB and would sit
# beside the trio).
OTHER = "all-minilm-l6-v2-int8"
SENTENCES = [TextInput("A man is eating food."), TextInput("Where is the train station?")]
PAIR = [RerankInput("How do I bake bread?", "Mix flour, water and yeast, then bake it.")]


async def answers(engine: Engine) -> tuple[Any, Any, Any]:
    vectors = await engine.infer(TRIO[0], Task.EMBEDDING, SENTENCES)
    scores = await engine.infer(TRIO[1], Task.RERANK, PAIR)
    intents = await engine.infer(TRIO[2], Task.CLASSIFY, SENTENCES)
    return np.stack(vectors), scores, intents


async def test_the_minilm_trio_comes_back_from_the_host_tier_with_identical_answers() -> None:
    folder = default_repository_path()
    other_spec = read_spec(folder / OTHER)
    other_spec = replace(other_spec, options={**other_spec.options, "run_quantised": False})
    repository = ModelRepository([*(read_spec(folder / name) for name in TRIO), other_spec])
    engine = Engine(
        repository,
        EngineConfig(
            memory_budget_bytes=120 * MIB,
            host_memory_budget_bytes=200 * MIB,
            device="cpu",
            num_threads=1,
            preload=(),
        ),
    )
    try:
        vectors, scores, intents = await answers(engine)
        await engine.infer(OTHER, Task.EMBEDDING, SENTENCES)  # evicts the trio
        stats = engine.snapshot()
        for name in TRIO:
            model = stats.model(name)
            assert model is not None
            assert (model.state, model.host_tier) == ("unloaded", True)
        encoder_bytes = stats.host_used_bytes
        assert 80 * MIB < encoder_bytes < 100 * MIB  # one encoder for three, and a head

        again = await answers(engine)  # the trio is back: OTHER goes
        assert np.array_equal(again[0], vectors)
        assert again[1] == scores
        assert again[2] == intents
        assert isinstance(intents[0], ClassifyOutput)
        stats = engine.snapshot()
        for name in TRIO:
            model = stats.model(name)
            assert model is not None
            assert (model.state, model.loads, model.host_loads) == ("ready", 2, 1)
            assert model.files_load_s is not None
            assert model.host_load_s is not None
        other = stats.model(OTHER)
        assert other is not None
        # The ONNX session does not use the tier: it was unloaded.
        assert (other.state, other.host_tier, other.evictions) == ("unloaded", False, 1)
    finally:
        await engine.close()
    assert engine.snapshot().host_used_bytes == 0


def test_the_host_tiers_copies_go_in_pieces_that_together_are_the_whole() -> None:
    # A copy engine runs copies in turn: a batch's inputs wait behind a piece
    # of a model's weights, not all of them. Pieces of 64 bytes over 1,000
    # (the last piece short) and a piece larger than the whole.
    from tessera.runtimes.hostcopy import copy_in_pieces

    source = torch.arange(1000, dtype=torch.int64).remainder(251).to(torch.uint8)
    for piece in (64, 1000, 4096):
        into = torch.zeros(1000, dtype=torch.uint8)
        copy_in_pieces(into, source, piece)
        assert torch.equal(into, source)
