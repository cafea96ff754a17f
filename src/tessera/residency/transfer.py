"""Transfers between the device and the host tier: offload, restore, drop.

Invariants:

- Changes to the tier's membership (admissions and drops) are made one at a
  time, under one lock; the copies themselves run outside it, their
  expected bytes held in the tier meanwhile. Reason: a lock around copies
  would make every eviction wait for every other one's copy.
- A model is restored only while the tier holds it; once taken it is no
  longer held, and its bytes there are free when the copy back ends.
- ``num_loads`` is the restores in flight; with ``max_loads`` (0: no bound),
  a restore begins only while fewer are in flight. Reason: on a device
  whose copies back run one at a time, loads that evicted and then queued
  for the copy would hold their room empty meanwhile.
- A model kept whose reported bytes do not fit is dropped at once, its
  expected bytes held until it is gone.
- Room for a copy is made until it fits: a copy dropped for it may take a
  shared component the newcomer counted as held, and then more must go (or
  the newcomer, where the policy finds it not worth that).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tessera.footprint import Footprint
from tessera.repository.spec import ModelSpec
from tessera.residency.host import ModelHost
from tessera.residency.table import ModelEntry
from tessera.residency.tier import HostTier
from tessera.runtimes.base import LoadedModel, offloads

log = logging.getLogger(__name__)

# Restores from the host tier in flight at once on a device whose copies back
# run one at a time (a copy stream on CUDA): one copying, the next ready behind it.
MAX_HOST_LOADS = 2


class TierTransfers:
    """Moves models into and out of ``tier`` (None: no host tier) through ``host``."""

    def __init__(
        self,
        tier: HostTier | None,
        host: ModelHost,
        max_loads: int,
        on_load_end: Callable[[], None],
    ) -> None:
        self.tier = tier
        self._host = host
        self.max_loads = max_loads
        self.num_loads = 0  # restores in flight
        self._on_load_end = on_load_end
        self._lock = asyncio.Lock()
        self._specs: dict[str, ModelSpec] = {}  # of the copies admitted

    def holds(self, name: str) -> bool:
        """Whether ``name`` waits in the tier now."""
        return self.tier is not None and self.tier.holds(name)

    def loads_full(self, name: str) -> bool:
        """Whether a load of ``name`` from the tier should wait for one in flight to end."""
        bound = self.max_loads
        return bool(bound) and self.num_loads >= bound and self.holds(name)

    async def offload(
        self, spec: ModelSpec, model: LoadedModel, entry: ModelEntry, expected: Footprint
    ) -> bool:
        """Keep an evicted model (``entry``, its device bookkeeping; ``expected``,
        its bytes) in the tier if the tier's policy finds it room, dropping less
        valuable copies first; False: not kept, unload it."""
        tier = self.tier
        if tier is None or not offloads(model):
            return False
        name = spec.key
        async with self._lock:
            # A dropped copy may take with it a shared component the newcomer
            # counted as held: room is made again until it fits or is not worth
            # it. It does not fit here, so no victims means no room: each pass
            # drops one copy at least, and the loop ends.
            while not tier.begin_admit(name, expected):
                victims = tier.make_room(entry, expected)
                if not victims:
                    log.debug("%s is not kept in the host tier: no room worth making", name)
                    return False
                for victim in victims:
                    await self._drop(victim)
            self._specs[name] = spec
        try:
            held = await self._host.offload(spec, model)
        except BaseException:
            tier.finish(name)
            raise
        if held is None:
            tier.finish(name)
            return False
        if not tier.settle(name, held, entry):
            log.info("%s holds %d host bytes, more than its room", name, held.total_bytes)
            try:  # its expected bytes stay held until it is gone
                await self._host.drop(spec)
            finally:
                tier.finish(name)
        return True

    async def drop(self, name: str) -> None:
        """Drop ``name``'s copy from the tier, if it holds one."""
        async with self._lock:
            await self._drop(name)
        self._specs.pop(name, None)

    async def _drop(self, name: str) -> None:
        tier = self.tier
        if tier is None or not tier.holds(name):
            return
        log.info("dropping %s from the host tier", name)
        tier.begin_drop(name)
        try:
            await self._host.drop(self._specs[name])
        finally:
            tier.finish(name)

    async def restore(self, spec: ModelSpec) -> LoadedModel | None:
        """``spec``'s model from the tier; None if it is not there or could not
        come back (then it loads from its files)."""
        tier = self.tier
        if tier is None or not tier.holds(spec.key):
            return None
        tier.begin_take(spec.key)
        self.num_loads += 1
        try:
            model = await self._host.restore(spec)
        finally:
            tier.finish(spec.key)
            self.num_loads -= 1
            if self.max_loads:
                self._on_load_end()  # a load waiting to begin may now
        if model is None:
            log.warning("%s did not come back from the host tier: loaded from files", spec.key)
        return model
