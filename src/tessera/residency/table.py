"""The residency table: which models hold how many bytes, in plain synchronous Python.

Invariant: ``used_bytes() <= budget_bytes`` after every successful call.
Bytes are counted once per holder: a model's own bytes (its ``Footprint``) and
its reserved activation bytes, plus each shared component once while any
holding model uses it. A *holding* model is one that is loading, ready or
unloading (its bytes are not free until its unload finished). Calls that would break the
invariant return ``None`` or ``False`` and change nothing; the caller evicts
or waits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from tessera.footprint import NO_BYTES, Footprint


class ModelState(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    FAILED = "failed"


HOLDING = frozenset({ModelState.LOADING, ModelState.READY, ModelState.UNLOADING})

# A model's uses are counted with exponential decay: a use counts 1 when it
# happens and half as much this many seconds later. Kept across evictions, so
# a model that comes back is known to be popular.
USE_HALF_LIFE_S = 60.0


@dataclass
class ModelEntry:
    """One model's residency bookkeeping: ``footprint`` is the bytes its weights
    hold while it holds any (expected while loading, measured once loaded)."""

    name: str
    max_bytes: int | None = None
    target_s: float | None = None  # its requests' latency target, from its card
    state: ModelState = ModelState.UNLOADED
    footprint: Footprint = NO_BYTES
    activation_bytes: int = 0
    pins: int = 0
    last_used: float = 0.0
    loads: int = 0
    evictions: int = 0
    error: str | None = None
    use_weight: float = 0.0  # decayed count of uses, as of ``last_used``
    load_s: float | None = None  # how long its last load took
    # How long its callers waited for it when it was not resident: from the
    # first caller's arrival to ready, room-making included (the mean of the
    # last reading and the ones before, halved each time).
    miss_s: float | None = None
    files_load_s: float | None = None  # its last load from files
    host_load_s: float | None = None  # its last load from the host tier
    host_loads: int = 0  # loads from the host tier

    @property
    def weights_bytes(self) -> int:
        return self.footprint.total_bytes

    def uses_at(self, now: float) -> float:
        """The decayed count of uses at ``now`` (``now >= last_used``)."""
        decay: float = 0.5 ** (max(0.0, now - self.last_used) / USE_HALF_LIFE_S)
        return self.use_weight * decay

    def touch(self, now: float, *, use: bool) -> None:
        """Move ``last_used`` to ``now``, counting one more use if ``use``."""
        self.use_weight = self.uses_at(now) + (1.0 if use else 0.0)
        self.last_used = now


@dataclass(frozen=True, slots=True)
class Reservation:
    """Activation bytes reserved for one batch of one model."""

    name: str
    num_bytes: int


class ResidencyTable:
    """Byte accounting and room-making decisions; no I/O, no awaiting."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        self.budget_bytes = budget_bytes
        self.entries: dict[str, ModelEntry] = {}

    def entry(
        self, name: str, max_bytes: int | None = None, target_s: float | None = None
    ) -> ModelEntry:
        found = self.entries.get(name)
        if found is None:
            found = self.entries[name] = ModelEntry(name, max_bytes=max_bytes, target_s=target_s)
        return found

    # -- accounting -------------------------------------------------------

    def _held_shared(self, exclude: Iterable[str] = ()) -> dict[str, int]:
        skip = set(exclude)
        held: dict[str, int] = {}
        for e in self.entries.values():
            if e.state in HOLDING and e.name not in skip:
                held.update(e.footprint.shared_bytes)
        return held

    def used_bytes(self) -> int:
        own = sum(
            e.footprint.own_bytes + e.activation_bytes
            for e in self.entries.values()
            if e.state in HOLDING
        )
        return own + sum(self._held_shared().values())

    def weight_bytes(self) -> int:
        """Bytes held by models themselves: what is used less the activation
        room running batches hold for now."""
        return self.used_bytes() - self.activation_bytes_held()

    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes()

    def extra_bytes(self, name: str, footprint: Footprint) -> int:
        """Bytes that holding ``name`` with ``footprint`` adds beyond what is held now
        by the others (shared components already held by another model are free)."""
        others = self._held_shared(exclude=[name])

        def unshared(f: Footprint) -> int:
            return f.own_bytes + sum(v for k, v in f.shared_bytes.items() if k not in others)

        entry = self.entries.get(name)
        current = unshared(entry.footprint) if entry is not None and entry.state in HOLDING else 0
        return unshared(footprint) - current

    def freed_by(self, names: Iterable[str]) -> int:
        """Bytes released if these models were unloaded now."""
        victims = set(names)
        before = self.used_bytes()
        kept_own = sum(
            e.footprint.own_bytes + e.activation_bytes
            for e in self.entries.values()
            if e.state in HOLDING and e.name not in victims
        )
        return before - kept_own - sum(self._held_shared(exclude=victims).values())

    # -- transitions ------------------------------------------------------

    def begin_load(self, name: str, expected: Footprint) -> bool:
        """Hold the expected bytes of a load; False if they do not fit now."""
        entry = self.entry(name)
        if entry.state in HOLDING:
            raise ValueError(f"{name} is already {entry.state}")
        if self.extra_bytes(name, expected) > self.free_bytes():
            return False
        entry.state = ModelState.LOADING
        entry.footprint = expected
        entry.error = None
        return True

    def settle_load(self, name: str, measured: Footprint) -> bool:
        """Replace the expected bytes with the measured ones; False if they do not fit."""
        entry = self.entries[name]
        if self.extra_bytes(name, measured) > self.free_bytes():
            return False
        entry.footprint = measured
        return True

    def mark_ready(
        self,
        name: str,
        now: float,
        load_s: float | None = None,
        *,
        from_host: bool = False,
        miss_s: float | None = None,
    ) -> None:
        """``name`` is loaded, in ``load_s`` seconds, from its files or (``from_host``)
        from the host tier, ``miss_s`` after its first caller asked for it."""
        entry = self.entries[name]
        if miss_s is not None:
            entry.miss_s = miss_s if entry.miss_s is None else (entry.miss_s + miss_s) / 2
        entry.state = ModelState.READY
        entry.loads += 1
        entry.host_loads += from_host
        entry.touch(now, use=False)
        if load_s is not None:
            entry.load_s = load_s
            if from_host:
                entry.host_load_s = load_s
            else:
                entry.files_load_s = load_s

    def fail(self, name: str, error: str) -> None:
        entry = self.entries[name]
        entry.state = ModelState.FAILED
        entry.footprint, entry.activation_bytes = NO_BYTES, 0
        entry.error = error

    def begin_unload(self, name: str, *, eviction: bool) -> None:
        entry = self.entries[name]
        if entry.state is not ModelState.READY or entry.pins:
            raise ValueError(f"{name} cannot unload: {entry.state}, {entry.pins} pins")
        entry.state = ModelState.UNLOADING
        if eviction:
            entry.evictions += 1

    def finish_unload(self, name: str) -> None:
        entry = self.entries[name]
        entry.state = ModelState.UNLOADED
        entry.footprint, entry.activation_bytes = NO_BYTES, 0

    def reserve(self, name: str, num_bytes: int, now: float) -> Reservation | None:
        """Pin a ready model and reserve a batch's activation bytes; None if no room."""
        entry = self.entries[name]
        if entry.state is not ModelState.READY:
            raise ValueError(f"{name} is not ready: {entry.state}")
        if num_bytes > self.free_bytes():
            return None
        entry.pins += 1
        entry.activation_bytes += num_bytes
        entry.touch(now, use=True)
        return Reservation(name, num_bytes)

    def release(self, reservation: Reservation, now: float) -> None:
        entry = self.entries[reservation.name]
        entry.pins -= 1
        entry.activation_bytes -= reservation.num_bytes
        entry.touch(now, use=False)

    def activation_bytes_held(self) -> int:
        """Activation bytes reserved by running batches: they come back when
        those batches end."""
        return sum(e.activation_bytes for e in self.entries.values())

    def evictable(self, protect: Iterable[str] = ()) -> list[ModelEntry]:
        """Ready, unpinned models other than ``protect``: candidates for eviction."""
        keep = set(protect)
        return [
            e
            for e in self.entries.values()
            if e.state is ModelState.READY and e.pins == 0 and e.name not in keep
        ]

    def fits_alone(self, footprint: Footprint, activation_bytes: int) -> bool:
        return footprint.total_bytes + activation_bytes <= self.budget_bytes
