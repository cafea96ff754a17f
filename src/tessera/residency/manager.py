"""The residency manager: load on demand, evict by policy, pin while running.

It orchestrates parts that each keep their own state and invariants:

- ``table.py``: the bytes held against the budget; ``used_bytes`` never
  exceeds it (a load holds its expected bytes, then the measured ones; a
  batch holds its activation bytes while it runs).
- ``catalogue.py``: every model that may be asked for, and its measured
  (else estimated) weights; whether they all fit.
- ``room.py``: the activation room a batch may reserve, and what never fits.
- ``line.py``, ``wakeup.py``, ``arbiter.py``: the waiting line for room,
  who wakes when, who takes the bytes that free up; every wait bounded by
  ``wait_s`` (then ``OverloadedError``).
- ``hold.py``: a batch's room kept for its model's next batch.
- ``patience.py``: how long a caller waits for busy models cheaper to evict
  than idle ones, bounded by their batches' predicted ends.
- ``victim.py``: which idle models to evict; pinned, fresh and kept models
  never are.
- ``fresh.py``: a model loaded for a waiting batch is not evicted before
  that batch pins it.
- ``load.py``: one load or unload per model at a time, each in line for
  room; no global load lock.
- ``backoff.py``: a failed load is that model's state, retried after a
  backoff that doubles with each failure in a row.
- ``transfer.py`` and ``tier.py``: evicted models kept in host memory, so
  that a reload is a copy.

A model is kept (``keep``) while it serves as the version a rollout
replaces: the new version's load may evict others, never it. A retired model
(``retire``) is unloaded once idle and forgotten by every part. ``fill``
loads models into an idle budget (the server's start), in order of
remembered demand, then the smallest first, while each fits without an
eviction and no caller waits; under a budget too small for every model it
leaves ``FILL_SHARE`` free for batches. Such a load is speculative: not
fresh, and it never evicts to settle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from tessera.clock import Clock
from tessera.errors import TesseraError
from tessera.footprint import Footprint
from tessera.repository.spec import ModelSpec
from tessera.request import QueuedRequest
from tessera.residency.activation import ActivationBook
from tessera.residency.arbiter import RoomArbiter
from tessera.residency.backoff import LOAD_FAILED, LoadBackoff
from tessera.residency.catalogue import Catalogue
from tessera.residency.fresh import FreshModels
from tessera.residency.hold import HOLD_SLACK_S
from tessera.residency.host import ModelHost
from tessera.residency.load import ModelLoads
from tessera.residency.patience import PATIENCE_SHARE, Patience
from tessera.residency.plan import BatchPart
from tessera.residency.policy import DEFAULT_TARGET_S, EvictionPolicy
from tessera.residency.room import ActivationRoom
from tessera.residency.stats import ModelResidency, ResidencyStats, residency_stats
from tessera.residency.table import ModelEntry, ModelState, Reservation, ResidencyTable
from tessera.residency.tier import HostTier
from tessera.residency.transfer import MAX_HOST_LOADS, TierTransfers
from tessera.residency.victim import VictimChooser
from tessera.runtimes.base import LoadedModel

__all__ = [
    "FILL_SHARE",
    "HOLD_SLACK_S",
    "LOAD_FAILED",
    "MAX_HOST_LOADS",
    "PATIENCE_SHARE",
    "Lease",
    "ModelHost",
    "ModelResidency",
    "Patience",
    "ResidencyManager",
    "ResidencyStats",
]

log = logging.getLogger(__name__)

# A budget filled at start under pressure (the weights of every model do not
# fit) is filled to this share: the rest is room for the first batches, which
# would otherwise evict a model the fill had just loaded.
FILL_SHARE = 0.9


def _target_s(spec: ModelSpec) -> float | None:
    """``spec``'s latency target in seconds (None: its card gives none)."""
    return spec.latency_target_ms / 1000 if spec.latency_target_ms is not None else None


@dataclass(frozen=True, slots=True)
class Lease:
    """A pinned, ready model and the activation bytes reserved for one batch."""

    model: LoadedModel
    reservation: Reservation
    passed: bool = False  # taken ahead of older waiters (``line.py``)


