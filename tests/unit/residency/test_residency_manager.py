"""Residency policy with fake models and a fake clock.

The clock autojumps: a step that needs the others to settle sleeps a moment of
fake time, which passes only once every other task is blocked; no test waits
in real time.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import make_spec
from harness.fake_host import FakeModelHost
from tessera.clock import FakeClock
from tessera.errors import (
    ModelTooLargeError,
    ModelUnavailableError,
    OverloadedError,
    RequestTooLargeError,
)
from tessera.repository.spec import ModelSpec
from tessera.residency import (
    Lease,
    ModelState,
    ResidencyManager,
    make_eviction_policy,
)
from tessera.runtimes.base import LoadedModel

# A moment of fake time: sleeping it lets every other task run until blocked.
SETTLE_S = 0.01


def make_manager(
    budget: int, *, wait_s: float = 0.0, clock: FakeClock | None = None
) -> tuple[ResidencyManager, FakeModelHost]:
    host = FakeModelHost()
    clock = clock if clock is not None else FakeClock()
    manager = ResidencyManager(budget, host, make_eviction_policy("lru"), clock, wait_s=wait_s)
    return manager, host


async def test_loads_on_demand_and_reports_measured_bytes() -> None:
    manager, host = make_manager(1000)
    lease = await manager.acquire(make_spec("a", 300), 50)
    assert manager.table.used_bytes() == 350
    manager.release(lease)
    assert manager.table.used_bytes() == 300
    stats = manager.stats()
    assert stats.loads_total == 1
    assert [m.state for m in stats.models] == ["ready"]
    assert host.loads["a"] == 1


async def test_concurrent_requests_wait_on_one_load() -> None:
    manager, host = make_manager(1000)
    host.gates["a"] = asyncio.Event()
    spec = make_spec("a", 300)
    waiters = [asyncio.ensure_future(manager.acquire(spec, 0)) for _ in range(5)]
    await asyncio.sleep(0)
    assert manager.state("a") is ModelState.LOADING
    host.gates["a"].set()
    leases = await asyncio.gather(*waiters)
    assert host.loads["a"] == 1
    assert len({id(lease.model) for lease in leases}) == 1
    for lease in leases:
        manager.release(lease)
    assert manager.table.entries["a"].pins == 0


async def three_of_300_in_1000() -> tuple[ResidencyManager, FakeModelHost]:
    """A budget of 1000 holding a, b and c of 300 bytes, used in that order a
    second apart: a is the least recently used."""
    clock = FakeClock()
    manager, host = make_manager(1000, clock=clock)
    for name in ("a", "b", "c"):
        await manager.ensure_loaded(make_spec(name, 300))
        clock.advance(1)
    return manager, host


async def test_evicts_least_recently_used_idle_model() -> None:
    manager, host = await three_of_300_in_1000()
    await manager.ensure_loaded(make_spec("a", 300))  # a is now the most recent
    await manager.ensure_loaded(make_spec("d", 300))
    assert host.on_unload == ["b"]
    assert manager.state("b") is ModelState.UNLOADED
    assert manager.stats().evictions_total == 1
    assert manager.table.used_bytes() <= 1000


async def test_an_eviction_says_in_the_log_what_it_makes_room_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, _host = await three_of_300_in_1000()
    with caplog.at_level("INFO", logger="tessera.residency"):
        manager.release(await manager.acquire(make_spec("d", 300), 50))
    assert "evicting a to free 250 bytes for loading d (300 bytes, 50 for its first batch);" in (
        caplog.text
    )
    assert "100 free" in caplog.text


async def test_a_batch_that_evicts_two_models_names_both_and_itself_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, _host = await three_of_300_in_1000()
    with caplog.at_level("INFO", logger="tessera.residency"):
        manager.release(await manager.acquire(make_spec("c", 300), 600))
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("evicting")] == [
        "evicting a, b to free 500 bytes for a batch of c (600 bytes of activations); 100 free"
    ]


async def test_the_host_is_told_which_unloads_are_evictions() -> None:
    # A host may keep an evicted model cheaper to reload (a vLLM engine asleep).
    manager, host = make_manager(700)
    for name in ("a", "b"):
        await manager.ensure_loaded(make_spec(name, 300))
    await manager.ensure_loaded(make_spec("c", 300))
    assert await manager.unload("c")
    assert host.on_unload == ["a", "c"]
    assert host.evicted == ["a"]


async def test_a_model_being_evicted_can_be_asked_for_at_once() -> None:
    # Eviction once marked its victims unloading before registering their
    # unloads; a request for a victim in between failed with a KeyError (a 500).
    manager, host = make_manager(1000, wait_s=5.0)
    for name in ("a", "b"):
        await manager.ensure_loaded(make_spec(name, 400))
    big = asyncio.ensure_future(manager.ensure_loaded(make_spec("c", 900)))
    again = asyncio.ensure_future(manager.ensure_loaded(make_spec("a", 400)))
    await asyncio.gather(big, again)
    assert host.loads["a"] == 2
    assert sorted(host.on_unload[:2]) == ["a", "b"]
    assert manager.table.used_bytes() <= 1000


async def test_pinned_model_is_never_evicted_and_caller_gets_overloaded() -> None:
    manager, host = make_manager(1000)
    lease = await manager.acquire(make_spec("a", 600), 0)
    with pytest.raises(OverloadedError):
        await manager.acquire(make_spec("b", 600), 0)
    assert host.unloads["a"] == 0
    manager.release(lease)
    lease_b = await manager.acquire(make_spec("b", 600), 0)
    assert host.unloads["a"] == 1
    manager.release(lease_b)


async def test_waiter_proceeds_when_pinned_model_is_released() -> None:
    clock = FakeClock()
    manager, _host = make_manager(1000, wait_s=5.0, clock=clock)
    lease = await manager.acquire(make_spec("a", 600), 0)
    waiting = asyncio.ensure_future(manager.acquire(make_spec("b", 600), 0))
    await clock.sleep(SETTLE_S)
    assert not waiting.done()
    manager.release(lease)
    lease_b = await clock.wait_for(waiting, 1.0)
    assert lease_b.model is not None
    assert clock.now() == SETTLE_S  # woken by the release, not by its deadline
    manager.release(lease_b)


async def test_a_waiter_gets_overloaded_when_wait_s_passes_on_the_clock() -> None:
    clock = FakeClock()
    manager, host = make_manager(1000, wait_s=5.0, clock=clock)
    lease = await manager.acquire(make_spec("a", 600), 0)
    with pytest.raises(OverloadedError, match="busy"):
        await manager.acquire(make_spec("b", 600), 0)
    assert clock.now() == 5.0  # it waited exactly wait_s of fake time
    assert host.loads["b"] == 0
    manager.release(lease)


async def test_model_that_cannot_fit_alone_gets_clear_error() -> None:
    manager, host = make_manager(1000)
    with pytest.raises(ModelTooLargeError, match="over the whole budget"):
        await manager.acquire(make_spec("huge", 2000), 0)
    assert host.loads["huge"] == 0


async def test_per_model_cap_is_enforced_on_measured_bytes() -> None:
    manager, _host = make_manager(10_000)
    spec = make_spec("capped", 800, max_bytes=500, estimate_bytes=400)
    with pytest.raises(ModelTooLargeError, match="cap"):
        await manager.acquire(spec, 0)
    assert manager.table.used_bytes() == 0
    assert manager.state("capped") is ModelState.FAILED


async def test_activation_reservation_that_cannot_fit_alone_is_refused() -> None:
    manager, host = make_manager(1000)
    with pytest.raises(RequestTooLargeError, match="500 bytes of activations beside 600"):
        await manager.acquire(make_spec("a", 600), 500)
    assert host.loads["a"] == 0  # refused before loading


async def test_failed_load_is_that_models_only() -> None:
    manager, _host = make_manager(1000)
    with pytest.raises(ModelUnavailableError, match="load failed"):
        await manager.acquire(make_spec("bad", 100, fail_load=True), 0)
    with pytest.raises(ModelUnavailableError):
        manager.raise_if_failed("bad")
    lease = await manager.acquire(make_spec("good", 100), 0)
    manager.release(lease)
    assert manager.table.used_bytes() == 100


async def test_shared_component_counted_once_and_freed_with_last_user() -> None:
    manager, _host = make_manager(1000)
    enc = {"encoder": 400}
    await manager.ensure_loaded(make_spec("embed", 0, shared=enc))
    await manager.ensure_loaded(make_spec("rerank", 10, shared=enc))
    await manager.ensure_loaded(make_spec("intent", 50, shared=enc))
    assert manager.table.used_bytes() == 460
    await manager.unload("embed")
    await manager.unload("rerank")
    assert manager.table.used_bytes() == 450
    await manager.unload("intent")
    assert manager.table.used_bytes() == 0


async def test_measured_bytes_above_estimate_make_room() -> None:
    manager, host = make_manager(1000)
    await manager.ensure_loaded(make_spec("a", 500))
    await manager.ensure_loaded(make_spec("b", 600, estimate_bytes=100))
    assert manager.state("a") is ModelState.UNLOADED
    assert host.unloads["a"] == 1
    assert manager.table.used_bytes() == 600


# -- property: random load / run / unload sequences ------------------------

NAMES = ["m0", "m1", "m2", "m3", "m4"]
SIZES = {"m0": 100, "m1": 250, "m2": 400, "m3": 700, "m4": 1200}
SHARED = {"m0": {"enc": 200}, "m1": {"enc": 200}, "m2": {}, "m3": {}, "m4": {}}

op = st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(NAMES), st.integers(0, 300)),
    st.tuples(st.just("release"), st.integers(0, 10), st.just(0)),
    st.tuples(st.just("unload"), st.sampled_from(NAMES), st.just(0)),
)


async def _run_ops(ops: list[tuple[str, object, int]]) -> None:
    budget = 1000
    manager, host = make_manager(budget)
    specs = {n: make_spec(n, SIZES[n], shared=SHARED[n]) for n in NAMES}
    leases: list[Lease] = []
    unloaded_while_pinned: list[str] = []
    original_unload = host.unload

    async def checked_unload(spec, model, *, eviction=False):  # type: ignore[no-untyped-def]
        if manager.table.entries[spec.name].pins:
            unloaded_while_pinned.append(spec.name)
        await original_unload(spec, model, eviction=eviction)

    host.unload = checked_unload  # type: ignore[method-assign]
    for kind, arg, activation in ops:
        if kind == "acquire":
            with contextlib.suppress(OverloadedError, ModelTooLargeError):
                leases.append(await manager.acquire(specs[str(arg)], activation))
        elif kind == "release" and leases:
            manager.release(leases.pop(int(str(arg)) % len(leases)))
        elif kind == "unload" and not any(lease.reservation.name == arg for lease in leases):
            await manager.unload(str(arg))
        assert manager.table.used_bytes() <= budget
        assert manager.peak_used_bytes <= budget
    for lease in leases:
        manager.release(lease)
    assert not unloaded_while_pinned
    # No duplicate loads: every load either is resident now or was unloaded once.
    for name in NAMES:
        resident = manager.state(name) is ModelState.READY
        assert host.loads[name] == host.unloads[name] + int(resident)
    # No leaked reservations.
    assert all(e.pins == 0 and e.activation_bytes == 0 for e in manager.table.entries.values())
    assert manager.table.used_bytes() == sum(
        e.footprint.own_bytes for e in manager.table.entries.values() if e.state is ModelState.READY
    ) + (200 if any(manager.state(n) is ModelState.READY for n in ("m0", "m1")) else 0)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=40))
def test_budget_never_exceeded_under_random_sequences(ops: list[tuple[str, object, int]]) -> None:
    asyncio.run(_run_ops(ops))


async def test_models_bytes_split_shared_components_and_add_up_to_used() -> None:
    manager, _host = make_manager(10_000)
    enc = {"encoder": 900}
    await manager.ensure_loaded(make_spec("embed", 0, shared=enc))
    await manager.ensure_loaded(make_spec("rerank", 10, shared=enc))
    await manager.ensure_loaded(make_spec("intent", 50, shared=enc))
    stats = manager.stats()
    by_name = {m.name: m for m in stats.models}
    assert by_name["intent"].bytes == 50 + 300
    assert by_name["intent"].weights_bytes == 950
    assert sum(m.bytes for m in stats.models) == stats.used_bytes == 960


async def test_policy_none_never_evicts_to_make_room() -> None:
    host = FakeModelHost()
    manager = ResidencyManager(1000, host, make_eviction_policy("none"), FakeClock(), wait_s=0.0)
    await manager.ensure_loaded(make_spec("a", 600))
    with pytest.raises(OverloadedError):
        await manager.ensure_loaded(make_spec("b", 600))
    assert host.unloads["a"] == 0
    lease = await manager.acquire(make_spec("a", 600), 300)  # its own batches still fit
    manager.release(lease)


async def test_a_model_loaded_for_a_waiting_batch_is_not_evicted_before_it_runs() -> None:
    # A model loaded for a batch that still waited for activation room was once
    # evicted for another model at once, and loaded again, over and over. Now a
    # model loads only with room for its batch, and that batch runs first.
    clock = FakeClock()
    manager, host = make_manager(1000, wait_s=5.0, clock=clock)
    lease_b = await manager.acquire(make_spec("b", 400), 0)
    want_a = asyncio.ensure_future(manager.acquire(make_spec("a", 300), 400))
    await clock.sleep(SETTLE_S)
    assert manager.state("a") is ModelState.UNLOADED  # 300 + 400 do not fit beside b yet
    want_c = asyncio.ensure_future(manager.acquire(make_spec("c", 350), 0))
    await clock.sleep(SETTLE_S)
    assert not want_a.done()
    assert not want_c.done()  # behind a's load in line
    manager.release(lease_b)
    for waiter in asyncio.as_completed([want_a, want_c]):
        manager.release(await waiter)
    assert host.loads["a"] == 1
    assert "a" not in host.on_unload
    assert manager.table.used_bytes() <= 1000


async def test_loads_get_room_in_the_order_they_began_to_wait() -> None:
    # A large model waiting for room was starved by small ones taking every byte
    # that freed up.
    clock = FakeClock()
    manager, host = make_manager(1000, wait_s=5.0, clock=clock)
    lease_a = await manager.acquire(make_spec("a", 600), 0)
    large = asyncio.ensure_future(manager.ensure_loaded(make_spec("large", 700)))
    await clock.sleep(SETTLE_S)
    small = asyncio.ensure_future(manager.ensure_loaded(make_spec("small", 100)))
    await clock.sleep(SETTLE_S)
    assert not small.done()  # there is room for it, but the large load waits longer
    manager.release(lease_a)
    await asyncio.gather(large, small)
    assert list(host.loads)[-2:] == ["large", "small"]
    assert manager.table.used_bytes() <= 1000


class _Recording(FakeModelHost):
    """Loads and unloads in the order they began."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    async def load(self, spec: ModelSpec) -> LoadedModel:
        self.events.append(f"load {spec.key}")
        return await super().load(spec)

    async def unload(self, spec: ModelSpec, model: LoadedModel, *, eviction: bool = False) -> None:
        self.events.append(f"unload {spec.key}")
        await super().unload(spec, model, eviction=eviction)


