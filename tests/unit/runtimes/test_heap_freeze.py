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
from tessera.engine import host as host_module
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


def _host() -> tuple[EngineHost, ComputeExecutor]:
    executor = ComputeExecutor(CpuDevice(), num_threads=1, num_workers=1)
    return EngineHost(CpuDevice(), executor, ActivationBook(), adapters=FAKE_ADAPTERS), executor


def _with_cycle(model: object) -> weakref.ref[Node]:
    """Give ``model`` innards in a cycle that its unload lets go of; a
    reference to them that does not keep them alive."""
    payload = Node()
    model.payload = payload  # type: ignore[attr-defined]
    end = model.unload  # type: ignore[attr-defined]

    def unload() -> None:
        end()
        del model.payload  # type: ignore[attr-defined]

    model.unload = unload  # type: ignore[attr-defined]
    return weakref.ref(payload)


async def test_a_model_loaded_after_the_freeze_is_collected_without_a_full_collection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    full: list[str] = []
    monkeypatch.setattr(host_module, "collect_all", lambda: full.append("collect"))
    host, executor = _host()
    first, spec = make_spec("a", 300), make_spec("b", 300)
    try:
        await host.load(first)  # the adapter's first load: its libraries frozen
        frozen = gc.get_freeze_count()
        model = await host.load(spec)
        assert gc.get_freeze_count() <= frozen  # a later load freezes nothing
        gone = _with_cycle(model)
        await host.unload(spec, model)
        assert gone() is None
        assert full == []  # an ordinary collection found it
    finally:
        host.shutdown()
        executor.shutdown()


async def test_a_model_alive_at_a_freeze_is_collected_in_full_when_unloaded() -> None:
    host, executor = _host()
    first, spec = make_spec("a", 300), make_spec("b", 300)
    try:
        await host.load(first)
        model = await host.load(spec)
        gone = _with_cycle(model)
        freeze_heap()  # as the server's start freezes the preloaded models
        gc.collect()
        assert gone() is not None  # frozen: an ordinary collection passes it by
        await host.unload(spec, model)
        assert gone() is None
    finally:
        host.shutdown()
        executor.shutdown()


async def test_ordinary_collections_at_unloads_run_at_most_once_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[int] = []
    real_collect = gc.collect
    monkeypatch.setattr(host_module.gc, "collect", lambda: ran.append(1) or real_collect())
    host, executor = _host()
    now = [100.0]
    host.monotonic = lambda: now[0]
    specs = [make_spec(name, 300) for name in ("a", "b", "c", "d")]
    try:
        models = [await host.load(spec) for spec in specs]  # "a" first: frozen
        gone = _with_cycle(models[2])
        ran.clear()  # the loads' measurements collect too
        await host.unload(specs[1], models[1])
        assert len(ran) == 1
        now[0] += 0.5
        await host.unload(specs[2], models[2])
        assert ran == [1]  # half a second later: not yet
        assert gone() is not None
        now[0] += 0.5
        await host.unload(specs[3], models[3])
        assert len(ran) == 2  # a second on: collected with the next
        assert gone() is None
    finally:
        host.shutdown()
        executor.shutdown()