class ResidencyManager:
    def __init__(
        self,
        budget_bytes: int,
        host: ModelHost,
        policy: EvictionPolicy,
        clock: Clock,
        *,
        wait_s: float = 30.0,
        failed_retry_s: float = 2.0,
        failed_retry_max_s: float = 300.0,
        activations: ActivationBook | None = None,
        host_budget_bytes: int = 0,
        max_host_loads: int = 0,
        patience_share: float = PATIENCE_SHARE,
    ) -> None:
        """``host_budget_bytes``: the host tier's budget (0: no host tier);
        ``max_host_loads``: loads from it in flight at once (0: no bound;
        ``MAX_HOST_LOADS`` where its copies back run one at a time);
        ``patience_share``: the share of a caller's latency target it waits
        for busy models cheaper to evict than idle ones (0: never waits)."""
        self.table = ResidencyTable(budget_bytes)
        self.host_tier = HostTier(host_budget_bytes, policy, clock) if host_budget_bytes else None
        self.activations = activations if activations is not None else ActivationBook()
        self._clock = clock
        self._wait_s = wait_s
        self._patience_share = patience_share
        self._catalogue = Catalogue(host.estimate)
        self._room = ActivationRoom(budget_bytes, self._catalogue, self.activations)
        self._fresh = FreshModels(clock)
        self._backoff = LoadBackoff(clock, failed_retry_s, failed_retry_max_s)
        self._transfers = TierTransfers(
            self.host_tier, host, max_host_loads, on_load_end=lambda: self._arbiter.notify()
        )
        self._arbiter = RoomArbiter(
            self.table, self._catalogue, self._fresh, self._transfers, clock
        )
        self._victims = VictimChooser(
            self.table, policy, clock, self._fresh, self._arbiter.batch_ends
        )
        self._loads = ModelLoads(
            self.table,
            host,
            clock,
            catalogue=self._catalogue,
            room=self._room,
            arbiter=self._arbiter,
            victims=self._victims,
            fresh=self._fresh,
            backoff=self._backoff,
            transfers=self._transfers,
        )

    @property
    def peak_used_bytes(self) -> int:
        """The most bytes the table held at any change."""
        return self._arbiter.peak_used_bytes

    # -- batches ------------------------------------------------------------

    @asynccontextmanager
    async def lease(
        self,
        spec: ModelSpec,
        activation_bytes: int = 0,
        next_batch_s: Callable[[], float | None] | None = None,
        expected_s: float | None = None,
    ) -> AsyncIterator[Lease]:
        """Hold ``spec``'s model ready and pinned, with room for one batch
        predicted to run ``expected_s``; ``next_batch_s``, read at the end:
        the predicted seconds of its next batch, None if none is queued (see
        ``release``)."""
        lease = await self.acquire(spec, activation_bytes, expected_s)
        try:
            yield lease
        finally:
            self.release(lease, next_batch_s=next_batch_s() if next_batch_s else None)

    async def acquire(
        self, spec: ModelSpec, activation_bytes: int = 0, expected_s: float | None = None
    ) -> Lease:
        """Pin ``spec``'s model with room for one batch of ``activation_bytes``,
        predicted to run ``expected_s`` (what callers short of room read to
        bound their patience; None: not known)."""
        now = self._clock.now()
        deadline = now + self._wait_s
        patience = Patience(now + (_target_s(spec) or DEFAULT_TARGET_S) * self._patience_share)
        place = object()  # this caller's place in line, once it waits for room
        try:
            while True:
                entry = self.table.entry(spec.key, spec.max_bytes, _target_s(spec))
                if entry.state is ModelState.READY:
                    lease = await self._reserve(
                        spec, entry, activation_bytes, deadline, place, patience
                    )
                    if lease is not None:
                        if expected_s is not None:
                            self._arbiter.batch_ends.start(spec.key, expected_s)
                        return lease
                elif entry.state in (ModelState.LOADING, ModelState.UNLOADING):
                    await asyncio.shield(self._loads.in_flight(spec.key))
                else:
                    self.raise_if_failed(spec.key)
                    # A batch that waited in line and found its model evicted
                    # hands its place to the reload: behind its own place, the
                    # load would wait for itself.
                    ticket = self._arbiter.leave_line(place)
                    await self._loads.load_in_turn(
                        spec, deadline, activation_bytes, ticket, patience
                    )
        finally:
            self._arbiter.leave_line(place)

    async def _reserve(
        self,
        spec: ModelSpec,
        entry: ModelEntry,
        activation_bytes: int,
        deadline: float,
        place: object,
        patience: Patience,
    ) -> Lease | None:
        """Pin the model with room for one batch, or wait (or evict) and return None.

        Invariants: a room kept for this model's next batch is taken first.
        While every model fits, a batch takes bytes in its turn, or passes
        older waiters where that delays none (``arbiter.py``); a model's
        first batch after a load for waiting callers is in turn (the model
        is fresh), or the line could let its protection end and evict it
        unused. Under pressure a batch takes room when it finds some (a line
        of batches behind evicting loads would stall every model). Short of
        room, it evicts only what evictions alone can free.
        """
        self._room.check_fits(spec, entry.footprint, activation_bytes)
        arbiter, line = self._arbiter, self._arbiter.line
        if arbiter.give_back_held(spec.key):
            reservation = self.table.reserve(spec.key, activation_bytes, self._clock.now())
            if reservation is not None:
                return Lease(self._loads.model(spec.key), reservation)
            arbiter.notify()
        lined = arbiter.every_model_fits()
        in_turn = activation_bytes == 0 or not lined or arbiter.in_turn(place, spec.key)
        passing = not in_turn and arbiter.may_pass(place, activation_bytes)
        if in_turn or passing:
            reservation = self.table.reserve(spec.key, activation_bytes, self._clock.now())
            if reservation is not None:
                self._fresh.discard(spec.key)
                if passing:
                    line.passed_bytes += activation_bytes
                arbiter.notify()
                return Lease(self._loads.model(spec.key), reservation, passing)
        if lined:
            line.join(place, activation_bytes, patience)
            if not arbiter.in_turn(place, spec.key):
                await arbiter.wait_for_change(deadline, spec.key)
                return None
        await self._loads.evict_or_wait(
            arbiter.bytes_only_evictions_free(activation_bytes),
            spec.key,
            deadline,
            patience,
            f"a batch of {spec.key} ({activation_bytes} bytes of activations)",
            leaving=place,
        )
        return None

    def release(self, lease: Lease, *, next_batch_s: float | None = None) -> None:
        """End a lease. Given ``next_batch_s`` (another batch of the model is
        queued, predicted to run that long) its room may be kept for that
        batch (``hold.py``)."""
        reservation = lease.reservation
        if lease.passed:
            self._arbiter.line.passed_bytes -= reservation.num_bytes
        elif next_batch_s is not None:
            spec = self._loads.spec(reservation.name)
            wait_s = spec.batching.max_wait_ms / 1000 if spec is not None else 0.0
            if self._arbiter.keep_for_next_batch(reservation, next_batch_s, wait_s):
                self._arbiter.batch_ends.start(reservation.name, next_batch_s)
                return
        self._arbiter.release(reservation)
        self._arbiter.notify()

    def plan_batch(self, spec: ModelSpec, requests: list[QueuedRequest]) -> list[BatchPart]:
        """The parts a batch runs in: whole when its measured activation need
        fits ``activation_room``, else halves that each fit (``room.py``)."""
        return self._room.plan_batch(spec, requests)

    def activation_room(self, spec: ModelSpec) -> int:
        """The most activation bytes a batch of ``spec`` should reserve (``room.py``)."""
        return self._room.for_batch(spec)

    def activation_bytes_per_unit(self, name: str) -> int | None:
        """The most activation bytes per work unit measured in the window."""
        stats = self.activations.of(name)
        return stats.reserve_bytes(1.0) if stats.num_samples else None

    def observe_batch(self, name: str, peak_bytes: int, units: float) -> None:
        """A batch's measured activation peak, for later reservations."""
        self.activations.observe(name, peak_bytes, units)

    def raise_if_never_fits(self, spec: ModelSpec, units: float) -> None:
        """``RequestTooLargeError`` for a request whose own batch, of ``units``
        peak units (``plan.peak_units``), could never fit beside the model's
        measured weights (``room.py``)."""
        self._room.raise_if_never_fits(spec, units)

    # -- models -------------------------------------------------------------

    async def ensure_loaded(self, spec: ModelSpec) -> None:
        self.release(await self.acquire(spec))

    async def unload(self, name: str) -> bool:
        """Unload a model once it is idle, and drop its host-tier copy; False if
        it was not loaded on the device."""
        deadline = self._clock.now() + self._wait_s
        self._arbiter.held_room_expired(name)
        while True:
            entry = self.table.entries.get(name)
            if entry is None or entry.state in (ModelState.UNLOADED, ModelState.FAILED):
                await self._transfers.drop(name)
                return False
            if entry.state is ModelState.READY and entry.pins == 0:
                self._loads.begin_unload(name, eviction=False)
                await self._loads.unload(name)
                return True
            if entry.state is ModelState.READY:
                await self._arbiter.wait_for_change(deadline, name)
            else:
                await asyncio.shield(self._loads.in_flight(name))

    def state(self, name: str) -> ModelState:
        entry = self.table.entries.get(name)
        return entry.state if entry is not None else ModelState.UNLOADED

    def error(self, name: str) -> str | None:
        entry = self.table.entries.get(name)
        return entry.error if entry is not None else None

    def raise_if_failed(self, name: str) -> None:
        """``ModelUnavailableError`` until the failed model's retry time; the
        message names no cause (the log and ``error`` have it)."""
        if self.state(name) is ModelState.FAILED:
            self._backoff.raise_if_waiting(name)

    def register(self, specs: Iterable[ModelSpec]) -> None:
        """Every model that may be asked for (each is in ``stats()`` from now on):
        while their weights fit the budget together, batches split to fit the
        room beside them instead of evicting."""
        for spec in specs:
            self._catalogue.register(spec)
            self.table.entry(spec.key, spec.max_bytes, _target_s(spec))

    def keep(self, name: str, kept: bool = True) -> None:
        """Never evict ``name`` (while ``kept``): a version serving while its
        successor loads beside it."""
        self._victims.keep(name, kept)

    async def retire(self, name: str) -> None:
        """Unload ``name`` once idle and forget it: it leaves the catalogue,
        ``stats()`` and the budget."""
        await self.unload(name)
        self.table.entries.pop(name, None)
        self._catalogue.forget(name)
        self._loads.forget(name)
        self._backoff.succeeded(name)
        self._fresh.discard(name)
        self._victims.keep(name, False)
        self.activations.forget(name)
        self._arbiter.notify()

    async def fill(self, specs: Iterable[ModelSpec], demand: dict[str, int]) -> list[str]:
        """Load what fits of ``specs`` into the free budget, each only while no
        one waits for room and it needs no eviction: the most ``demand``-ed
        first (requests per model name remembered from before a restart), then
        the smallest, so that the most models are ready for the bytes. Failed
        and loaded models are skipped, as is a load that fails (its state,
        logged). Returns the names loaded."""
        limit = self.table.budget_bytes
        if not self.every_model_fits():
            limit = int(limit * FILL_SHARE)
        expected = self._catalogue.expected
        candidates = sorted(
            specs, key=lambda s: (-demand.get(s.name, 0), expected(s).total_bytes, s.key)
        )
        loaded: list[str] = []
        for spec in candidates:
            if self._arbiter.line:
                break  # callers wait for room: they come first
            if self.state(spec.key) is not ModelState.UNLOADED:
                continue
            footprint = expected(spec)
            extra = self.table.extra_bytes(spec.key, footprint)
            if self.table.used_bytes() + extra > limit or not self.table.begin_load(
                spec.key, footprint
            ):
                continue
            with contextlib.suppress(TesseraError):  # logged; the model's state
                now = self._clock.now()
                await self._loads.track(spec, self._loads.finish(spec, now, speculative=True))
                loaded.append(spec.key)
        return loaded

    def catalogue_bytes(self) -> int | None:
        """The weights of every registered model together (measured bytes where
        known, else estimates; a shared component once); None if none is."""
        return self._catalogue.total_bytes()

    def every_model_fits(self) -> bool:
        """Whether the weights of every registered model fit the budget at once."""
        return self._arbiter.every_model_fits()

    def measured(self, name: str) -> Footprint | None:
        return self._catalogue.measured(name)

    def stats(self) -> ResidencyStats:
        return residency_stats(
            self.table,
            self.host_tier,
            self._catalogue.measured,
            self.peak_used_bytes,
            self._clock.now(),
        )

    async def close(self) -> None:
        """Unload everything (waits for running batches, bounded); a model that
        cannot be unloaded is logged and left, so that the rest still are."""
        for name in list(self.table.entries):
            try:
                await self.unload(name)
            except TesseraError as e:
                log.warning("could not unload %s at close: %s", name, e)
