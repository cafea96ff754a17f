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
        # Running totals (see accounting): own and activation bytes of holding
        # models; each shared component's holders, by the bytes each counts it
        # at (a component is counted once, at the largest); their sum.
        self._held_own = 0
        self._shared: dict[str, dict[int, int]] = {}
        self._shared_total = 0
        self._activation = 0  # every entry's activation bytes

    def entry(
        self, name: str, max_bytes: int | None = None, target_s: float | None = None
    ) -> ModelEntry:
        found = self.entries.get(name)
        if found is None:
            found = self.entries[name] = ModelEntry(name, max_bytes=max_bytes, target_s=target_s)
        return found

    # -- accounting -------------------------------------------------------
    # Kept as running totals, changed with each transition, so that a batch's
    # reservation costs the same with a hundred models held as with one.

    def _count(self, entry: ModelEntry, sign: int) -> None:
        """Add (``sign`` 1) or take away (-1) a holding entry's bytes from the totals."""
        if entry.state not in HOLDING:
            return
        self._held_own += sign * (entry.footprint.own_bytes + entry.activation_bytes)
        for key, num_bytes in entry.footprint.shared_bytes.items():
            holders = self._shared.setdefault(key, {})
            before = max(holders) if holders else 0
            count = holders.get(num_bytes, 0) + sign
            if count:
                holders[num_bytes] = count
            else:
                del holders[num_bytes]
            after = max(holders) if holders else 0
            if not holders:
                del self._shared[key]
            self._shared_total += after - before

    def _largest_left(self, key: str, gone: dict[int, int]) -> int:
        """The bytes component ``key`` would be counted at without ``gone``
        (holders taken away, by the bytes each counts it at); 0: none left."""
        holders = self._shared.get(key, {})
        return max((v for v, count in holders.items() if count > gone.get(v, 0)), default=0)

    def _held_by_others(self, key: str, besides: str) -> int:
        """The bytes component ``key`` is counted at for holding models other
        than ``besides`` (0: none uses it)."""
        entry = self.entries.get(besides)
        if entry is None or entry.state not in HOLDING or key not in entry.footprint.shared_bytes:
            return self._largest_left(key, {})
        return self._largest_left(key, {entry.footprint.shared_bytes[key]: 1})

    def used_bytes(self) -> int:
        return self._held_own + self._shared_total

    def shares(self) -> dict[str, int]:
        """Each held model's part of ``used_bytes``: its own bytes and
        activation room, and an equal part of each component it shares with
        other models held (so the parts sum to about the whole)."""
        held = [e for e in self.entries.values() if e.state in HOLDING]
        holders: dict[str, int] = {}
        for e in held:
            for key in e.footprint.shared_bytes:
                holders[key] = holders.get(key, 0) + 1
        return {
            e.name: e.footprint.own_bytes
            + e.activation_bytes
            + sum(num // holders[key] for key, num in e.footprint.shared_bytes.items())
            for e in held
        }

    def weight_bytes(self) -> int:
        """Bytes held by models themselves: what is used less the activation
        room running batches hold for now."""
        return self.used_bytes() - self.activation_bytes_held()

    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes()

    def extra_bytes(self, name: str, footprint: Footprint) -> int:
        """Bytes that holding ``name`` with ``footprint`` adds beyond what is held now
        by the others (shared components already held by another model are free,
        up to the size the others count them at)."""

        def unshared(f: Footprint) -> int:
            return f.own_bytes + sum(
                max(0, v - self._held_by_others(k, name)) for k, v in f.shared_bytes.items()
            )

        entry = self.entries.get(name)
        current = unshared(entry.footprint) if entry is not None and entry.state in HOLDING else 0
        return unshared(footprint) - current

    def freed_by(self, names: Iterable[str]) -> int:
        """Bytes released if these models were unloaded now."""
        freed = 0
        gone: dict[str, dict[int, int]] = {}
        for name in set(names):
            entry = self.entries.get(name)
            if entry is None or entry.state not in HOLDING:
                continue
            freed += entry.footprint.own_bytes + entry.activation_bytes
            for key, num_bytes in entry.footprint.shared_bytes.items():
                counts = gone.setdefault(key, {})
                counts[num_bytes] = counts.get(num_bytes, 0) + 1
        for key, counts in gone.items():
            freed += self._largest_left(key, {}) - self._largest_left(key, counts)
        return freed

    # -- transitions ------------------------------------------------------

    def begin_load(self, name: str, expected: Footprint) -> bool:
        """Hold the expected bytes of a load; False if they do not fit now."""
        entry = self.entry(name)
        if entry.state in HOLDING:
            raise ValueError(f"{name} is already {entry.state}")
        if self.extra_bytes(name, expected) > self.free_bytes():
            return False
        self._count(entry, -1)
        entry.state = ModelState.LOADING
        entry.footprint = expected
        entry.error = None
        self._count(entry, 1)
        return True

    def settle_load(self, name: str, measured: Footprint) -> bool:
        """Replace the expected bytes with the measured ones; False if they do not fit."""
        entry = self.entries[name]
        if self.extra_bytes(name, measured) > self.free_bytes():
            return False
        self._count(entry, -1)
        entry.footprint = measured
        self._count(entry, 1)
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
        self._count(entry, -1)
        self._activation -= entry.activation_bytes
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
        self._count(entry, -1)
        self._activation -= entry.activation_bytes
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
        self._add_activation(entry, num_bytes)
        entry.touch(now, use=True)
        return Reservation(name, num_bytes)

    def release(self, reservation: Reservation, now: float) -> None:
        entry = self.entries[reservation.name]
        entry.pins -= 1
        self._add_activation(entry, -reservation.num_bytes)
        entry.touch(now, use=False)

    def _add_activation(self, entry: ModelEntry, num_bytes: int) -> None:
        entry.activation_bytes += num_bytes
        self._activation += num_bytes
        if entry.state in HOLDING:
            self._held_own += num_bytes

    def activation_bytes_held(self) -> int:
        """Activation bytes reserved by running batches: they come back when
        those batches end."""
        return self._activation

    def evictable(self, protect: Iterable[str] = ()) -> list[ModelEntry]:
        """Ready, unpinned models other than ``protect``: candidates for eviction."""
        keep = set(protect)
        ready = ModelState.READY  # read once: an enum member's lookup costs a call
        return [
            e
            for e in self.entries.values()
            if e.state is ready and e.pins == 0 and e.name not in keep
        ]

    def fits_alone(self, footprint: Footprint, activation_bytes: int) -> bool:
        return footprint.total_bytes + activation_bytes <= self.budget_bytes
