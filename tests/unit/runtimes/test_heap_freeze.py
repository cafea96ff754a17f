"""Objects that live as long as the server, out of the collector's way
(``memory.freeze_heap``), and an ended model's cycles freed all the same."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from builders import make_spec
from harness.fake_models import FAKE_ADAPTERS
from tessera.device import CpuDevice
from tessera.engine.executor import ComputeExecutor
from tessera.engine.host import EngineHost
from tessera.residency import ActivationBook
from tessera.runtimes.memory import collect_all, freeze_heap


class Node:
    """An object in a reference cycle: only a collection frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the test run collects as before
    gc.collect()


def test_a_frozen_cycle_is_freed_by_collect_all_only() -> None:
    node = Node()
    gone = weakref.ref(node)
    freeze_heap()
    assert gc.get_freeze_count() > 0
    del node
    gc.collect()
    assert gone() is not None  # frozen: an ordinary collection passes it by
    collect_all()
    assert gone() is None
    assert gc.get_freeze_count() > 0  # the survivors frozen again


async def test_a_loaded_model_is_frozen_and_its_cycles_go_when_it_is_unloaded() -> None:
    executor = ComputeExecutor(CpuDevice(), num_threads=1, num_workers=1)
    host = EngineHost(CpuDevice(), executor, ActivationBook(), adapters=FAKE_ADAPTERS)
    spec = make_spec("a", 300)
    try:
        gc.unfreeze()
        model = await host.load(spec)
        model.payload = Node()  # type: ignore[attr-defined]  # its innards, in a cycle
        assert gc.get_freeze_count() > 0
        gc.freeze()  # frozen as the innards a load builds are
        gone = weakref.ref(model.payload)  # type: ignore[attr-defined]
        end = model.unload

        def unload() -> None:
            end()
            del model.payload  # type: ignore[attr-defined]

        model.unload = unload  # type: ignore[method-assign]
        await host.unload(spec, model)
        assert gone() is None
    finally:
        host.shutdown()
        executor.shutdown()
