"""A fake ``ModelHost`` for tests of residency policy: fake models, counted loads,
optional gates to hold a load open, and loads that take ``options.load_s``
seconds of the given clock."""

from __future__ import annotations

import asyncio
from collections import Counter

from tessera.clock import Clock
from tessera.footprint import Footprint
from tessera.repository.spec import ModelSpec
from tessera.runtimes.base import LoadedModel
from tessera.runtimes.fake import FakeModel


class FakeModelHost:
    """Loads ``fake`` models instantly (or when their gate opens)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock
        self.loads: Counter[str] = Counter()
        self.unloads: Counter[str] = Counter()
        self.gates: dict[str, asyncio.Event] = {}
        self.on_unload: list[str] = []
        self.evicted: list[str] = []  # unloads made to make room (eviction=True)

    def estimate(self, spec: ModelSpec) -> Footprint:
        own = int(spec.options.get("estimate_bytes", spec.options.get("own_bytes", 0)))
        return Footprint(own, dict(spec.options.get("shared", {})))

    async def load(self, spec: ModelSpec) -> LoadedModel:
        self.loads[spec.key] += 1
        gate = self.gates.get(spec.key)
        if gate is not None:
            await gate.wait()
        load_s = float(spec.options.get("load_s", 0.0))
        if load_s and self._clock is not None:
            await self._clock.sleep(load_s)
        if spec.options.get("fail_load"):
            raise RuntimeError("fake load failure")
        return FakeModel(spec)

    async def unload(self, spec: ModelSpec, model: LoadedModel, *, eviction: bool = False) -> None:
        self.unloads[spec.key] += 1
        self.on_unload.append(spec.key)
        if eviction:
            self.evicted.append(spec.key)
        model.unload()
        await asyncio.sleep(0)