async def test_the_head_of_a_line_of_loads_evicts_for_the_loads_behind_it_too(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Under pressure every load in a line evicted for itself alone, and the line
    # waited for each eviction in turn (each a copy and a thread's answer).
    clock = FakeClock()
    host = _Recording()
    manager = ResidencyManager(1000, host, make_eviction_policy("lru"), clock, wait_s=5.0)
    leases = []
    for name in ("a", "b", "c", "d"):
        leases.append(await manager.acquire(make_spec(name, 240), 0))
        clock.advance(1)
    loads = []
    for name in ("e", "f", "g", "h", "i"):  # in line while every model is busy
        loads.append(asyncio.ensure_future(manager.acquire(make_spec(name, 240), 0)))
        await clock.sleep(SETTLE_S)
    with caplog.at_level("INFO", logger="tessera.residency"):
        for lease in leases:
            manager.release(lease)
        for load in loads:
            manager.release(await load)
    evicting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evicting")]
    assert evicting[0] == (
        "evicting a, b, c, d to free 200 bytes for loading e (240 bytes, 0 for its first"
        " batch), and up to 720 bytes for the loads next in line; 40 free"
    )
    # e's eviction frees room for f, g and h too (i is a fourth behind it).
    evictions = ["unload a", "unload b", "unload c", "unload d"]
    assert host.events[4:12] == [*evictions, "load e", "load f", "load g", "load h"]
    assert host.events[-1] == "load i"
    assert manager.table.used_bytes() <= 1000


async def test_a_head_of_the_line_one_byte_short_evicts_for_the_loads_behind_it_too() -> None:
    clock = FakeClock()
    host = _Recording()
    manager = ResidencyManager(1000, host, make_eviction_policy("lru"), clock, wait_s=5.0)
    leases = []
    for name in ("a", "b", "c", "d"):
        leases.append(await manager.acquire(make_spec(name, 240), 0))
        clock.advance(1)
    loads = [asyncio.ensure_future(manager.acquire(make_spec("e", 41), 0))]  # 40 free
    await clock.sleep(SETTLE_S)
    for name in ("f", "g", "h"):
        loads.append(asyncio.ensure_future(manager.acquire(make_spec(name, 240), 0)))
        await clock.sleep(SETTLE_S)
    for lease in leases:
        manager.release(lease)
    for load in loads:
        manager.release(await load)
    evictions = ["unload a", "unload b", "unload c", "unload d"]
    assert host.events[4:12] == [*evictions, "load e", "load f", "load g", "load h"]


async def test_loads_ahead_in_line_take_no_more_than_idle_models_hold() -> None:
    # What the loads behind it want is evicted only where idle models hold it:
    # the head still evicts for itself.
    clock = FakeClock()
    host = _Recording()
    manager = ResidencyManager(1000, host, make_eviction_policy("lru"), clock, wait_s=5.0)
    busy = await manager.acquire(make_spec("a", 500), 0)
    idle = await manager.acquire(make_spec("b", 400), 0)
    waiting = [
        asyncio.ensure_future(manager.acquire(make_spec(name, 400), 0)) for name in ("c", "d")
    ]
    await clock.sleep(SETTLE_S)
    manager.release(idle)
    first = await waiting[0]
    assert host.events[2:] == ["unload b", "load c"]  # d's 400 more are not idle: a is busy
    manager.release(first)
    manager.release(busy)
    manager.release(await waiting[1])
    assert manager.table.used_bytes() <= 1000


async def test_a_line_of_loads_moves_as_each_head_leaves_it_without_timers() -> None:
    # Loads behind older waiters are woken only when they become the line's
    # head (not at every change of bytes); each must then be woken at once, in
    # its turn, not by a timer (the fake clock would jump to one: it does not move).
    clock = FakeClock()
    manager, host = make_manager(1000, wait_s=5.0, clock=clock)
    lease = await manager.acquire(make_spec("a", 900), 0)
    names = [f"m{i}" for i in range(6)]
    loads = []
    for name in names:
        loads.append(asyncio.ensure_future(manager.acquire(make_spec(name, 900), 0)))
        for _ in range(5):
            await asyncio.sleep(0)
    assert not any(load.done() for load in loads)
    assert (
        manager._arbiter.wakeups.num_places() == len(names) - 1
    )  # all but the head sleep on the line
    manager.release(lease)
    for load in loads:  # each in turn: loaded, used, released, evicted for the next
        manager.release(await load)
    assert list(host.loads) == ["a", *names]
    assert clock.now() == 0.0
    assert manager.table.used_bytes() <= 1000
