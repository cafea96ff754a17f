"""The engine host at a close: one full collection for all the models it
unloads, not one each (each took about 0.4 s with a hundred models on a GPU)."""

from __future__ import annotations

import pytest

from builders import make_spec
from harness.fake_models import FAKE_ADAPTERS
from tessera.device import CpuDevice
from tessera.engine import host as host_module
from tessera.engine.executor import ComputeExecutor
from tessera.engine.host import EngineHost
from tessera.residency import ActivationBook


async def test_a_close_collects_once_for_every_model_it_unloads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    collections: list[str] = []
    monkeypatch.setattr(host_module, "collect_all", lambda: collections.append("collect"))
    executor = ComputeExecutor(CpuDevice(), num_threads=1, num_workers=1)
    host = EngineHost(CpuDevice(), executor, ActivationBook(), adapters=FAKE_ADAPTERS)
    specs = [make_spec(name, 300) for name in ("a", "b", "c", "d")]
    try:
        models = [await host.load(spec) for spec in specs]
        await host.unload(specs[0], models[0])  # serving: the unload collects
        assert collections == ["collect"]
        host.begin_close()
        for spec, model in zip(specs[1:], models[1:], strict=True):
            await host.unload(spec, model)
        assert collections == ["collect"]  # nothing yet: the close collects once
    finally:
        host.shutdown()
        executor.shutdown()
    assert collections == ["collect", "collect"]
