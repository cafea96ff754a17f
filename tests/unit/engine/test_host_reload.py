"""The engine host measures a model at its first load only."""

from __future__ import annotations

import dataclasses
from typing import Any

from builders import make_spec
from tessera.device import CpuDevice
from tessera.engine.executor import ComputeExecutor
from tessera.engine.host import EngineHost
from tessera.residency import ActivationBook
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
    host = EngineHost(CpuDevice(), executor, activations)
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


async def test_the_host_tier_gets_a_quarter_of_the_ram_unless_the_config_says() -> None:
    import psutil

    from tessera.engine import Engine, EngineConfig
    from tessera.repository import ModelRepository

    ram = psutil.virtual_memory().total
    for given, budget in ((None, int(ram * 0.25)), (0, 0), (5000, 5000)):
        config = EngineConfig(device="cpu", memory_budget_bytes=1 << 20, num_threads=1)
        config = dataclasses.replace(config, host_memory_budget_bytes=given)
        engine = Engine(ModelRepository([make_spec("a")]), config)
        try:
            assert engine.snapshot().host_budget_bytes == budget
        finally:
            await engine.close()
