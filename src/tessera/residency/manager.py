"""The residency manager: load on demand, evict by policy, pin while running.

Design notes (the invariants the unit tests check):

- The table's ``used_bytes`` never exceeds the budget: a load first holds its
  expected bytes (the last measurement of that model, else the loader's
  estimate from its files), then swaps them for the measured bytes; a batch
  holds its activation bytes while it runs.
- One load per model at a time: later callers await the same load.
- Pinned models (a batch is running on them) are never evicted.
- Room is made by evicting idle models chosen by the policy; when that is not
  enough (the others are pinned) the caller waits for a release, bounded by
  ``wait_s``, then gets ``OverloadedError``. A model that cannot fit even alone
  (or is over its own cap) gets ``ModelTooLargeError`` at once.
- Loads of different models run concurrently: there is no global load lock.
  Decisions are made between awaits, so the event loop makes them atomic.
- A model is kept (``keep``) while it serves as the version a rollout
  replaces: the new version's load may evict others, never it. A retired
  model (``retire``) is unloaded once idle and forgotten: its bytes, its
  measurement and its place in the catalogue.
- A failed load is that model's state (``failed``, its cause in ``error`` and
  the log), not the server's: callers get ``ModelUnavailableError`` with a
  Retry-After and no cause (it may name the server's files) until the retry
  time, which doubles with each failure in a row (``failed_retry_s`` up to
  ``failed_retry_max_s``) and resets when a load succeeds. A load cancelled
  midway (the server stopping during preload) leaves the model unloaded.
- With a host tier (``host_budget_bytes``, see ``tier.py``), a model evicted
  to make room on the device is offered to it: kept (its weights moved to
  host memory by the host) when the tier's policy finds it room, else
  unloaded. Its next load is taken from the tier (a copy) and, should that
  fail, from its files. Changes to the tier are made one at a time (a lock
  around admissions and drops, never around loads). Unloading by hand,
  retiring and closing drop a model's copy too.
- ``fill`` loads models into an idle budget (the server's start), in order of
  remembered demand, then the smallest first, while each fits without an
  eviction; under a budget too small for every model it leaves a share free
  for batches (``FILL_SHARE``). Such a load is speculative: it is not
  protected as fresh, and it never evicts to settle.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

from tessera.clock import Cancellable, Clock
from tessera.errors import (
    ModelTooLargeError,
    ModelUnavailableError,
    OverloadedError,
    RequestTooLargeError,
    TesseraError,
)
from tessera.footprint import Footprint
from tessera.repository.spec import ModelSpec
from tessera.request import QueuedRequest
from tessera.residency.activation import ActivationBook
from tessera.residency.plan import BatchPart, split_to_fit
from tessera.residency.policy import (
    DEFAULT_TARGET_S,
    EvictionPolicy,
    eviction_score,
    expected_cost,
    take,
)
from tessera.residency.table import (
    ModelEntry,
    ModelState,
    Reservation,
    ResidencyTable,
)
from tessera.residency.tier import HostTier
from tessera.runtimes.base import LoadedModel, offloads

log = logging.getLogger(__name__)

NO_ESTIMATE = Footprint(0)

# What callers are told of a failed load: its cause may name the server's files.
LOAD_FAILED = "its load failed (the cause is in the server log)"

# How long a model loaded for a waiting batch is kept from eviction before that
# batch has pinned it.
FRESH_PROTECTION_S = 5.0
# The share of its latency target a caller short of room waits for busy models
# that cost less to evict before it evicts idle ones (``_room_for``).
PATIENCE_SHARE = 0.5
# A budget filled at start under pressure (the weights of every model do not
# fit) is filled to this share: the rest is room for the first batches, which
# would otherwise evict a model the fill had just loaded.
FILL_SHARE = 0.9
# How long a batch's room is kept for its model's next batch beyond that
# model's gathering wait (``release`` with ``next_batch_s``): the next batch forms as
# soon as the last one's callers are answered, within milliseconds.
HOLD_SLACK_S = 0.05
# Under pressure, the line's head evicts for itself and for up to this many
# loads next in line (``_ahead_bytes``): each eviction waits for a copy and a
# thread's answer while the line waits behind it.
EVICT_AHEAD = 3
# Loads from the host tier in flight at once on a device whose copies back
# run one at a time (a copy stream a way on CUDA; ``max_host_loads``): the
# line's head makes its own room meanwhile, but a load holds its room from its
# evictions until its copy ends, and with evictions that copy nothing
# (``hostcopy.PinnedPool``) a dozen loads had evicted, begun and then queued
# for the copies, the device's room held empty for them, and under Zipf(1.1)
# each request met 0.34 swaps instead of 0.14 (fake copies of the H200's
# times). Two: one copying, the next ready behind it.
MAX_HOST_LOADS = 2
# Models that will be idle soon, or are: running a batch, loading, or ready.
_SOON = frozenset({ModelState.READY, ModelState.LOADING})
# The same for a load: not one loading. A load that waited for another to
# load, run and go idle, to evict it, held the line of loads for a whole swap
# (with a hundred models swapping, copies out and back never overlapped); a
# batch still waits for one (mixed-zipf's OCR pages: without, 40 evictions a
# run instead of 28 and fewer pages within target).
_SOON_FOR_A_LOAD = frozenset({ModelState.READY})


def _wake(waiters: set[asyncio.Future[None]]) -> set[asyncio.Future[None]]:
    """Wake every one of ``waiters``; a new, empty set for the next ones."""
    for woken in waiters:
        if not woken.done():
            woken.set_result(None)
    return set()


def _target_s(spec: ModelSpec) -> float | None:
    """``spec``'s latency target in seconds (None: its card gives none)."""
    return spec.latency_target_ms / 1000 if spec.latency_target_ms is not None else None


