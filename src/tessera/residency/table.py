"""The residency table: which models hold how many bytes, in plain synchronous Python.

Invariant: ``used_bytes() <= budget_bytes`` after every successful call.
Bytes are counted once per holder: a model's own bytes and its reserved
activation bytes, plus each shared component once while any holding model
uses it. A *holding* model is one that is loading, ready or unloading (its
bytes are not free until its unload finished). Calls that would break the
invariant return ``None`` or ``False`` and change nothing; the caller evicts
or waits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class ModelState(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    FAILED = "failed"


HOLDING = frozenset({ModelState.LOADING, ModelState.READY, ModelState.UNLOADING})


@dataclass
class ModelEntry:
    """One model's residency bookkeeping."""

    name: str
    max_bytes: int | None = None
    state: ModelState = ModelState.UNLOADED
    own_bytes: int = 0
    shared: dict[str, int] = field(default_factory=dict)
    activation_bytes: int = 0
    pins: int = 0
    last_used: float = 0.0
    loads: int = 0
    evictions: int = 0
    error: str | None = None

    @property
    def weights_bytes(self) -> int:
        return self.own_bytes + sum(self.shared.values())


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

    def entry(self, name: str, max_bytes: int | None = None) -> ModelEntry:
        found = self.entries.get(name)
        if found is None:
            found = self.entries[name] = ModelEntry(name, max_bytes=max_bytes)
        return found

    # -- accounting -------------------------------------------------------

    def _held_shared(self, exclude: Iterable[str] = ()) -> dict[str, int]:
        skip = set(exclude)
        held: dict[str, int] = {}
        for e in self.entries.values():
            if e.state in HOLDING and e.name not in skip:
                held.update(e.shared)
        return held

    def used_bytes(self) -> int:
        own = sum(
            e.own_bytes + e.activation_bytes for e in self.entries.values() if e.state in HOLDING
        )
        return own + sum(self._held_shared().values())

    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes()

    def extra_bytes(self, name: str, own_bytes: int, shared: Mapping[str, int]) -> int:
        """Bytes that holding ``name`` with these figures adds beyond what is held now
        by the others (shared components already held by another model are free)."""
        others = self._held_shared(exclude=[name])
        entry = self.entries.get(name)
        current = 0
        if entry is not None and entry.state in HOLDING:
            current = entry.own_bytes + sum(v for k, v in entry.shared.items() if k not in others)
        new = own_bytes + sum(v for k, v in shared.items() if k not in others)
        return new - current

    def freed_by(self, names: Iterable[str]) -> int:
        """Bytes released if these models were unloaded now."""
        victims = set(names)
        before = self.used_bytes()
        kept_own = sum(
            e.own_bytes + e.activation_bytes
            for e in self.entries.values()
            if e.state in HOLDING and e.name not in victims
        )
        return before - kept_own - sum(self._held_shared(exclude=victims).values())

    # -- transitions ------------------------------------------------------

    def begin_load(self, name: str, own_bytes: int, shared: Mapping[str, int]) -> bool:
        """Hold the expected bytes of a load; False if they do not fit now."""
        entry = self.entry(name)
        if entry.state in HOLDING:
            raise ValueError(f"{name} is already {entry.state}")
        if self.extra_bytes(name, own_bytes, shared) > self.free_bytes():
            return False
        entry.state = ModelState.LOADING
        entry.own_bytes, entry.shared = own_bytes, dict(shared)
        entry.error = None
        return True

    def settle_load(self, name: str, own_bytes: int, shared: Mapping[str, int]) -> bool:
        """Replace the expected bytes with the measured ones; False if they do not fit."""
        entry = self.entries[name]
        if self.extra_bytes(name, own_bytes, shared) > self.free_bytes():
            return False
        entry.own_bytes, entry.shared = own_bytes, dict(shared)
        return True

    def mark_ready(self, name: str, now: float) -> None:
        entry = self.entries[name]
        entry.state = ModelState.READY
        entry.loads += 1
        entry.last_used = now

    def fail(self, name: str, error: str) -> None:
        entry = self.entries[name]
        entry.state = ModelState.FAILED
        entry.own_bytes, entry.shared, entry.activation_bytes = 0, {}, 0
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
        entry.own_bytes, entry.shared, entry.activation_bytes = 0, {}, 0

    def reserve(self, name: str, num_bytes: int, now: float) -> Reservation | None:
        """Pin a ready model and reserve a batch's activation bytes; None if no room."""
        entry = self.entries[name]
        if entry.state is not ModelState.READY:
            raise ValueError(f"{name} is not ready: {entry.state}")
        if num_bytes > self.free_bytes():
            return None
        entry.pins += 1
        entry.activation_bytes += num_bytes
        entry.last_used = now
        return Reservation(name, num_bytes)

    def release(self, reservation: Reservation, now: float) -> None:
        entry = self.entries[reservation.name]
        entry.pins -= 1
        entry.activation_bytes -= reservation.num_bytes
        entry.last_used = now

    def evictable(self, protect: Iterable[str] = ()) -> list[ModelEntry]:
        """Ready, unpinned models other than ``protect``: candidates for eviction."""
        keep = set(protect)
        return [
            e
            for e in self.entries.values()
            if e.state is ModelState.READY and e.pins == 0 and e.name not in keep
        ]

    def fits_alone(self, own_bytes: int, shared: Mapping[str, int], activation_bytes: int) -> bool:
        return own_bytes + sum(shared.values()) + activation_bytes <= self.budget_bytes
