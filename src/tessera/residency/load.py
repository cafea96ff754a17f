"""Model loads and unloads: one at a time per model, each waiting in line for room.

Invariants:

- One load or unload per model at a time (``in_flight``): later callers
  await the same one. Loads of different models run concurrently: there is
  no global load lock; decisions are made between awaits, so the event loop
  makes them atomic.
- A load first holds its expected bytes (``catalogue.py``) and the room for
  its caller's first batch, in line order (``line.py``), then swaps them for
  the measured bytes; measured above the estimate with no room to settle, it
  gives the bytes back (``OverloadedError``) rather than exceed the budget.
- A failed load is that model's state (``failed``, its cause in ``error``),
  backed off (``backoff.py``); a cancelled load leaves the model unloaded.
- An evicted model is offered to the host tier (``transfer.py``) before it is
  unloaded; a load takes it from there first, from its files otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Coroutine

from tessera.clock import Clock
from tessera.errors import ModelTooLargeError, ModelUnavailableError, OverloadedError
from tessera.repository.spec import ModelSpec
from tessera.residency.arbiter import RoomArbiter
from tessera.residency.backoff import LOAD_FAILED, LoadBackoff
from tessera.residency.catalogue import Catalogue
from tessera.residency.fresh import FreshModels
from tessera.residency.host import ModelHost
from tessera.residency.line import LoadPlace
from tessera.residency.patience import Patience
from tessera.residency.room import ActivationRoom
from tessera.residency.table import ModelState, ResidencyTable
from tessera.residency.transfer import TierTransfers
from tessera.residency.victim import VictimChooser
from tessera.runtimes.base import LoadedModel

log = logging.getLogger(__name__)


class ModelLoads:
    """Loaded models, and the loads and unloads in flight."""

    def __init__(
        self,
        table: ResidencyTable,
        host: ModelHost,
        clock: Clock,
        *,
        catalogue: Catalogue,
        room: ActivationRoom,
        arbiter: RoomArbiter,
        victims: VictimChooser,
        fresh: FreshModels,
        backoff: LoadBackoff,
        transfers: TierTransfers,
    ) -> None:
        self._table = table
        self._host = host
        self._clock = clock
        self._catalogue = catalogue
        self._room = room
        self._arbiter = arbiter
        self._victims = victims
        self._fresh = fresh
        self._backoff = backoff
        self._transfers = transfers
        self._models: dict[str, LoadedModel] = {}
        self._specs: dict[str, ModelSpec] = {}  # of every model loaded once
        self._inflight: dict[str, asyncio.Future[None]] = {}

    def model(self, name: str) -> LoadedModel:
        return self._models[name]

    def spec(self, name: str) -> ModelSpec | None:
        return self._specs.get(name)

    def in_flight(self, name: str) -> asyncio.Future[None]:
        """The load or unload of ``name`` in flight, done when it ends."""
        return self._inflight[name]

    def forget(self, name: str) -> None:
        self._specs.pop(name, None)

    async def load_in_turn(
        self,
        spec: ModelSpec,
        deadline: float,
        activation_bytes: int = 0,
        ticket: int | None = None,
        patience: Patience | None = None,
    ) -> None:
        """Load ``spec`` once there is room for it and for the caller's first
        batch (``activation_bytes``: loads side by side could otherwise fill
        the budget with models that have no room to run), waiting in line
        from ``ticket`` (a place the caller already held) or from now."""
        asked = self._clock.now()
        if patience is None:
            patience = Patience(-math.inf)
        expected = self._catalogue.expected(spec)
        self._room.check_fits(spec, expected, activation_bytes)
        table, line, arbiter = self._table, self._arbiter.line, self._arbiter
        place = LoadPlace(spec.key)  # callers loading one model share a place in line
        if ticket is not None:
            line.join(place, table.extra_bytes(spec.key, expected) + activation_bytes, None, ticket)
        try:
            while (
                line.behind(place)
                or table.extra_bytes(spec.key, expected) + activation_bytes > table.free_bytes()
                or self._transfers.loads_full(spec.key)
                or not table.begin_load(spec.key, expected)
            ):
                extra = table.extra_bytes(spec.key, expected)
                line.join(place, extra + activation_bytes, patience)
                short = arbiter.bytes_only_evictions_free(extra + activation_bytes)
                if line.behind(place):
                    await arbiter.wait_for_change(deadline, spec.key, place=place)
                else:
                    await self.evict_or_wait(
                        short,
                        spec.key,
                        deadline,
                        patience,
                        f"loading {spec.key} ({extra} bytes,"
                        f" {activation_bytes} for its first batch)",
                        ahead_bytes=arbiter.bytes_for_loads_next(place) if short > 0 else 0,
                        load=True,
                    )
                entry = table.entries.get(spec.key)
                if entry is not None and entry.state not in (
                    ModelState.UNLOADED,
                    ModelState.FAILED,
                ):
                    return  # another caller started this load meanwhile
        finally:
            arbiter.leave_line(place)
        await self.track(spec, self.finish(spec, asked))

    async def evict_or_wait(
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
        said in the log) and ``ahead_bytes`` more where idle ones hold them,
        or wait for a change: until ``patience`` ends where busy models would
        free the room at a lower cost (``victim.py``; out of line meanwhile,
        where ``leaving`` is the caller's place), or as long as nothing needs
        evicting or the policy finds too few. ``load``: the caller loads ``name``."""
        victims = self._victims.for_caller(short_bytes, name, patience, ahead_bytes, load)
        if ahead_bytes > 0:
            reason += f", and up to {ahead_bytes} bytes for the loads next in line"
        if victims.wait:
            if leaving is not None:
                self._arbiter.leave_line(leaving)  # the line is not held up meanwhile
            await self._arbiter.wait_for_change(deadline, name, patience.until)
        elif not await self.evict(victims.names, short_bytes, reason):
            await self._arbiter.wait_for_change(deadline, name)

    async def track(self, spec: ModelSpec, load: Coroutine[None, None, None]) -> None:
        """Run ``load`` (begun in the table) as ``spec``'s load in flight: other
        callers for the model await it."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inflight[spec.key] = done
        self._specs[spec.key] = spec
        self._arbiter.notify()
        try:
            await load
        finally:
            del self._inflight[spec.key]
            done.set_result(None)
            self._arbiter.notify()

    async def finish(self, spec: ModelSpec, asked: float, speculative: bool = False) -> None:
        """Load ``spec`` into the bytes held for it; ``asked``: when its first
        caller began to wait for it (what a miss costs is measured from then).
        A ``speculative`` load (``fill``) evicts nothing to settle, and is not
        protected as fresh: no caller waits for it."""
        started = self._clock.now()
        try:
            model = await self._transfers.restore(spec)
            from_host = model is not None
            if model is None:
                model = await self._host.load(spec)
        except asyncio.CancelledError:
            # Stopping during preload: the model is simply not loaded (the host
            # unloads what a load thread still finishes).
            self._table.finish_unload(spec.key)
            raise
        except Exception as e:
            cause = f"{type(e).__name__}: {e}"
            retry_s = self.fail(spec.key, f"load failed: {cause}", LOAD_FAILED)
            log.error("model %s failed to load, retried in %.3g s: %s", spec.key, retry_s, cause)
            raise ModelUnavailableError(spec.key, LOAD_FAILED, retry_after_s=retry_s) from e
        load_s = self._clock.now() - started
        measured = self._catalogue.measured(spec.key)
        if measured is None:  # measured at its first load only
            measured = self._catalogue.measure(spec.key, model.memory())
        try:
            self._room.check_fits(spec, measured, 0)
        except ModelTooLargeError as e:
            await self._host.unload(spec, model)
            self.fail(spec.key, e.reason, e.reason)
            raise
        while not self._table.settle_load(spec.key, measured):
            # settle_load failed: the measured bytes need more than is free.
            need = self._table.extra_bytes(spec.key, measured) - self._table.free_bytes()
            reason = f"{spec.key}, measured above its estimate"
            if not speculative and await self.evict(self._victims.to_settle(need), need, reason):
                continue
            # No room for the measured bytes: give them back now rather than hold
            # more than the budget; the next try reserves the measured figure.
            await self._host.unload(spec, model)
            self._table.finish_unload(spec.key)
            raise OverloadedError(
                f"model {spec.key!r} measured {measured.total_bytes} bytes, more than expected,"
                " and there is no room now",
                retry_after_s=1.0,
            )
        self._models[spec.key] = model
        now = self._clock.now()
        self._table.mark_ready(spec.key, now, load_s, from_host=from_host, miss_s=now - asked)
        self._backoff.succeeded(spec.key)
        if not speculative:
            self._fresh.add(spec.key)

    async def evict(self, victims: list[str] | None, need_bytes: int, reason: str) -> bool:
        """Evict ``victims`` (chosen to free ``need_bytes`` for ``reason``, said
        in the log); False where there are none."""
        if not victims:
            return False
        log.info(
            "evicting %s to free %d bytes for %s; %d free",
            ", ".join(victims),
            need_bytes,
            reason,
            self._table.free_bytes(),
        )
        for name in victims:
            self.begin_unload(name, eviction=True)
        await asyncio.gather(*(self.unload(name, eviction=True) for name in victims))
        return True

    def begin_unload(self, name: str, eviction: bool) -> None:
        """Mark ``name`` unloading and register the unload in the same step: a
        caller that finds it unloading waits on that (gather starts the unloads
        only after other tasks have had a turn)."""
        self._table.begin_unload(name, eviction=eviction)
        self._inflight[name] = asyncio.get_running_loop().create_future()

    async def unload(self, name: str, eviction: bool = False) -> None:
        """End the unload begun (``begin_unload``): to the host tier where an
        eviction is kept there, else freed."""
        done = self._inflight[name]
        model = self._models.pop(name)
        spec = self._specs[name]
        try:
            if not (eviction and await self._offload(spec, model)):
                await self._host.unload(spec, model, eviction=eviction)
        finally:
            self._table.finish_unload(name)
            del self._inflight[name]
            done.set_result(None)
            self._arbiter.notify()

    async def _offload(self, spec: ModelSpec, model: LoadedModel) -> bool:
        """Keep an evicted model in the host tier; False: not kept, unload it."""
        entry = self._table.entries[spec.key]
        measured = self._catalogue.measured(spec.key)
        expected = measured if measured is not None else entry.footprint
        return await self._transfers.offload(spec, model, entry, expected)

    def fail(self, name: str, error: str, public_reason: str) -> float:
        """Mark ``name`` failed (``error``, the cause, for operators;
        ``public_reason`` for callers); the seconds until its load is tried again."""
        self._table.fail(name, error)
        return self._backoff.fail(name, public_reason)