class ModelHost(Protocol):
    """What residency needs from the engine: estimates, and loads/unloads off the loop."""

    def estimate(self, spec: ModelSpec) -> Footprint: ...

    async def load(self, spec: ModelSpec) -> LoadedModel: ...

    async def unload(self, spec: ModelSpec, model: LoadedModel, *, eviction: bool = False) -> None:
        """Free what ``model`` holds (``eviction``: to make room; a host may then
        keep it in a state cheaper to reload, outside the budget)."""
        ...

    async def offload(self, spec: ModelSpec, model: LoadedModel) -> Footprint | None:
        """Move an evicted model into the host tier and return the host bytes it
        holds there; None where it cannot go (nothing moved: unload it)."""
        ...

    async def restore(self, spec: ModelSpec) -> LoadedModel | None:
        """The model kept in the host tier, back on the device; None if it could
        not come back (the host ended it: load it from its files)."""
        ...

    async def drop(self, spec: ModelSpec) -> None:
        """End the model kept in the host tier."""
        ...


@dataclass(frozen=True, slots=True)
class ModelResidency:
    """One model's residency. ``bytes`` is its share of the budget in use: its
    own bytes and reserved activations plus an equal part of each shared
    component among the resident models that use it (so the models' ``bytes``
    add up to ``used_bytes``, but for rounding); ``weights_bytes`` counts its
    shared components whole."""

    name: str
    state: str
    bytes: int
    weights_bytes: int
    last_used: float
    loads: int
    evictions: int
    pins: int
    error: str | None
    measured_by: str | None  # how the runtime measured its bytes
    load_s: float | None  # how long its last load took
    miss_s: float | None  # how long its callers waited for it when not resident (table.ModelEntry)
    uses: float  # decayed count of its uses (see table.USE_HALF_LIFE_S)
    eviction_score: float  # the cost policy's: uses x miss s / target s / bytes; lowest first
    host_tier: bool = False  # waits in the host tier now
    host_bytes: int = 0  # what it holds there (its shared components whole)
    files_load_s: float | None = None  # its last load from files
    host_load_s: float | None = None  # its last load from the host tier
    host_loads: int = 0  # loads from the host tier


@dataclass(frozen=True, slots=True)
class ResidencyStats:
    budget_bytes: int
    used_bytes: int
    peak_used_bytes: int
    loads_total: int
    evictions_total: int
    models: tuple[ModelResidency, ...]
    host_budget_bytes: int = 0  # 0: no host tier
    host_used_bytes: int = 0
    host_loads_total: int = 0  # loads from the host tier
    host_drops_total: int = 0  # copies dropped from it to make room


class Patience:
    """Until when a caller short of room waits for busy models that cost less
    to evict than idle ones (``ResidencyManager._room_for``). Once it waits
    for some whose batches' ends are predicted, it waits no longer than
    those ends and as long again (``_bound_patience``): under Zipf at
    saturation a new cheap model kept appearing, each just loaded and busy
    with its first batch, and a caller waited its whole patience (half its
    target) for one after another."""

    __slots__ = ("until",)

    def __init__(self, until: float) -> None:
        self.until = until


