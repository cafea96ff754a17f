"""A fake ``ModelHost`` for tests of residency policy: fake models, counted loads,
optional gates to hold a load open, and loads that take ``options.load_s``
seconds of the given clock. A model whose options say ``host_tier`` can wait in
the host tier (``harness.fake_models``); coming back takes ``options.restore_s``
seconds of the clock."""

from __future__ import annotations

import asyncio
from collections import Counter

from harness.fake_models import make_fake_model
from tessera.clock import Clock
from tessera.footprint import Footprint
from tessera.repository.spec import ModelSpec
from tessera.runtimes.base import LoadedModel, offloads


class FakeModelHost:
    """Loads ``fake`` models instantly (or when their gate opens)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock
        self.loads: Counter[str] = Counter()
        self.unloads: Counter[str] = Counter()
        self.gates: dict[str, asyncio.Event] = {}
        self.on_unload: list[str] = []
        self.evicted: list[str] = []  # unloads made to make room (eviction=True)
        self.offloads: Counter[str] = Counter()
        self.restores: Counter[str] = Counter()  # successful ones
        self.drops: Counter[str] = Counter()
        self.kept: dict[str, LoadedModel] = {}  # models in the host tier

    def estimate(self, spec: ModelSpec) -> Footprint:
        own = int(spec.options.get("estimate_bytes", spec.options.get("own_bytes", 0)))
        return Footprint(own, dict(spec.options.get("shared", {})))

    async def load(self, spec: ModelSpec) -> LoadedModel:
        self.loads[spec.key] += 1
        gate = self.gates.get(spec.key)
        if gate is not None:
            await gate.wait()
        await self._take(float(spec.options.get("load_s", 0.0)))
        if spec.options.get("fail_load"):
            raise RuntimeError("fake load failure")
        return make_fake_model(spec)

    async def unload(self, spec: ModelSpec, model: LoadedModel, *, eviction: bool = False) -> None:
        self.unloads[spec.key] += 1
        self.on_unload.append(spec.key)
        if eviction:
            self.evicted.append(spec.key)
        model.unload()
        await asyncio.sleep(0)

    async def offload(self, spec: ModelSpec, model: LoadedModel) -> Footprint | None:
        await asyncio.sleep(0)
        if not offloads(model):
            return None
        held = model.offload()
        if held is not None:
            self.offloads[spec.key] += 1
            self.kept[spec.key] = model
        return held

    async def restore(self, spec: ModelSpec) -> LoadedModel | None:
        model = self.kept.pop(spec.key)
        await self._take(float(spec.options.get("restore_s", 0.0)))
        assert offloads(model)  # only those are kept
        try:
            model.restore()
        except RuntimeError:  # option fail_restore
            model.unload()
            return None
        self.restores[spec.key] += 1
        return model

    async def drop(self, spec: ModelSpec) -> None:
        self.drops[spec.key] += 1
        self.kept.pop(spec.key).unload()
        await asyncio.sleep(0)

    async def _take(self, seconds: float) -> None:
        if seconds and self._clock is not None:
            await self._clock.sleep(seconds)
