"""The host tier: evicted models kept in host memory, so that a reload is a copy.

Design notes (the invariants the unit tests check):

- ``used_bytes() <= budget_bytes`` after every call, with a budget of its own
  (``host_memory_budget``: host memory, apart from the device's budget). Its
  bytes are what the runtimes report holding there (``OffloadingModel``),
  shared components once, as in the device's table: while a model goes in,
  its expected bytes (its device figure) are held, then swapped for the
  reported ones.
- A model is in the tier (``holds``) only while it is off the device: taking
  it out to load it marks it leaving at once, and its bytes are free when the
  copy is back on the device.
- Room is made by the eviction policy over the copies held and the one coming
  in, weighed as on the device but with what losing a copy costs: a load
  from files (the policy's ``load_s`` is the model's last load from files).
  Copies worth less go first; a newcomer worth less than what it would
  displace is not kept (it is unloaded) and nothing is dropped for it.
- A shared component counted for a model in the tier may still be on the
  device for another model: the tier then holds its room in advance.

Plain synchronous accounting over a ``ResidencyTable``: the manager makes the
calls to the host and says when each ends (``finish``).
"""

from __future__ import annotations

from tessera.clock import Clock
from tessera.footprint import Footprint
from tessera.residency.policy import EvictionPolicy
from tessera.residency.table import ModelEntry, ModelState, ResidencyTable


class HostTier:
    """Which evicted models wait in host memory, and how many bytes they hold."""

    def __init__(self, budget_bytes: int, policy: EvictionPolicy, clock: Clock) -> None:
        self.table = ResidencyTable(budget_bytes)
        self._policy = policy
        self._clock = clock

    @property
    def budget_bytes(self) -> int:
        return self.table.budget_bytes

    def used_bytes(self) -> int:
        return self.table.used_bytes()

    def drops_total(self) -> int:
        """Copies dropped to make room for others."""
        return sum(e.evictions for e in self.table.entries.values())

    def holds(self, name: str) -> bool:
        """Whether ``name`` waits in the tier now (not coming in, not leaving)."""
        entry = self.table.entries.get(name)
        return entry is not None and entry.state is ModelState.READY

    def make_room(self, entry: ModelEntry, footprint: Footprint) -> list[str] | None:
        """The copies to drop, in order, so that the model of ``entry`` (its
        device bookkeeping) fits with ``footprint``; None: it is not kept."""
        name = entry.name
        if not self.table.fits_alone(footprint, 0):
            return None
        need = self.table.extra_bytes(name, footprint) - self.table.free_bytes()
        if need <= 0:
            return []
        newcomer = ModelEntry(
            name,
            footprint=footprint,
            last_used=entry.last_used,
            use_weight=entry.use_weight,
            load_s=_files_load_s(entry),
        )

        def freed_by(names: list[str]) -> int:
            # Leaving the newcomer out frees all it needed.
            return need if name in names else self.table.freed_by(names)

        victims = self._policy.choose([*self.table.evictable({name}), newcomer], need, freed_by)
        if victims is None or name in victims:
            return None
        return victims

    def begin_drop(self, name: str) -> None:
        """``name``'s copy is being dropped; its bytes are held until ``finish``."""
        self.table.begin_unload(name, eviction=True)

    def begin_admit(self, name: str, expected: Footprint) -> bool:
        """Hold ``expected`` bytes for ``name`` coming in; False if they do not fit."""
        return self.table.begin_load(name, expected)

    def settle(self, name: str, held: Footprint, entry: ModelEntry) -> bool:
        """``name`` is in, holding ``held``; False (call ``finish``) if that does
        not fit. It keeps the uses of its device bookkeeping ``entry``."""
        if not self.table.settle_load(name, held):
            return False
        self.table.mark_ready(name, self._clock.now(), _files_load_s(entry))
        kept = self.table.entries[name]
        kept.use_weight, kept.last_used = entry.use_weight, entry.last_used
        return True

    def begin_take(self, name: str) -> None:
        """``name`` leaves for the device; its bytes are held until ``finish``."""
        self.table.begin_unload(name, eviction=False)

    def finish(self, name: str) -> None:
        """``name``'s drop, departure or refused admission is over: its bytes are free."""
        self.table.finish_unload(name)


def _files_load_s(entry: ModelEntry) -> float | None:
    return entry.files_load_s if entry.files_load_s is not None else entry.load_s
