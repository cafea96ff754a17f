"""The engine host measures a model at its first load only."""

from __future__ import annotations

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