@dataclass(frozen=True, slots=True)
class Lease:
    """A pinned, ready model and the activation bytes reserved for one batch."""

    model: LoadedModel
    reservation: Reservation
    passed: bool = False  # taken ahead of older waiters (``ResidencyManager._may_pass``)


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
        self._tier_lock = asyncio.Lock()
        self._max_host_loads = max_host_loads
        self._patience_share = patience_share
        self._host_loads = 0  # loads from the host tier in flight
        self.activations = activations if activations is not None else ActivationBook()
        self._host = host
        self._policy = policy
        self._clock = clock
        self._wait_s = wait_s
        self._failed_retry_s = failed_retry_s
        self._failed_retry_max_s = failed_retry_max_s
        self._models: dict[str, LoadedModel] = {}
        self._specs: dict[str, ModelSpec] = {}
        self._inflight: dict[str, asyncio.Future[None]] = {}
        self._measured: dict[str, Footprint] = {}
        # A model whose last load failed: when it may be tried again, and how
        # many loads in a row have failed (the backoff doubles with each).
        self._retry_at: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._failed_reason: dict[str, str] = {}  # what callers may be told
        # Models loaded and not yet used, with when they became ready: one is not
        # evicted for another until its first batch has pinned it (or a few
        # seconds passed). Without this a model loaded for a batch that waited
        # for activation room was evicted at once, and loaded again, and again.
        self._fresh: dict[str, float] = {}
        # Loads and batch reservations waiting for room, with a ticket in the
        # order they began to wait: they get room in that order, so that a large
        # model is not starved by small ones taking every byte that frees up,
        # and a batch is not starved by loads (nor a load by batches).
        self._waiting: dict[object, int] = {}
        self._tickets = itertools.count()
        # What each waiter in line waits for (a load: its weights and its first
        # batch; a batch: its activation bytes), and the activation bytes held
        # by batches that took room ahead of older waiters (``_may_pass``).
        self._needs: dict[object, int] = {}
        self._passed_bytes = 0
        # Every model the engine may be asked for, and the bytes of their
        # weights together (None: not computed since the last measurement).
        self._catalogue: dict[str, ModelSpec] = {}
        self._catalogue_total: int | None = None
        # Callers waiting for a change (``_wait_change``): each a future of its
        # own, all woken by ``_notify``, one by its own timer.
        self._change_waiters: set[asyncio.Future[None]] = set()
        # Loads waiting behind older waiters, by their place in line: only
        # becoming its head can let one on, so only that wakes it (waking
        # every one of them at each change was O(waiters) a load).
        self._line_waiters: dict[object, set[asyncio.Future[None]]] = {}
        self.peak_used_bytes = 0
        # Models never evicted: versions serving while their successor loads.
        self._kept: set[str] = set()
        # When each waiter in line stops waiting for others before itself
        # (its patience): until then a model with more batches queued may keep
        # its room from one batch to the next (``_hold``).
        self._patience: dict[object, Patience] = {}
        # Models running batches: the latest predicted end among them, and
        # that batch's predicted run (``_busy``).
        self._batch_ends: dict[str, tuple[float, float]] = {}
        # Batch rooms kept for their model's next batch, and their timers.
        self._held: dict[str, tuple[Reservation, Cancellable]] = {}

    # -- public -----------------------------------------------------------

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
        # Until then it waits for busy models that cost less to evict than idle
        # ones (``_room_for``): half its latency target unless configured.
        patience = Patience(now + (_target_s(spec) or DEFAULT_TARGET_S) * self._patience_share)
        waiter = object()  # this caller's place in line, once it waits for room
        try:
            while True:
                entry = self.table.entry(spec.key, spec.max_bytes, _target_s(spec))
                if entry.state is ModelState.READY:
                    lease = await self._reserve(
                        spec, entry, activation_bytes, deadline, waiter, patience
                    )
                    if lease is not None:
                        if expected_s is not None:
                            self._busy(spec.key, expected_s)
                        return lease
                elif entry.state in (ModelState.LOADING, ModelState.UNLOADING):
                    await asyncio.shield(self._inflight[spec.key])
                else:
                    self.raise_if_failed(spec.key)
                    # A batch that waited in line and found its model evicted
                    # meanwhile hands its place to the reload: behind its own
                    # place, the load would wait for itself.
                    await self._load(
                        spec, deadline, activation_bytes, self._leave_line(waiter), patience
                    )
        finally:
            self._leave_line(waiter)

    def _busy(self, name: str, run_s: float) -> None:
        """``name`` runs a batch from now, predicted to take ``run_s``: keep
        the latest predicted end of its batches running (``_bound_patience``)."""
        ends = self._clock.now() + run_s
        known = self._batch_ends.get(name)
        if known is None or known[0] < ends:
            self._batch_ends[name] = (ends, run_s)

    def release(self, lease: Lease, *, next_batch_s: float | None = None) -> None:
        """End a lease. Given ``next_batch_s`` (another batch of the model is
        queued, predicted to run that long) its room may be kept for that
        batch (``_hold``)."""
        name = lease.reservation.name
        if lease.passed:
            self._passed_bytes -= lease.reservation.num_bytes
        elif next_batch_s is not None and self._hold(lease.reservation, next_batch_s):
            self._busy(name, next_batch_s)
            return
        self._release(lease.reservation)
        self._notify()

    async def ensure_loaded(self, spec: ModelSpec) -> None:
        self.release(await self.acquire(spec, 0))

    async def unload(self, name: str) -> bool:
        """Unload a model once it is idle, and drop its host-tier copy; False if
        it was not loaded on the device."""
        deadline = self._clock.now() + self._wait_s
        self._let_go(name)
        while True:
            entry = self.table.entries.get(name)
            if entry is None or entry.state in (ModelState.UNLOADED, ModelState.FAILED):
                async with self._tier_lock:
                    await self._drop(name)
                return False
            if entry.state is ModelState.READY and entry.pins == 0:
                self._begin_unload(name, eviction=False)
                await self._unload(name)
                return True
            if entry.state is ModelState.READY:
                await self._wait_change(deadline, name)
            else:
                await asyncio.shield(self._inflight[name])

    def state(self, name: str) -> ModelState:
        entry = self.table.entries.get(name)
        return entry.state if entry is not None else ModelState.UNLOADED

    def error(self, name: str) -> str | None:
        entry = self.table.entries.get(name)
        return entry.error if entry is not None else None

    def register(self, specs: Iterable[ModelSpec]) -> None:
        """Every model that may be asked for (each is in ``stats()`` from now on):
        while their weights fit the budget together, batches split to fit the
        room beside them instead of evicting."""
        for spec in specs:
            self._catalogue[spec.key] = spec
            self.table.entry(spec.key, spec.max_bytes, _target_s(spec))  # in stats() from now on
        self._catalogue_total = None

    def keep(self, name: str, kept: bool = True) -> None:
        """Never evict ``name`` (while ``kept``): a version serving while its
        successor loads beside it."""
        if kept:
            self._kept.add(name)
        else:
            self._kept.discard(name)

    async def retire(self, name: str) -> None:
        """Unload ``name`` once idle and forget it: it leaves the catalogue,
        ``stats()`` and the budget."""
        await self.unload(name)
        self.table.entries.pop(name, None)
        self._catalogue.pop(name, None)
        self._catalogue_total = None
        self._measured.pop(name, None)
        self._specs.pop(name, None)
        self._retry_at.pop(name, None)
        self._failures.pop(name, None)
        self._failed_reason.pop(name, None)
        self._fresh.pop(name, None)
        self._kept.discard(name)
        self.activations.forget(name)
        self._notify()

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
        candidates = sorted(
            specs, key=lambda s: (-demand.get(s.name, 0), self._expected(s).total_bytes, s.key)
        )
        loaded: list[str] = []
        for spec in candidates:
            if self._waiting:
                break  # callers wait for room: they come first
            if self.state(spec.key) is not ModelState.UNLOADED:
                continue
            expected = self._expected(spec)
            extra = self.table.extra_bytes(spec.key, expected)
            if self.table.used_bytes() + extra > limit or not self.table.begin_load(
                spec.key, expected
            ):
                continue
            with contextlib.suppress(TesseraError):  # logged; the model's state
                await self._track_load(spec, self._finish_load(spec, self._clock.now(), True))
                loaded.append(spec.key)
        return loaded

    def catalogue_bytes(self) -> int | None:
        """The weights of every registered model together (measured bytes where
        known, else estimates; a shared component once); None if none is."""
        if self._catalogue_total is None:
            own, shared = 0, dict[str, int]()
            for spec in self._catalogue.values():
                footprint = self._expected(spec)
                own += footprint.own_bytes
                shared.update(footprint.shared_bytes)
            self._catalogue_total = own + sum(shared.values()) if self._catalogue else None
        return self._catalogue_total

    def every_model_fits(self) -> bool:
        """Whether the weights of every registered model fit the budget at once."""
        total = self.catalogue_bytes()
        return total is not None and total <= self.table.budget_bytes

    def activation_room(self, spec: ModelSpec) -> int:
        """The most activation bytes a batch of ``spec`` should reserve. While
        every model's weights fit, the pool beside all of them: a batch that
        fits it never needs an eviction, whichever models load meanwhile (it
        may wait for other batches' bytes). Otherwise the budget less
        ``spec``'s own weights. Within its cap."""
        return self._pool_within(self.most_activation_room(spec))

    def _pool_within(self, most: int) -> int:
        """``most`` bytes of activation room, or the pool beside every model's
        weights where those all fit and it is less."""
        total = self.catalogue_bytes()
        if total is not None and total <= self.table.budget_bytes:
            return min(self.table.budget_bytes - total, most)
        return most

    def most_activation_room(self, spec: ModelSpec) -> int:
        """The most activation bytes a batch of ``spec`` could ever have: the
        budget, and its cap, less its own weights."""
        expected = self._expected(spec)
        room = self.table.budget_bytes - expected.total_bytes
        if spec.max_bytes is not None:
            room = min(room, spec.max_bytes - expected.total_bytes)
        return room

    def plan_batch(self, spec: ModelSpec, requests: list[QueuedRequest]) -> list[BatchPart]:
        """The parts a batch runs in: whole when its measured activation need
        fits ``activation_room``, else halves that each fit (a single
        request's need cut to ``most_activation_room``)."""
        stats = self.activations.of(spec.key)
        most = self.most_activation_room(spec)
        return split_to_fit(requests, stats.reserve_bytes, self._pool_within(most), most)

    def activation_bytes_per_unit(self, name: str) -> int | None:
        """The most activation bytes per work unit measured in the window."""
        stats = self.activations.of(name)
        return stats.reserve_bytes(1.0) if stats.num_samples else None

    def observe_batch(self, name: str, peak_bytes: int, units: float) -> None:
        """A batch's measured activation peak, for later reservations."""
        self.activations.observe(name, peak_bytes, units)

    def measured(self, name: str) -> Footprint | None:
        return self._measured.get(name)

    def stats(self) -> ResidencyStats:
        now = self._clock.now()
        entries = list(self.table.entries.values())
        tier = self.host_tier
        device = self.table.shares()
        host = tier.table.shares() if tier is not None else {}
        return ResidencyStats(
            budget_bytes=self.table.budget_bytes,
            used_bytes=self.table.used_bytes(),
            peak_used_bytes=self.peak_used_bytes,
            loads_total=sum(e.loads for e in entries),
            evictions_total=sum(e.evictions for e in entries),
            host_budget_bytes=tier.budget_bytes if tier is not None else 0,
            host_used_bytes=tier.used_bytes() if tier is not None else 0,
            host_loads_total=sum(e.host_loads for e in entries),
            host_drops_total=tier.drops_total() if tier is not None else 0,
            models=tuple(
                ModelResidency(
                    name=e.name,
                    state=e.state.value,
                    bytes=device.get(e.name, 0),
                    weights_bytes=e.weights_bytes,
                    last_used=e.last_used,
                    loads=e.loads,
                    evictions=e.evictions,
                    pins=e.pins,
                    error=e.error,
                    measured_by=self._measured[e.name].method if e.name in self._measured else None,
                    load_s=e.load_s,
                    miss_s=e.miss_s,
                    uses=e.uses_at(now),
                    eviction_score=eviction_score(e, now),
                    host_tier=tier is not None and tier.holds(e.name),
                    host_bytes=host.get(e.name, 0),
                    files_load_s=e.files_load_s,
                    host_load_s=e.host_load_s,
                    host_loads=e.host_loads,
                )
                for e in entries
            ),
        )

    async def close(self) -> None:
        """Unload everything (waits for running batches, bounded); a model that
        cannot be unloaded is logged and left, so that the rest still are."""
        for name in list(self.table.entries):
            try:
                await self.unload(name)
            except TesseraError as e:
                log.warning("could not unload %s at close: %s", name, e)

    # -- internals --------------------------------------------------------

    def _notify(self) -> None:
        self.peak_used_bytes = max(self.peak_used_bytes, self.table.used_bytes())
        self._change_waiters = _wake(self._change_waiters)

    async def _wait_change(
        self, deadline: float, name: str, until: float | None = None, *, line: object = None
    ) -> None:
        """Wait for a change of the bytes or the line (with ``line``, a place in
        line: for that place to become the line's head), a fresh model's
        protection to end, ``until`` or ``deadline``; ``OverloadedError`` once
        the deadline has passed."""
        remaining = deadline - self._clock.now()
        if remaining <= 0:
            raise OverloadedError(
                f"no room in the memory budget for model {name!r}: other models are busy",
                retry_after_s=1.0,
            )
        # On timeout the caller's loop re-checks and raises once the deadline passed.
        # A fresh model's protection ending is a change no event announces: wake
        # then too, and when the caller's patience (``until``) ends. The wait is
        # a future and a timer on the injected clock (a fake one can jump it):
        # with a hundred models swapping, a task and ``wait_for`` for each
        # waiter at each change were most of the engine's time.
        now = self._clock.now()
        expiries = [since + FRESH_PROTECTION_S - now for since in self._fresh.values()]
        if until is not None:
            expiries.append(until - now)
        bound = min([remaining, *(e for e in expiries if e > 0)])
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = (
            self._change_waiters if line is None else self._line_waiters.setdefault(line, set())
        )
        waiters.add(woken)
        timer = self._clock.call_later(bound, lambda: _wake({woken}))
        try:
            await woken
        finally:
            timer.cancel()
            waiters.discard(woken)
            if not waiters and self._line_waiters.get(line) is waiters:
                del self._line_waiters[line]

    def raise_if_failed(self, name: str) -> None:
        """``ModelUnavailableError`` until the failed model's retry time; the
        message names no cause (the log and ``error`` have it)."""
        entry = self.table.entries.get(name)
        if entry is None or entry.state is not ModelState.FAILED:
            return
        wait_s = self._retry_at.get(entry.name, 0.0) - self._clock.now()
        if wait_s > 0:
            reason = self._failed_reason.get(entry.name, LOAD_FAILED)
            raise ModelUnavailableError(
                entry.name, f"{reason}; retried in {wait_s:.3g}s", retry_after_s=wait_s
            )

    def _check_fits(self, spec: ModelSpec, footprint: Footprint, activation_bytes: int) -> None:
        """``ModelTooLargeError`` (503) when the weights alone are over the
        model's cap or the budget; ``RequestTooLargeError`` (413) when they fit
        but not with the batch's ``activation_bytes`` beside them."""
        weights = footprint.total_bytes
        for limit, what in (
            (spec.max_bytes, "its cap"),
            (self.table.budget_bytes, "the whole budget"),
        ):
            if limit is None:
                continue
            if weights > limit:
                raise ModelTooLargeError(
                    spec.key, f"needs {weights} bytes, over {what} of {limit} bytes"
                )
            if weights + activation_bytes > limit:
                raise RequestTooLargeError(spec.key, activation_bytes, weights, limit, what)

    def raise_if_never_fits(self, spec: ModelSpec, units: float) -> None:
        """``RequestTooLargeError`` for a request whose own batch, of ``units``
        peak units (``plan.peak_units``), could never fit beside the model's
        measured weights: batches of no more units were measured to need more
        (``ActivationStats.proven_bytes``). An estimate refuses nothing: a
        request over it runs in the room there is, and is measured."""
        measured = self._measured.get(spec.key)
        if measured is not None:
            self._check_fits(spec, measured, self.activations.of(spec.key).proven_bytes(units))

    async def _reserve(
        self,
        spec: ModelSpec,
        entry: ModelEntry,
        activation_bytes: int,
        deadline: float,
        waiter: object,
        patience: Patience,
    ) -> Lease | None:
        """Pin the model with room for one batch, or wait (or evict) and return None.

        While every model fits, a reservation takes bytes in its turn
        (``_in_turn``): no older waiter (load or batch) is in line, or its
        model is fresh; or ahead of its turn where that delays no older
        waiter (``_may_pass``). In its turn (or always, when the models do
        not all fit) and short of room, it evicts what ``_short_of`` says only
        evictions can free, and waits for the rest: a budget that holds every
        model's weights and the batch never evicts for it. Until its
        ``patience`` ends it waits out of line instead of evicting idle models
        where busy ones would cost less to evict (``_cheaper_soon``).
        """
        self._check_fits(spec, entry.footprint, activation_bytes)
        if self._unhold(spec.key):
            reservation = self.table.reserve(spec.key, activation_bytes, self._clock.now())
            if reservation is not None:
                return Lease(self._models[spec.key], reservation)
            self._notify()
        # A model loaded for waiting batches and not used yet was loaded in its
        # turn: its first batch is in turn too (it may reserve and evict), or
        # the line would let the protection end and the model be evicted
        # before any batch ran, and loaded again (a load/evict loop).
        # Batches take a place in line only while every model fits: then loads
        # never evict and every wait ends when running batches do. Under
        # pressure a line of batches behind loads that evict stalled every
        # model (mixed-zipf: hundreds of deadlines), so there a batch takes
        # room when it finds some, as loads among themselves still wait in line.
        lined = self.every_model_fits()
        in_turn = activation_bytes == 0 or not lined or self._in_turn(waiter, spec.key)
        passing = not in_turn and self._may_pass(waiter, activation_bytes)
        if in_turn or passing:
            reservation = self.table.reserve(spec.key, activation_bytes, self._clock.now())
            if reservation is not None:
                self._fresh.pop(spec.key, None)
                if passing:
                    self._passed_bytes += activation_bytes
                self._notify()
                return Lease(self._models[spec.key], reservation, passing)
        if lined:
            self._waiting.setdefault(waiter, next(self._tickets))
            self._needs[waiter] = activation_bytes
            self._patience[waiter] = patience
        if lined and not self._in_turn(waiter, spec.key):
            await self._wait_change(deadline, spec.key)
            return None
        await self._make_way(
            self._short_of(activation_bytes),
            spec.key,
            deadline,
            patience,
            f"a batch of {spec.key} ({activation_bytes} bytes of activations)",
            leaving=waiter,
        )
        return None

    def _hold(self, reservation: Reservation, next_batch_s: float) -> bool:
        """Keep a batch's room for its model's next batch (True), predicted to
        run ``next_batch_s``, unless it holds no bytes, the model keeps one
        already, no one waits for room, or a waiter's patience would run out
        before that batch ends. A model that evicted another for its batch's room would
        otherwise hand the room to that model's reload between two batches,
        and evict it again for the next: an OCR page short of 50 MB evicted
        the chat model before each page (mixed-zipf), every reload 0.8 s of
        a two-core machine's CPU, and each page waited for the reload before
        it. Kept until the next batch reserves (``_unhold``) or the model's
        gathering wait and ``HOLD_SLACK_S`` have passed."""
        name = reservation.name
        if reservation.num_bytes <= 0 or name in self._held:
            return False
        if not self._waiting and not self._change_waiters:
            return False  # no one would take the room meanwhile
        ends = self._clock.now() + next_batch_s
        if any(patience.until < ends for patience in self._patience.values()):
            return False
        spec = self._specs.get(name)
        wait_s = spec.batching.max_wait_ms / 1000 if spec is not None else 0.0
        timer = self._clock.call_later(wait_s + HOLD_SLACK_S, lambda: self._let_go(name))
        self._held[name] = (reservation, timer)
        return True

    def _unhold(self, name: str) -> bool:
        """Give back the room kept for ``name``'s next batch; whether there was one."""
        held = self._held.pop(name, None)
        if held is None:
            return False
        reservation, timer = held
        timer.cancel()
        self._release(reservation)
        return True

    def _release(self, reservation: Reservation) -> None:
        """Give a batch's room back; the model's batch end once none runs."""
        self.table.release(reservation, self._clock.now())
        entry = self.table.entries.get(reservation.name)
        if entry is None or entry.pins == 0:
            self._batch_ends.pop(reservation.name, None)

    def _let_go(self, name: str) -> None:
        """The kept room's time is up: free it for others."""
        if self._unhold(name):
            self._notify()

    def _in_turn(self, waiter: object, name: str) -> bool:
        """Whether ``waiter``, for model ``name``, may take bytes now: no older
        waiter is in line, or ``name`` is fresh (loaded in its turn, unused)."""
        return name in self._fresh_now() or not self._behind(waiter)

    def _may_pass(self, waiter: object, need_bytes: int) -> bool:
        """Whether a batch needing ``need_bytes`` may take room ahead of the
        waiters older than ``waiter`` (backfilling, as batch schedulers do):
        with it and every batch that passed before it still running, the room
        beside the weights still holds what each older waiter waits for, so
        none of them waits longer than for the batches that ran before it.
        A load waiting for an OCR page to end need not hold up every embedding
        batch meanwhile (each a few MB and a few ms): 200 ms targets were
        missed by whole pages."""
        mine = self._waiting.get(waiter, math.inf)
        older = [self._needs.get(w, 0) for w, since in self._waiting.items() if since < mine]
        pool = self.table.budget_bytes - self.table.weight_bytes()
        return pool - self._passed_bytes - need_bytes >= max(older, default=0)

    def _leave_line(self, waiter: object) -> int | None:
        """Take ``waiter`` out of the line; its ticket, if it held one."""
        self._needs.pop(waiter, None)
        self._patience.pop(waiter, None)
        ticket = self._waiting.pop(waiter, None)
        if ticket is not None and self._waiting:
            head = min(self._waiting, key=self._waiting.__getitem__)
            _wake(self._line_waiters.pop(head, set()))
        return ticket

    async def _make_way(
        self,
        short_bytes: int,
        name: str,
        deadline: float,
        patience: Patience,
        reason: str,
        leaving: object | None = None,
        ahead_bytes: int = 0,
        load: bool = False,
    ) -> None:
        """Evict idle models to free ``short_bytes`` for ``name`` (``reason``,
        said in the log), ``ahead_bytes`` more where idle ones hold them (for
        the loads next in line, ``_ahead_bytes``), or wait for a change: until
        ``patience`` ends where busy models would free the room at a lower cost
        (``_room_for``; out of line meanwhile, where ``leaving`` is the
        caller's place), or as long as nothing needs evicting or the policy
        finds too few. ``load``: the caller loads ``name`` (``_SOON_FOR_A_LOAD``)."""
        victims, patient = self._room_for(short_bytes, name, patience, ahead_bytes, load)
        if ahead_bytes > 0:
            reason += f", and up to {ahead_bytes} bytes for the loads next in line"
        if patient:
            if leaving is not None:
                self._leave_line(leaving)  # the line is not held up while it waits for them
            await self._wait_change(deadline, name, patience.until)
        elif not await self._evict(victims, short_bytes, reason):
            await self._wait_change(deadline, name)

    def _room_for(
        self,
        short_bytes: int,
        name: str,
        patience: Patience,
        ahead_bytes: int = 0,
        load: bool = False,
    ) -> tuple[list[str] | None, bool]:
        """For a caller short of ``short_bytes`` for ``name``: the idle models
        the policy would evict (None: nothing needs evicting, or too few), to
        free ``ahead_bytes`` more where they can, and whether to wait for busy
        ones instead. A caller waits, before its ``patience`` ends, while models
        that are busy now (running a batch, fresh, or for a batch loading) would free the room
        at a lower expected cost than the idle ones the policy would take. An
        OCR page that needs a little more than the room beside every model
        waits a second for the chat model's batch to end, and evicts the chat
        model (a reload is a tenth of its target) rather than both translation
        models (a reload is their whole target). One sort for both answers:
        with a hundred models swapping, a sort to decide on patience and
        another to choose the victims were a quarter of the engine's time."""
        if short_bytes <= 0:
            return None, False
        protect = {name} | self._kept
        fresh = self._fresh_now()
        freed_by = self.table.freed_by
        entries = self.table.entries
        ordered: list[ModelEntry] | None = None  # busy and idle ones, while patient
        ready = ModelState.READY  # read once: an enum member's lookup costs a call
        if self._clock.now() < patience.until:
            states = _SOON_FOR_A_LOAD if load else _SOON
            soon = [e for e in entries.values() if e.state in states and e.name not in protect]
            ordered = self._policy.order(soon)  # the idle ones among them too: one sort for both
            idle = [e for e in ordered if e.state is ready and e.pins == 0 and e.name not in fresh]
        else:
            idle = self._policy.order(self.table.evictable(protect | fresh))
        victims = take(idle, short_bytes, freed_by)
        if not victims:
            return victims, False
        later = take(ordered, short_bytes, freed_by) if ordered is not None else None
        if later is not None and later != victims:
            now = self._clock.now()

            def cost(names: list[str]) -> float:
                return sum(expected_cost(entries[n], now) for n in names)

            if cost(later) < cost(victims):
                busy = [
                    n
                    for n in later
                    if entries[n].state is not ready or entries[n].pins or n in fresh
                ]
                if self._bound_patience(patience, busy):
                    return victims, True
        if ahead_bytes > 0:
            victims = take(idle, short_bytes + ahead_bytes, freed_by) or victims
        return victims, False

    def _bound_patience(self, patience: Patience, busy: list[str]) -> bool:
        """Whether a caller still waits for the ``busy`` models it would evict
        rather than idle ones: its ``patience`` ends no later than their
        batches' predicted ends and as long again (a batch may run twice its
        prediction), where each of them runs one (``_busy``). A model that
        loads, or waits for its first batch, gives no end: the patience stands
        until one does."""
        latest = -math.inf
        for name in busy:
            known = self._batch_ends.get(name)
            if known is None:
                return self._clock.now() < patience.until
            ends, run_s = known
            latest = max(latest, ends + run_s)
        patience.until = min(patience.until, latest)
        return self._clock.now() < patience.until

    def _short_of(self, wanted_bytes: int) -> int:
        """Bytes that only evictions can free for ``wanted_bytes``. While every
        model fits, what neither the free bytes nor the running batches'
        activation bytes (they come back when those end) would cover: a load or
        batch short of no more waits, so nothing is evicted. Otherwise, what the
        free bytes do not cover: an idle model goes at once rather than every
        batch behind this one waiting for a long batch to end."""
        short = wanted_bytes - self.table.free_bytes()
        if self.every_model_fits():
            short -= self.table.activation_bytes_held()
        return short

    def _ahead_bytes(self, waiter: object) -> int:
        """What the next ``EVICT_AHEAD`` loads in line behind ``waiter`` wait
        for. The line's head evicts for them too: evictions one load at a time
        kept the line waiting for each one's copy and its thread's answer in
        turn (docs/benchmarks.md, "Under swaps"). None while every model fits:
        the line's loads then wait for batches, not for evictions."""
        if self.every_model_fits():
            return 0
        mine = self._waiting.get(waiter, math.inf)
        behind = [
            (ticket, self._needs.get(w, 0), w[1])
            for w, ticket in self._waiting.items()
            if ticket > mine and isinstance(w, tuple) and w[0] == "load"
        ]
        ahead = heapq.nsmallest(EVICT_AHEAD, behind)
        if not self._max_host_loads:
            return sum(need for _, need, _ in ahead)
        # Loads from the host tier only as far as they could begin now
        # (``MAX_HOST_LOADS``): room made for one that must wait is room held empty.
        slots = self._max_host_loads - self._host_loads
        if isinstance(waiter, tuple) and self._in_tier(waiter[1]):
            slots -= 1
        total = 0
        for _, need, name in ahead:
            if self._in_tier(name):
                if slots <= 0:
                    break
                slots -= 1
            total += need
        return total

    def _in_tier(self, name: str) -> bool:
        return self.host_tier is not None and self.host_tier.holds(name)

    def _behind(self, waiter: object) -> bool:
        """Whether another waiter has waited for room longer than ``waiter``."""
        mine = self._waiting.get(waiter, math.inf)
        return bool(self._waiting) and min(self._waiting.values()) < mine

    def _fresh_now(self) -> set[str]:
        now = self._clock.now()
        for name, since in list(self._fresh.items()):
            if now - since >= FRESH_PROTECTION_S:
                del self._fresh[name]
        return set(self._fresh)

    async def _make_room(self, need_bytes: int, protect: set[str], reason: str) -> bool:
        """Evict idle models to free ``need_bytes`` for ``reason`` (said in the
        log); False if the policy finds too few."""
        if need_bytes <= 0:
            return True
        candidates = self.table.evictable(protect | self._fresh_now() | self._kept)
        victims = self._policy.choose(candidates, need_bytes, self.table.freed_by)
        return await self._evict(victims, need_bytes, reason)

    async def _evict(self, victims: list[str] | None, need_bytes: int, reason: str) -> bool:
        """Evict ``victims`` (chosen to free ``need_bytes`` for ``reason``, said
        in the log); False where there are none."""
        if not victims:
            return False
        log.info(
            "evicting %s to free %d bytes for %s; %d free",
            ", ".join(victims),
            need_bytes,
            reason,
            self.table.free_bytes(),
        )
        for name in victims:
            self._begin_unload(name, eviction=True)
        await asyncio.gather(*(self._unload(name, eviction=True) for name in victims))
        return True

    def _begin_unload(self, name: str, eviction: bool) -> None:
        """Mark ``name`` unloading and register the unload in the same step: a
        caller that finds it unloading waits on that (gather starts the unloads
        only after other tasks have had a turn)."""
        self.table.begin_unload(name, eviction=eviction)
        self._inflight[name] = asyncio.get_running_loop().create_future()

    async def _unload(self, name: str, eviction: bool = False) -> None:
        done = self._inflight[name]
        model = self._models.pop(name)
        spec = self._specs[name]
        try:
            if not (eviction and await self._offload(spec, model)):
                await self._host.unload(spec, model, eviction=eviction)
        finally:
            self.table.finish_unload(name)
            del self._inflight[name]
            done.set_result(None)
            self._notify()

    def _expected(self, spec: ModelSpec) -> Footprint:
        """The bytes ``spec`` holds (measured) or should hold (estimated). An
        estimate that fails (weights missing or unreadable) counts nothing:
        the model's own load then fails, as that model's state, rather than
        every reader of the catalogue, other models' batches included."""
        measured = self._measured.get(spec.key)
        if measured is not None:
            return measured
        try:
            return self._host.estimate(spec)
        except Exception as e:
            log.debug("no estimate for %s: %s: %s", spec.key, type(e).__name__, e)
            return NO_ESTIMATE

    async def _load(
        self,
        spec: ModelSpec,
        deadline: float,
        activation_bytes: int = 0,
        ticket: int | None = None,
        patience: Patience | None = None,
    ) -> None:
        """Load ``spec`` once there is room for it and for the caller's first
        batch (``activation_bytes``: a model loaded into a budget it fills has
        no room to run, and loads side by side could fill it so), waiting in
        line from ``ticket`` (a place the caller already held) or from now."""
        asked = self._clock.now()
        if patience is None:
            patience = Patience(-math.inf)
        expected = self._expected(spec)
        self._check_fits(spec, expected, activation_bytes)
        waiter = ("load", spec.key)  # callers loading one model share a place in line
        if ticket is not None:
            self._waiting.setdefault(waiter, ticket)
            self._needs[waiter] = self.table.extra_bytes(spec.key, expected) + activation_bytes
        try:
            while (
                self._behind(waiter)
                or self.table.extra_bytes(spec.key, expected) + activation_bytes
                > self.table.free_bytes()
                or self._host_loads_full(spec.key)
                or not self.table.begin_load(spec.key, expected)
            ):
                self._waiting.setdefault(waiter, next(self._tickets))
                self._patience.setdefault(waiter, patience)
                extra = self.table.extra_bytes(spec.key, expected)
                self._needs[waiter] = extra + activation_bytes
                short = self._short_of(extra + activation_bytes)
                if self._behind(waiter):
                    await self._wait_change(deadline, spec.key, line=waiter)
                else:
                    await self._make_way(
                        short,
                        spec.key,
                        deadline,
                        patience,
                        f"loading {spec.key} ({extra} bytes,"
                        f" {activation_bytes} for its first batch)",
                        ahead_bytes=self._ahead_bytes(waiter) if short > 0 else 0,
                        load=True,
                    )
                if self.state(spec.key) not in (ModelState.UNLOADED, ModelState.FAILED):
                    return  # another caller started this load meanwhile
        finally:
            self._leave_line(waiter)
        await self._track_load(spec, self._finish_load(spec, asked))

    async def _track_load(self, spec: ModelSpec, load: Coroutine[None, None, None]) -> None:
        """Run ``load`` (begun in the table) as ``spec``'s load in flight: other
        callers for the model await it."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inflight[spec.key] = done
        self._specs[spec.key] = spec
        self._notify()
        try:
            await load
        finally:
            del self._inflight[spec.key]
            done.set_result(None)
            self._notify()

    async def _finish_load(self, spec: ModelSpec, asked: float, speculative: bool = False) -> None:
        """Load ``spec`` into the bytes held for it; ``asked``: when its first
        caller began to wait for it (what a miss costs is measured from then).
        A ``speculative`` load (``fill``) evicts nothing to settle, and is not
        protected as fresh: no caller waits for it."""
        started = self._clock.now()
        try:
            model = await self._restore(spec)
            from_host = model is not None
            if model is None:
                model = await self._host.load(spec)
        except asyncio.CancelledError:
            # Stopping during preload: the model is simply not loaded (the host
            # unloads what a load thread still finishes).
            self.table.finish_unload(spec.key)
            raise
        except Exception as e:
            cause = f"{type(e).__name__}: {e}"
            retry_s = self._fail(spec.key, f"load failed: {cause}", LOAD_FAILED)
            log.error("model %s failed to load, retried in %.3g s: %s", spec.key, retry_s, cause)
            raise ModelUnavailableError(spec.key, LOAD_FAILED, retry_after_s=retry_s) from e
        # A model is measured at its first load; a reload keeps that figure (the
        # host does not measure reloads: that would hold running batches back).
        load_s = self._clock.now() - started
        measured = self._measured.get(spec.key)
        if measured is None:
            measured = self._measured[spec.key] = model.memory()
            self._catalogue_total = None
        try:
            self._check_fits(spec, measured, 0)
        except ModelTooLargeError as e:
            await self._host.unload(spec, model)
            self._fail(spec.key, e.reason, e.reason)
            raise
        while not self.table.settle_load(spec.key, measured):
            need = self.table.extra_bytes(spec.key, measured)
            reason = f"{spec.key}, measured above its estimate"
            if not speculative and await self._make_room(
                need - self.table.free_bytes(), {spec.key}, reason
            ):
                continue
            # Measured more than expected and the others are busy: give the bytes
            # back now rather than hold more than the budget; the next try
            # reserves the measured figure up front.
            await self._host.unload(spec, model)
            self.table.finish_unload(spec.key)
            raise OverloadedError(
                f"model {spec.key!r} measured {measured.total_bytes} bytes, more than expected,"
                " and there is no room now",
                retry_after_s=1.0,
            )
        self._models[spec.key] = model
        now = self._clock.now()
        self.table.mark_ready(spec.key, now, load_s, from_host=from_host, miss_s=now - asked)
        self._failures.pop(spec.key, None)
        self._retry_at.pop(spec.key, None)
        if not speculative:
            self._fresh[spec.key] = self._clock.now()

    # -- the host tier -----------------------------------------------------

    async def _offload(self, spec: ModelSpec, model: LoadedModel) -> bool:
        """Keep an evicted model in the host tier if the tier's policy finds it
        room (dropping less valuable copies first); False: not kept, unload it."""
        tier = self.host_tier
        if tier is None or not offloads(model):
            return False
        name = spec.key
        async with self._tier_lock:
            entry = self.table.entries[name]
            expected = self._measured.get(name, entry.footprint)
            victims = tier.make_room(entry, expected)
            if victims is None:
                log.debug("%s is not kept in the host tier: no room worth making", name)
                return False
            for victim in victims:
                await self._drop(victim)
            if not tier.begin_admit(name, expected):
                return False
        # The copy runs outside the lock: its expected bytes are held, and the
        # next eviction's choice sees them so (a copy takes a GPU's copy engine
        # about a millisecond for a MiniLM; under the lock, evictions were one
        # at a time for all of it).
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

    async def _drop(self, name: str) -> None:
        """Drop ``name``'s copy from the host tier, if it holds one (call under
        the tier lock)."""
        tier = self.host_tier
        if tier is None or not tier.holds(name):
            return
        log.info("dropping %s from the host tier", name)
        tier.begin_drop(name)
        try:
            await self._host.drop(self._specs[name])
        finally:
            tier.finish(name)

    def _host_loads_full(self, name: str) -> bool:
        """Whether a load of ``name`` from the host tier should wait to begin
        for one in flight to end (``max_host_loads``)."""
        bound = self._max_host_loads
        return bool(bound) and self._host_loads >= bound and self._in_tier(name)

    async def _restore(self, spec: ModelSpec) -> LoadedModel | None:
        """``spec``'s model from the host tier; None if it is not there or could
        not come back (then it loads from its files)."""
        tier = self.host_tier
        if tier is None or not tier.holds(spec.key):
            return None
        tier.begin_take(spec.key)
        self._host_loads += 1
        try:
            model = await self._host.restore(spec)
        finally:
            tier.finish(spec.key)
            self._host_loads -= 1
            if self._max_host_loads:
                self._notify()  # a load waiting to begin may now
        if model is None:
            log.warning("%s did not come back from the host tier: loaded from files", spec.key)
        return model

    def _fail(self, name: str, error: str, public_reason: str) -> float:
        """Mark ``name`` failed (``error``, the cause, for operators;
        ``public_reason`` for callers); returns the seconds until its load is
        tried again (doubling with each failure in a row, within the cap)."""
        self.table.fail(name, error)
        self._failed_reason[name] = public_reason
        failures = self._failures[name] = self._failures.get(name, 0) + 1
        retry_s = min(self._failed_retry_max_s, self._failed_retry_s * 2.0 ** (failures - 1))
        self._retry_at[name] = self._clock.now() + retry_s
        return retry_s
