"""Residency under sharing: eviction by expected cost,
an elastic room for batches that never evicts while every model fits, and one
line for loads and batch reservations. Fake models, a fake clock that autojumps.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import make_spec
from harness.fake_host import FakeModelHost
from tessera.clock import FakeClock
from tessera.errors import OverloadedError
from tessera.repository import ModelSpec
from tessera.request import QueuedRequest, RequestResult
from tessera.residency import (
    PATIENCE_SHARE,
    ModelState,
    ResidencyManager,
    make_eviction_policy,
)

SETTLE_S = 0.01


def make_manager(
    budget: int,
    *,
    policy: str = "cost",
    wait_s: float = 60.0,
    patience_share: float = PATIENCE_SHARE,
) -> tuple[ResidencyManager, FakeModelHost, FakeClock]:
    clock = FakeClock()
    host = FakeModelHost(clock)
    chosen = make_eviction_policy(policy, clock)
    manager = ResidencyManager(
        budget, host, chosen, clock, wait_s=wait_s, patience_share=patience_share
    )
    return manager, host, clock


async def use(manager: ResidencyManager, spec: ModelSpec, times: int = 1) -> None:
    for _ in range(times):
        manager.release(await manager.acquire(spec, 0))


def queued(units: list[float]) -> list[QueuedRequest]:
    loop = asyncio.get_running_loop()
    made = []
    for i, u in enumerate(units):
        future: asyncio.Future[RequestResult] = loop.create_future()
        made.append(QueuedRequest([f"item{i}"], u, 0.0, future))
    return made


# -- eviction by expected cost ------------------------------------------------


async def test_a_rarely_used_model_goes_before_a_hot_one_used_less_recently() -> None:
    manager, host, clock = make_manager(1000)
    hot, rare = make_spec("hot", 400), make_spec("rare", 400)
    await use(manager, hot, times=20)
    clock.advance(5)
    await use(manager, rare)  # the most recent use, but the only one
    clock.advance(5)
    await use(manager, make_spec("new", 400))
    assert host.on_unload == ["rare"]  # LRU would have evicted "hot"


async def test_lru_evicts_the_hot_model_in_the_same_case() -> None:
    manager, host, clock = make_manager(1000, policy="lru")
    await use(manager, make_spec("hot", 400), times=20)
    clock.advance(5)
    await use(manager, make_spec("rare", 400))
    clock.advance(5)
    await use(manager, make_spec("new", 400))
    assert host.on_unload == ["hot"]


async def test_of_models_used_alike_the_one_cheapest_to_reload_goes_first() -> None:
    manager, host, _ = make_manager(1000)
    slow = make_spec("slow", 400, load_s=2.0)
    fast = make_spec("fast", 400, load_s=0.05)
    await use(manager, slow, times=3)
    await use(manager, fast, times=3)
    await use(manager, make_spec("new", 400))
    assert host.on_unload == ["fast"]


async def test_a_reload_counts_against_the_models_latency_target() -> None:
    # Both reload in a second and are used alike: for the chat model that is a
    # tenth of its target, for the embedding model five times its own.
    manager, host, _ = make_manager(1000)
    chat = replace(make_spec("chat", 400, load_s=1.0), latency_target_ms=10_000)
    embed = replace(make_spec("embed", 400, load_s=1.0), latency_target_ms=200)
    await use(manager, embed, times=3)
    await use(manager, chat, times=3)
    await use(manager, make_spec("new", 400))
    assert host.on_unload == ["chat"]
    embed_now = next(m for m in manager.stats().models if m.name == "embed")
    assert embed_now.miss_s is not None
    expected = embed_now.uses * embed_now.miss_s / 0.2 / 400
    assert embed_now.eviction_score == pytest.approx(expected)


async def patience_setup(
    *, wait_s: float = 60.0, patience_share: float = PATIENCE_SHARE
) -> tuple[ResidencyManager, FakeModelHost, FakeClock, tuple[ModelSpec, ModelSpec, ModelSpec]]:
    """``patience_models`` registered and each used three times, in a budget
    of 1,000 bytes that holds them all (800) and no more."""
    manager, host, clock = make_manager(1000, wait_s=wait_s, patience_share=patience_share)
    models = patience_models()
    manager.register(list(models))
    chat, trans, ocr = models
    for spec in (trans, chat, ocr):
        await use(manager, spec, times=3)
    return manager, host, clock, models


def patience_models() -> tuple[ModelSpec, ModelSpec, ModelSpec]:
    """A chat model (a reload is a tenth of its target), a translation model
    (a reload is three times its target) and an OCR model; 800 bytes together."""
    chat = replace(make_spec("chat", 400, load_s=1.0), latency_target_ms=10_000)
    trans = replace(make_spec("trans", 300, load_s=1.0), latency_target_ms=300)
    ocr = replace(make_spec("ocr", 100, load_s=1.0), latency_target_ms=3_000)
    return chat, trans, ocr


async def test_a_batch_short_of_room_waits_for_a_busy_model_cheaper_to_evict() -> None:
    manager, host, clock, (chat, _, ocr) = await patience_setup()
    answering = await manager.acquire(chat, 50)
    page = asyncio.ensure_future(manager.acquire(ocr, 250))  # 50 bytes short
    await clock.sleep(0.5)
    assert not page.done()
    assert host.on_unload == []
    manager.release(answering)
    manager.release(await page)
    assert host.on_unload == ["chat"]


async def test_a_batch_waiting_for_a_busy_model_past_its_deadline_is_refused_by_name() -> None:
    # The page would wait its 1.5 s of patience for the chat model's batch; its
    # 0.3 s of waiting for room end first.
    manager, _, clock, (chat, _, ocr) = await patience_setup(wait_s=0.3)
    answering = await manager.acquire(chat, 50)
    asked = clock.now()
    with pytest.raises(OverloadedError, match=r"for model 'ocr': other models are busy$"):
        await manager.acquire(ocr, 250)
    assert clock.now() - asked == pytest.approx(0.3)
    manager.release(answering)


async def test_a_batch_waiting_for_a_busy_model_holds_no_load_behind_it() -> None:
    # While the page waits out of line for the chat model's batch, a model
    # that fits the free bytes (150) loads at once, not after the page.
    manager, _, clock, (chat, _, ocr) = await patience_setup()
    tiny = make_spec("tiny", 100)
    manager.register([*patience_models(), tiny])
    answering = await manager.acquire(chat, 50)
    page = asyncio.ensure_future(manager.acquire(ocr, 250))
    await clock.sleep(0.1)
    asked = clock.now()
    await use(manager, tiny)
    assert clock.now() == asked
    assert not page.done()
    manager.release(answering)
    manager.release(await page)


async def test_a_load_short_of_room_evicts_an_idle_model_rather_than_wait_for_one_loading() -> None:
    # "slow" loads for its caller; waiting for it to load, run and go idle, to
    # evict it instead of "idle", held up every load behind (swaps in series).
    manager, host, clock = make_manager(1000)
    idle = replace(make_spec("idle", 400, load_s=1.0), latency_target_ms=10_000)
    slow = replace(make_spec("slow", 400, load_s=3.0), latency_target_ms=10_000)
    new = replace(make_spec("new", 400, load_s=0.1), latency_target_ms=10_000)
    manager.register([idle, slow, new])
    await use(manager, idle, times=3)
    loading = asyncio.ensure_future(use(manager, slow))
    await clock.sleep(0.1)
    assert manager.state("slow") is ModelState.LOADING
    asked = clock.now()
    await use(manager, new)
    assert host.on_unload == ["idle"]
    assert clock.now() - asked < 1.0  # not the 3 s load nor the 5 s of patience
    await loading


async def test_a_batch_short_of_room_waits_its_patience_for_a_model_still_loading() -> None:
    # Unlike a load, a batch counts a model loading for another caller (never
    # used: the cheapest to evict) as soon idle: it waits for it, its 1.5 s of
    # patience, before evicting the idle translation model (dear to reload).
    manager, host, clock = make_manager(1000)
    _, trans, ocr = patience_models()
    slow = replace(make_spec("slow", 400, load_s=3.0), latency_target_ms=10_000)
    await use(manager, trans, times=3)
    await use(manager, ocr, times=3)
    loading = asyncio.ensure_future(use(manager, slow))
    await clock.sleep(0.1)
    assert manager.state("slow") is ModelState.LOADING
    asked = clock.now()
    manager.release(await manager.acquire(ocr, 250))  # 50 bytes short
    assert clock.now() - asked == pytest.approx(1.5)
    assert host.on_unload == ["trans"]
    await loading


@pytest.mark.parametrize(("share", "waited_s"), [(0.5, 1.5), (0.0, 0.0)])
async def test_patience_ends_at_its_share_of_the_target_and_then_the_idle_model_goes(
    share: float, waited_s: float
) -> None:
    # The default share, half the page's 3 s target; eviction_patience: 0
    # (the config's knob): the idle translation model goes at once rather
    # than after waiting for the chat model's batch.
    manager, host, clock, (chat, _, ocr) = await patience_setup(patience_share=share)
    answering = await manager.acquire(chat, 50)
    asked = clock.now()
    manager.release(await manager.acquire(ocr, 250))
    assert host.on_unload == ["trans"]
    assert clock.now() - asked == pytest.approx(waited_s, abs=0.1)
    manager.release(answering)


async def test_patience_for_a_batch_with_a_predicted_run_ends_after_twice_that_run() -> None:
    # The chat model's batch is predicted to run 0.2 s: the page waits for it
    # no longer than its predicted end and as long again (0.4 s), not its
    # 1.5 s of patience, and then evicts the idle translation model.
    manager, host, clock, (chat, _, ocr) = await patience_setup()
    answering = await manager.acquire(chat, 50, expected_s=0.2)
    asked = clock.now()
    manager.release(await manager.acquire(ocr, 250))
    assert host.on_unload == ["trans"]
    assert clock.now() - asked == pytest.approx(0.4, abs=0.05)
    manager.release(answering)


async def test_a_batch_that_ends_as_predicted_is_still_waited_for() -> None:
    manager, host, clock, (chat, _, ocr) = await patience_setup()
    answering = await manager.acquire(chat, 50, expected_s=0.2)
    page = asyncio.ensure_future(manager.acquire(ocr, 250))
    await clock.sleep(0.2)
    assert not page.done()
    manager.release(answering)
    manager.release(await page)
    assert host.on_unload == ["chat"]


async def test_a_later_batch_of_a_busy_model_does_not_lengthen_the_patience() -> None:
    # Each time the page looks, a cheap model is busy again (as under Zipf at
    # saturation, one new cheap model after another): its patience still ends
    # at the first batch's predicted end and as long again.
    manager, host, clock, (chat, _, ocr) = await patience_setup()
    answering = await manager.acquire(chat, 10, expected_s=0.2)
    asked = clock.now()
    page = asyncio.ensure_future(manager.acquire(ocr, 250))
    await clock.sleep(0.3)
    again = await manager.acquire(chat, 10, expected_s=0.2)  # a second batch, overlapping
    manager.release(answering)
    manager.release(await page)
    assert host.on_unload == ["trans"]
    assert clock.now() - asked == pytest.approx(0.4, abs=0.05)
    manager.release(again)


async def test_of_models_used_alike_the_largest_frees_the_most_per_lost_use() -> None:
    manager, host, _ = make_manager(1000)
    for name, size in (("small", 200), ("large", 500)):
        await use(manager, make_spec(name, size), times=3)
    await use(manager, make_spec("new", 400))
    assert host.on_unload == ["large"]


async def test_uses_decay_so_a_model_hot_long_ago_is_cold_now() -> None:
    manager, host, clock = make_manager(1000)
    await use(manager, make_spec("old", 400), times=50)
    clock.advance(3600)  # an hour: 60 half-lives
    await use(manager, make_spec("now", 400), times=2)
    await use(manager, make_spec("new", 400))
    assert host.on_unload == ["old"]


async def test_residency_reports_load_seconds_uses_and_score() -> None:
    manager, _, _ = make_manager(1000)
    spec = make_spec("a", 400, load_s=1.5)
    await use(manager, spec, times=2)
    (model,) = manager.stats().models
    assert model.load_s == 1.5
    assert model.miss_s == 1.5  # loaded into free room: its callers waited for the load alone
    assert model.uses == 2.0
    assert model.eviction_score == 2.0 * 1.5 / 400


async def test_a_miss_costs_what_its_callers_waited_room_making_included() -> None:
    # "quick" reloads in 10 ms, but the room for it takes a batch of 4 s to free:
    # its callers waited 4 s, and that (not 10 ms) is what evicting it costs.
    manager, host, clock = make_manager(1000)
    quick, slow = make_spec("quick", 400, load_s=0.01), make_spec("slow", 400, load_s=1.0)
    other = make_spec("other", 400, load_s=1.0)
    for spec in (quick, slow):
        await use(manager, spec, times=3)
    running = await manager.acquire(other, 0)  # evicts quick, the cheapest to reload
    assert host.on_unload == ["quick"]
    batch = await manager.acquire(slow, 0)  # slow and other are both busy
    back = asyncio.ensure_future(use(manager, quick))
    await clock.sleep(4.0)
    assert not back.done()
    manager.release(running)  # other's batch ends: other goes, quick comes back
    await back
    manager.release(batch)
    (entry,) = [m for m in manager.stats().models if m.name == "quick"]
    assert entry.load_s == pytest.approx(0.01)
    assert entry.miss_s == pytest.approx((0.01 + 4.01) / 2)  # the first load's, then this
    # Used alike since, the model whose callers waited least goes first: slow,
    # though its own load is a hundred times longer.
    await use(manager, slow, times=1)
    await use(manager, make_spec("new", 400))
    assert host.on_unload == ["quick", "other", "slow"]


# -- an elastic room for batches ------------------------------------------------


async def test_while_every_model_fits_a_batch_splits_to_the_room_beside_them() -> None:
    manager, _, _ = make_manager(1000)
    specs = [make_spec(name, 300) for name in "abc"]
    manager.register(specs)
    for spec in specs:
        await use(manager, spec)
    manager.observe_batch("a", 10, 1.0)  # 10 bytes per unit
    # 900 bytes of weights held: the room is 100, so 8 units of 5 split to parts of 10 units.
    parts = manager.plan_batch(specs[0], queued([5.0] * 8))
    assert [p.units for p in parts] == [10.0] * 4
    assert all(p.activation_bytes <= 100 for p in parts)


async def test_when_models_do_not_all_fit_a_batch_may_use_the_budget_beside_its_own() -> None:
    manager, _, _ = make_manager(1000)
    specs = [make_spec(name, 300) for name in "abcd"]  # 1,200 bytes: not all at once
    manager.register(specs)
    await use(manager, specs[0])
    manager.observe_batch("a", 10, 1.0)
    parts = manager.plan_batch(specs[0], queued([5.0] * 8))
    assert [p.units for p in parts] == [40.0]  # 400 bytes <= 1000 - 300


def test_catalogue_counts_a_shared_component_once_and_fits_up_to_the_budget() -> None:
    manager, _, _ = make_manager(1000)
    assert manager.catalogue_bytes() is None  # nothing registered
    assert not manager.every_model_fits()
    a = make_spec("a", 300, shared={"enc": 200})
    manager.register([a, make_spec("b", 400, shared={"enc": 200})])
    assert manager.catalogue_bytes() == 900
    assert manager.every_model_fits()
    assert manager.activation_room(a) == 100
    manager.register([make_spec("c", 100)])
    assert manager.catalogue_bytes() == 1000
    assert manager.every_model_fits()  # exactly the budget
    assert manager.activation_room(a) == 0  # the pool beside all of them
    manager.register([make_spec("d", 1)])
    assert not manager.every_model_fits()
    assert manager.activation_room(a) == 500  # the budget less a's own weights


async def test_a_batch_waits_for_running_batches_rather_than_evict_an_idle_model() -> None:
    manager, host, clock = make_manager(1000)
    a, b = make_spec("a", 300), make_spec("b", 300)
    manager.register([a, b])  # they fit: nothing need ever be evicted
    await use(manager, a)
    await use(manager, b)
    first = await manager.acquire(a, 300)  # free: 100
    second = asyncio.ensure_future(manager.acquire(a, 300))
    await clock.sleep(SETTLE_S)
    assert not second.done()
    assert host.on_unload == []  # b, idle, was not evicted: a's bytes come back
    manager.release(first)
    manager.release(await second)
    assert host.on_unload == []


async def test_when_models_do_not_all_fit_a_short_batch_evicts_an_idle_model_at_once() -> None:
    manager, host, clock = make_manager(1000)
    a, b, c = make_spec("a", 300), make_spec("b", 300), make_spec("c", 500)
    manager.register([a, b, c])  # 1,100 bytes: they do not all fit
    await use(manager, a)
    await use(manager, b)
    first = await manager.acquire(a, 300)
    second = asyncio.ensure_future(manager.acquire(a, 300))
    await clock.sleep(SETTLE_S)
    assert host.on_unload == ["b"]  # not waiting behind the first batch
    manager.release(await second)
    manager.release(first)


async def test_a_batch_evicts_only_what_returning_bytes_would_not_free() -> None:
    manager, host, clock = make_manager(1000)
    a, b, c = make_spec("a", 300), make_spec("b", 100), make_spec("c", 200)
    manager.register([a, b, c])
    for spec in (a, b, c):
        await use(manager, spec, times=3)
    first = await manager.acquire(a, 300)  # free: 100; 300 come back when it ends
    # 600 is 200 more than the free and returning bytes: c (200) goes, not b too.
    second = asyncio.ensure_future(manager.acquire(a, 600))
    await clock.sleep(SETTLE_S)
    assert host.on_unload == ["c"]
    assert not second.done()  # and it waits for the first batch's bytes
    manager.release(first)
    manager.release(await second)
    assert host.on_unload == ["c"]


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(50, 200), min_size=2, max_size=5),
    peaks=st.lists(st.integers(1, 20), min_size=5, max_size=5),
    batches=st.lists(
        st.tuples(st.integers(0, 4), st.lists(st.integers(1, 6), min_size=1, max_size=6)),
        min_size=1,
        max_size=12,
    ),
)
def test_no_eviction_while_every_model_fits_whatever_the_batch_mix(
    sizes: list[int], peaks: list[int], batches: list[tuple[int, list[int]]]
) -> None:
    """Weights that fit with room for the largest single request: batches of any
    mix, run concurrently, split and wait, and no model is ever evicted."""
    largest_request = 6 * max(peaks)
    budget = sum(sizes) + largest_request

    async def scenario() -> None:
        manager, host, clock = make_manager(budget)
        specs = [make_spec(f"m{i}", size) for i, size in enumerate(sizes)]
        manager.register(specs)
        for spec, peak in zip(specs, peaks, strict=False):
            manager.observe_batch(spec.name, peak, 1.0)

        async def run(index: int, units: list[int]) -> None:
            spec = specs[index % len(specs)]
            await clock.sleep(0.001 * index)
            parts = manager.plan_batch(spec, queued([float(u) for u in units]))
            assert sum(len(p.requests) for p in parts) == len(units)
            for part in parts:
                async with manager.lease(spec, part.activation_bytes):
                    assert manager.table.used_bytes() <= budget
                    await clock.sleep(0.01 * len(part.requests))

        await asyncio.gather(*(run(i, units) for i, units in batches))
        stats = manager.stats()
        assert stats.evictions_total == 0
        assert stats.peak_used_bytes <= budget
        assert host.unloads == {}

    asyncio.run(scenario())


# -- one line for loads and batches ---------------------------------------------


async def test_a_later_batch_passes_a_waiting_load_only_where_that_delays_it_not() -> None:
    # a (100) and b (600) fit the budget together, so loads and batches wait in
    # one line. b's load waits for a running batch of a (400) to end; of two
    # later batches of a, the small one leaves room for b beside it and runs at
    # once; the large one would not, and waits behind b's load.
    manager, _, clock = make_manager(1000)
    a, b = make_spec("a", 100), make_spec("b", 600)
    manager.register([a, b])
    await use(manager, a)
    running = await manager.acquire(a, 400)  # free: 500
    order: list[str] = []
    small_done = asyncio.Event()

    async def load_b() -> None:
        await manager.ensure_loaded(b)
        order.append("load b")

    async def batch_a(num_bytes: int, name: str) -> None:
        lease = await manager.acquire(a, num_bytes)
        order.append(name)
        if name == "small a":
            await small_done.wait()
        manager.release(lease)

    loading = asyncio.ensure_future(load_b())
    await clock.sleep(SETTLE_S)
    large = asyncio.ensure_future(batch_a(350, "large a"))  # 900 - 350 < 600: b would wait
    small = asyncio.ensure_future(batch_a(100, "small a"))  # 900 - 100 >= 600: b would not
    await clock.sleep(SETTLE_S)
    assert order == ["small a"]
    manager.release(running)  # b loads beside the small batch still running
    await loading
    assert order == ["small a", "load b"]
    small_done.set()
    await small
    await use(manager, b)  # b's first batch: it may now be evicted for the large one
    await large
    assert order == ["small a", "load b", "large a"]
    assert manager._arbiter.line.passed_bytes == 0


@pytest.mark.parametrize(("first_batch", "passing"), [(0, 3), (50, 2)])
async def test_batches_passing_a_waiting_load_count_together(
    first_batch: int, passing: int
) -> None:
    # Each small batch of a may pass b's waiting load while the room beside the
    # weights (900), less the batches that passed and its own, still holds what
    # the load waits for: b's 600 and its first batch. Of batches of 100, three
    # pass a load of b alone, two a load with a first batch of 50; the next waits.
    manager, _, clock = make_manager(1000)
    a, b = make_spec("a", 100), make_spec("b", 600)
    manager.register([a, b])
    await use(manager, a)
    running = await manager.acquire(a, 400)  # free: 500
    loading = asyncio.ensure_future(manager.acquire(b, first_batch))
    await clock.sleep(SETTLE_S)
    passed = [await manager.acquire(a, 100) for _ in range(passing)]
    assert clock.now() == SETTLE_S  # at once
    behind = asyncio.ensure_future(manager.acquire(a, 100))
    await clock.sleep(SETTLE_S)
    assert not behind.done()
    for lease in (running, *passed):
        manager.release(lease)
    manager.release(await loading)
    manager.release(await behind)


async def test_a_waiting_load_is_not_overtaken_by_a_later_batch() -> None:
    manager, _, clock = make_manager(1000)
    a, b = make_spec("a", 300), make_spec("b", 650)
    manager.register([a, b])  # they fit: batches and loads wait in one line
    await use(manager, a)
    running = await manager.acquire(a, 600)  # free: 100
    order: list[str] = []

    async def load_b() -> None:
        await manager.ensure_loaded(b)
        order.append("load b")

    async def batch_a() -> None:
        lease = await manager.acquire(a, 60)  # fits now, but b (650 of 700) would wait for it
        order.append("batch a")
        manager.release(lease)

    loading = asyncio.ensure_future(load_b())
    await clock.sleep(SETTLE_S)
    batch = asyncio.ensure_future(batch_a())
    await clock.sleep(SETTLE_S)
    assert order == []
    manager.release(running)
    await asyncio.gather(loading, batch)
    assert order == ["load b", "batch a"]


async def test_a_waiting_batch_is_not_overtaken_by_a_later_load() -> None:
    manager, _, clock = make_manager(1000)
    a, b = make_spec("a", 300), make_spec("b", 200)
    manager.register([a, b])  # they fit: batches and loads wait in one line
    await use(manager, a)
    running = await manager.acquire(a, 600)  # free: 100
    order: list[str] = []

    async def batch_a() -> None:
        lease = await manager.acquire(a, 500)  # waits for the 600 to come back
        order.append("batch a")
        manager.release(lease)

    async def load_b() -> None:
        await manager.ensure_loaded(b)
        order.append("load b")

    batch = asyncio.ensure_future(batch_a())
    await clock.sleep(SETTLE_S)
    loading = asyncio.ensure_future(load_b())
    await clock.sleep(SETTLE_S)
    assert order == []
    manager.release(running)
    await asyncio.gather(loading, batch)
    assert order == ["batch a", "load b"]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(100, 400), min_size=3, max_size=5),
    batches=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 100), st.integers(1, 20)),
        min_size=2,
        max_size=16,
    ),
)
def test_under_memory_pressure_every_batch_is_served(
    sizes: list[int], batches: list[tuple[int, int, int]]
) -> None:
    """The models do not all fit (the budget holds the largest and a little
    more): batches of every model, arriving together, evict and reload each
    other, and every one of them is served; none waits for ever in the line."""
    budget = max(sizes) + 150

    async def scenario() -> None:
        manager, _, clock = make_manager(budget, wait_s=3600.0)
        specs = [make_spec(f"m{i}", size, load_s=0.5) for i, size in enumerate(sizes)]
        manager.register(specs)

        async def run(index: int, activation: int, start_ms: int) -> None:
            spec = specs[index % len(specs)]
            await clock.sleep(start_ms / 1000)
            async with manager.lease(spec, activation):
                assert manager.table.used_bytes() <= budget
                await clock.sleep(0.05)

        await asyncio.gather(*(run(*batch) for batch in batches))
        assert clock.now() < 3600.0  # nobody waited out the bound
        assert manager.table.activation_bytes_held() == 0

    asyncio.run(scenario())
