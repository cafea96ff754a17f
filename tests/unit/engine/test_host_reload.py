"""The engine host measures a model at its first load only, after priming the
libraries of an adapter whose bytes are the process's growth; reloads skip
the loader's own warm-up."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

from builders import make_spec
from harness.fake_models import FAKE_ADAPTERS, FakeLoader, FakeModel
from tessera.device import CpuDevice
from tessera.engine.executor import ComputeExecutor
from tessera.engine.host import EngineHost
from tessera.residency import ActivationBook
from tessera.runtimes.base import LoadContext
from tessera.runtimes.memory import Measured
from tessera.tasks.types import TextInput


class CountingExecutor(ComputeExecutor):
    def __init__(self) -> None:
        super().__init__(CpuDevice(), num_threads=1, num_workers=1)
        self.exclusive_calls = 0

    def measure_exclusive(self, fn: Any) -> Measured:
        self.exclusive_calls += 1
        return super().measure_exclusive(fn)


async def test_a_reload_is_neither_measured_nor_warmed_up_again() -> None:
    executor = CountingExecutor()
    activations = ActivationBook()
    host = EngineHost(CpuDevice(), executor, activations, adapters=FAKE_ADAPTERS)
    spec = make_spec("a", 300)
    try:
        model = await host.load(spec)
        assert executor.exclusive_calls == 1  # the warm-up batch, alone
        observed = activations.of("a").num_samples
        await host.unload(spec, model)
        again = await host.load(spec)
        assert executor.exclusive_calls == 1
        assert activations.of("a").num_samples == observed
        assert len(again.run([TextInput("x")])) == 1  # a reload serves as the first did
        await host.unload(spec, again)
        other = await host.load(make_spec("b", 300))  # another model: measured
        assert executor.exclusive_calls == 2
        await host.unload(make_spec("b", 300), other)
    finally:
        host.shutdown()
        executor.shutdown()


class RecordingLoader(FakeLoader):
    """The fake loader, noting for each load whether it was measured and warmed up."""

    def __init__(self, executor: CountingExecutor) -> None:
        self.executor = executor
        self.loads: list[tuple[str, bool, bool]] = []

    def load(self, spec: Any, ctx: LoadContext) -> FakeModel:
        before = self.executor.exclusive_calls
        ctx.measure(lambda: None)  # a measured load measures alone
        measured = self.executor.exclusive_calls > before
        self.loads.append((spec.name, measured, ctx.warm_up))
        return super().load(spec, ctx)


async def test_libraries_are_primed_before_an_adapters_first_measured_load() -> None:
    executor = CountingExecutor()
    loader = RecordingLoader(executor)
    host = EngineHost(CpuDevice(), executor, ActivationBook(), loaders={"fake": loader})
    native = [dataclasses.replace(make_spec(n, 300), runtime="native") for n in ("a", "b")]
    torch = make_spec("t", 300)
    try:
        model = await host.load(native[0])
        # Primed (unmeasured, warmed up, unloaded), then loaded measured and warmed up.
        assert loader.loads == [("a", False, True), ("a", True, True)]
        await host.unload(native[0], model)
        model = await host.load(native[0])  # a reload: neither measured nor warmed up
        assert loader.loads[2:] == [("a", False, False)]
        other = await host.load(native[1])  # the adapter's libraries are in place
        assert loader.loads[3:] == [("b", True, True)]
        for spec, loaded in ((native[0], model), (native[1], other)):
            await host.unload(spec, loaded)
    finally:
        host.shutdown()
        executor.shutdown()
    # A runtime whose bytes are its tensors is not primed.
    executor = CountingExecutor()
    loader = RecordingLoader(executor)
    host = EngineHost(CpuDevice(), executor, ActivationBook(), loaders={"fake": loader})
    try:
        await host.unload(torch, await host.load(torch))
        assert loader.loads == [("t", True, True)]
    finally:
        host.shutdown()
        executor.shutdown()


async def test_the_host_tier_gets_a_quarter_of_the_ram_unless_the_config_says() -> None:
    import psutil

    from tessera.engine import Engine, EngineConfig
    from tessera.repository import ModelRepository

    ram = psutil.virtual_memory().total
    for given, budget in ((None, int(ram * 0.25)), (0, 0), (5000, 5000)):
        config = EngineConfig(
            device="cpu", memory_budget_bytes=1 << 20, num_threads=1, adapters=FAKE_ADAPTERS
        )
        config = dataclasses.replace(config, host_memory_budget_bytes=given)
        engine = Engine(ModelRepository([make_spec("a")]), config)
        try:
            assert engine.snapshot().host_budget_bytes == budget
        finally:
            await engine.close()


async def test_a_card_may_give_its_runtime_all_of_the_servers_threads() -> None:
    executor = ComputeExecutor(CpuDevice(), num_threads=4, num_workers=2)
    threads: dict[str, int] = {}

    class ThreadsLoader(FakeLoader):
        def load(self, spec: Any, ctx: LoadContext) -> FakeModel:
            threads[spec.name] = ctx.threads
            return super().load(spec, ctx)

    host = EngineHost(CpuDevice(), executor, ActivationBook(), loaders={"fake": ThreadsLoader()})
    specs = [
        make_spec("share"),  # one worker's share: 4 threads / 2 workers
        dataclasses.replace(make_spec("all"), threads="all"),
        dataclasses.replace(make_spec("three"), threads=3),
        dataclasses.replace(make_spec("many"), threads=64),  # at most the budget
    ]
    try:
        for spec in specs:
            await host.unload(spec, await host.load(spec))
        assert threads == {"share": 2, "all": 4, "three": 3, "many": 4}
    finally:
        host.shutdown()
        executor.shutdown()


class GatedLoader(FakeLoader):
    """Loads of models named ``slow*`` block (in their load thread) until ``go``."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.go = threading.Event()

    def load(self, spec: Any, ctx: LoadContext) -> FakeModel:
        if spec.name.startswith("slow"):
            self.entered.release()
            self.go.wait(GUARD_S)
        return super().load(spec, ctx)


GUARD_S = 30.0  # only a broken host waits this long


async def test_a_swap_does_not_wait_behind_loads_from_files() -> None:
    executor = CountingExecutor()
    loader = GatedLoader()
    host = EngineHost(CpuDevice(), executor, ActivationBook(), loaders={"fake": loader})
    kept = make_spec("kept", 300, host_tier=True)
    slow = [make_spec(f"slow{i}", 300) for i in range(2)]
    try:
        model = await host.load(kept)
        assert await host.offload(kept, model) is not None
        loads = [asyncio.ensure_future(host.load(spec)) for spec in slow]
        for _ in slow:  # both load threads busy with a load from files
            assert await asyncio.to_thread(loader.entered.acquire, timeout=GUARD_S)
        assert await host.restore(kept) is model  # not behind them
        assert await host.offload(kept, model) is not None
        assert not any(load.done() for load in loads)
        loader.go.set()
        for spec, load in zip(slow, loads, strict=True):
            await host.unload(spec, await load)
    finally:
        loader.go.set()
        host.shutdown()
        executor.shutdown()
