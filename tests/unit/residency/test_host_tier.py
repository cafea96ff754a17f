"""The host tier (a reload is a copy, not a parse): evicted
models wait in host memory within a budget of their own, the policy chooses
which copies go, and a load takes the copy when there is one, else the files.
Fake models and host, a fake clock that autojumps.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import make_spec
from harness.fake_host import FakeModelHost
from tessera.clock import FakeClock
from tessera.errors import ModelTooLargeError, OverloadedError
from tessera.footprint import Footprint
from tessera.repository import ModelSpec
from tessera.residency import (
    MAX_HOST_LOADS,
    ModelResidency,
    ResidencyManager,
    make_eviction_policy,
)
from tessera.runtimes.base import LoadedModel


def make_manager(
    budget: int, host_budget: int, *, policy: str = "cost"
) -> tuple[ResidencyManager, FakeModelHost, FakeClock]:
    clock = FakeClock()
    host = FakeModelHost(clock)
    chosen = make_eviction_policy(policy, clock)
    manager = ResidencyManager(budget, host, chosen, clock, host_budget_bytes=host_budget)
    return manager, host, clock


def kept(name: str, own_bytes: int, **options: Any) -> ModelSpec:
    """A model that can wait in the host tier; loads take 1 s (unless ``options``
    say otherwise), restores 0.01 s."""
    chosen: dict[str, Any] = {"host_tier": True, "load_s": 1.0, "restore_s": 0.01, **options}
    return make_spec(name, own_bytes, **chosen)


async def use(manager: ResidencyManager, spec: ModelSpec, times: int = 1) -> None:
    for _ in range(times):
        manager.release(await manager.acquire(spec, 0))


def model(manager: ResidencyManager, name: str) -> ModelResidency:
    (found,) = [m for m in manager.stats().models if m.name == name]
    return found


async def test_an_evicted_model_waits_in_the_host_tier_and_comes_back_by_a_copy() -> None:
    manager, host, _ = make_manager(1000, 1000)
    a, b = kept("a", 600), make_spec("b", 600, load_s=1.0)
    await use(manager, a)
    await use(manager, b)  # evicts a: into the host tier, not unloaded
    assert host.offloads["a"] == 1
    assert host.unloads["a"] == 0
    held = model(manager, "a")
    assert (held.state, held.host_tier, held.host_bytes) == ("unloaded", True, 600)
    assert manager.stats().host_used_bytes == 600

    await use(manager, a)  # evicts b (not kept: no host_tier), a comes back from the tier
    assert host.loads["a"] == 1  # its files were read once, at its first load
    assert host.restores["a"] == 1
    assert host.unloads["b"] == 1
    back = model(manager, "a")
    assert (back.state, back.host_tier, back.host_bytes, back.host_loads) == ("ready", False, 0, 1)
    assert back.files_load_s == 1.0
    assert back.host_load_s == pytest.approx(0.01)
    assert back.load_s == back.host_load_s  # the last load: what evicting it again costs
    stats = manager.stats()
    assert (stats.host_used_bytes, stats.host_loads_total, stats.host_budget_bytes) == (0, 1, 1000)


async def test_without_a_host_budget_an_evicted_model_is_unloaded() -> None:
    manager, host, _ = make_manager(1000, 0)
    a = kept("a", 600)
    await use(manager, a)
    await use(manager, kept("b", 600))
    await use(manager, a)
    assert host.offloads == {}
    assert host.loads["a"] == 2
    assert manager.stats().host_budget_bytes == 0


async def test_the_policy_drops_the_least_valuable_copy_to_admit_a_more_valuable_one() -> None:
    # Device: one model at a time. Host: two copies of 400.
    manager, host, _ = make_manager(500, 800)
    hot, cold, warm, last = kept("hot", 400), kept("cold", 400), kept("warm", 400), kept("x", 400)
    await use(manager, hot, times=10)
    await use(manager, cold)  # hot goes to the tier
    await use(manager, warm, times=5)  # cold goes to the tier: 800, full
    await use(manager, last)  # warm goes in; cold, used once, is dropped for it
    assert host.drops == {"cold": 1}
    assert {m.name for m in manager.stats().models if m.host_tier} == {"hot", "warm"}
    assert manager.stats().host_used_bytes == 800
    assert manager.stats().host_drops_total == 1


async def test_a_copy_worth_less_than_those_it_would_displace_is_not_kept() -> None:
    manager, host, _ = make_manager(500, 800)
    a, b, rare = kept("a", 400), kept("b", 400), kept("rare", 400)
    await use(manager, a, times=10)
    await use(manager, b, times=10)  # a into the tier
    await use(manager, rare)  # b into the tier: full
    await use(manager, a)  # rare, used once, would displace a hot copy: unloaded instead
    assert host.drops == {}
    assert host.unloads["rare"] == 1
    assert not model(manager, "rare").host_tier
    assert model(manager, "b").host_tier


async def test_the_lru_policy_chooses_the_host_tier_victims_by_last_use() -> None:
    manager, host, clock = make_manager(500, 800, policy="lru")
    a, b, c, d = kept("a", 400), kept("b", 400), kept("c", 400), kept("d", 400)
    await use(manager, a, times=10)
    clock.advance(1)
    await use(manager, b)
    clock.advance(1)
    await use(manager, c)  # tier: a, b
    clock.advance(1)
    await use(manager, d)  # c in; a, used longest ago (however often), dropped
    assert host.drops == {"a": 1}


async def test_a_model_whose_copy_was_dropped_loads_from_its_files() -> None:
    manager, host, _ = make_manager(500, 400)
    a, b, c = kept("a", 400), kept("b", 400, load_s=0.5), kept("c", 400)
    await use(manager, a)
    await use(manager, b, times=5)  # a in the tier
    await use(manager, c, times=5)  # b, worth more than a, displaces it
    assert host.drops == {"a": 1}
    await use(manager, a)
    assert host.loads["a"] == 2
    assert model(manager, "a").host_loads == 0
    assert model(manager, "a").files_load_s == 1.0


async def test_a_copy_that_cannot_come_back_is_loaded_from_files() -> None:
    manager, host, _ = make_manager(500, 1000)
    a = kept("a", 400, fail_restore=True)
    await use(manager, a)
    await use(manager, kept("b", 400))
    assert model(manager, "a").host_tier
    await use(manager, a)
    assert host.loads["a"] == 2
    assert host.restores["a"] == 0
    assert model(manager, "a").host_loads == 0
    assert manager.stats().host_used_bytes == 400  # b's copy only


async def test_a_model_that_cannot_be_kept_is_unloaded() -> None:
    manager, host, _ = make_manager(500, 1000)
    await use(manager, make_spec("plain", 400))
    await use(manager, kept("b", 400))
    assert host.unloads["plain"] == 1
    assert host.offloads == {}
    assert manager.stats().host_used_bytes == 0


async def test_a_copy_larger_than_the_host_budget_is_never_kept() -> None:
    manager, host, _ = make_manager(1000, 300)
    await use(manager, kept("big", 600))
    await use(manager, kept("b", 600))
    assert host.offloads == {}
    assert host.unloads["big"] == 1


async def test_a_copy_reported_larger_than_its_room_is_dropped() -> None:
    # Expected at its device bytes (300, which fit), it reports 900 on the host.
    manager, host, _ = make_manager(500, 600)
    await use(manager, kept("a", 300, host_bytes=900))
    await use(manager, kept("b", 400))
    assert host.offloads["a"] == 1
    assert host.drops["a"] == 1
    assert manager.stats().host_used_bytes == 0


async def test_shared_components_are_counted_once_in_the_host_tier() -> None:
    manager, _, _ = make_manager(800, 700)
    x = kept("x", 100, shared={"enc": 500})
    y = kept("y", 100, shared={"enc": 500})
    await use(manager, x)
    await use(manager, y)
    await use(manager, kept("z", 800))  # both evicted into the tier
    stats = manager.stats()
    assert stats.host_used_bytes == 700
    # Each model's figure holds half the encoder, so the figures sum to the
    # tier's (a dashboard stacks them), as resident bytes do.
    assert {m.name: m.host_bytes for m in stats.models if m.host_tier} == {"x": 350, "y": 350}


async def test_unload_retire_and_close_drop_the_host_copies() -> None:
    manager, host, _ = make_manager(500, 1200)
    a, b, c = kept("a", 400), kept("b", 400), kept("c", 400)
    for spec in (a, b, c):
        await use(manager, spec)
    assert await manager.unload("a") is False  # not on the device, its copy dropped
    await manager.retire("b")
    assert host.drops == {"a": 1, "b": 1}
    await manager.close()
    assert host.kept == {}
    assert manager.stats().host_used_bytes == 0


async def test_a_load_waiting_for_a_model_being_offloaded_takes_its_copy() -> None:
    manager, host, _ = make_manager(500, 1000)
    a, b = kept("a", 400), kept("b", 400)
    await use(manager, a)
    await asyncio.gather(use(manager, b), use(manager, a), use(manager, b))
    assert host.loads["a"] == 1
    assert sum(host.restores.values()) >= 1


class GatedOffloads(FakeModelHost):
    """Offloads that begin, then wait for ``gate``."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.begun: list[str] = []
        self.gate = asyncio.Event()

    async def offload(self, spec: ModelSpec, model: LoadedModel) -> Footprint | None:
        self.begun.append(spec.key)
        await self.gate.wait()
        return await super().offload(spec, model)


async def test_evictions_copy_into_the_tier_side_by_side() -> None:
    # Their bytes are held in the tier while they copy: the second eviction's
    # copy does not wait for the first's (on a GPU, a millisecond each).
    clock = FakeClock()
    host = GatedOffloads(clock)
    manager = ResidencyManager(
        1000, host, make_eviction_policy("cost", clock), clock, host_budget_bytes=1000
    )
    await use(manager, kept("a", 400))
    await use(manager, kept("b", 400))
    big = asyncio.ensure_future(use(manager, make_spec("c", 900)))  # evicts both
    for _ in range(100):
        if len(host.begun) == 2:
            break
        await asyncio.sleep(0)
    assert sorted(host.begun) == ["a", "b"]
    assert manager.stats().host_used_bytes == 800  # both held while they copy
    host.gate.set()
    await big
    assert (host.offloads["a"], host.offloads["b"]) == (1, 1)
    assert manager.stats().host_used_bytes == 800
    await manager.close()


class GatedRestores(FakeModelHost):
    """Copies back that begin, then wait for ``gate``."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.begun: list[str] = []
        self.gate = asyncio.Event()

    async def restore(self, spec: ModelSpec) -> LoadedModel | None:
        self.begun.append(spec.key)
        await self.gate.wait()
        return await super().restore(spec)


async def test_loads_from_the_tier_beyond_two_wait_for_a_copy_back_to_end() -> None:
    # Twelve models, room for six. Six callers want the six in the tier at
    # once: two copies back begin; the line's head makes its own room and
    # waits for one of them to end, and no load behind it has room made
    # ahead (it would be held empty while the copies run one at a time).
    clock = FakeClock()
    host = GatedRestores(clock)
    manager = ResidencyManager(
        1800,
        host,
        make_eviction_policy("lru", clock),
        clock,
        host_budget_bytes=4000,
        max_host_loads=MAX_HOST_LOADS,  # as on CUDA
    )
    specs = [kept(f"m{i}", 300) for i in range(12)]
    for spec in specs:
        await use(manager, spec)  # m0-m5 end in the tier, m6-m11 on the device
    assert [model(manager, s.key).host_tier for s in specs] == [True] * 6 + [False] * 6
    wanted = asyncio.gather(*(use(manager, s) for s in specs[:6]))
    for _ in range(200):
        await asyncio.sleep(0)
    assert sorted(host.begun) == ["m0", "m1"]
    assert sum(host.offloads[s.key] for s in specs[6:]) == 3  # two loads' room and the head's
    host.gate.set()
    await wanted
    assert sorted(host.begun) == [s.key for s in specs[:6]]
    assert all(model(manager, s.key).state == "ready" for s in specs[:6])
    await manager.close()


async def test_by_default_loads_from_the_tier_are_not_bounded() -> None:
    clock = FakeClock()
    host = GatedRestores(clock)
    manager = ResidencyManager(
        1000, host, make_eviction_policy("lru", clock), clock, host_budget_bytes=1000
    )
    specs = [kept(f"m{i}", 400) for i in range(4)]
    for spec in specs:
        await use(manager, spec)  # m0 and m1 end in the tier
    for spec in specs[2:]:
        await manager.unload(spec.key)
    wanted = asyncio.gather(*(use(manager, s) for s in specs[:2]))
    for _ in range(100):
        await asyncio.sleep(0)
    assert sorted(host.begun) == ["m0", "m1"]  # both copies back at once
    host.gate.set()
    await wanted
    await manager.close()


# -- the budgets under any sequence -------------------------------------------

HOST_BUDGET = 900
SPECS = {
    "m0": kept("m0", 100, shared={"enc": 200}),
    "m1": kept("m1", 250, shared={"enc": 200}),
    "m2": kept("m2", 400),
    "m3": kept("m3", 700, host_bytes=800),
    "m4": make_spec("m4", 300),
}
step = st.tuples(st.sampled_from(sorted(SPECS)), st.sampled_from(["use", "unload"]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(step, max_size=12), min_size=1, max_size=3))
def test_both_budgets_hold_and_a_model_is_never_on_the_device_and_in_the_tier(
    tasks: list[list[tuple[str, str]]],
) -> None:
    async def run() -> None:
        manager, host, _ = make_manager(1000, HOST_BUDGET)
        violations: list[str] = []

        def check(when: str) -> None:
            stats = manager.stats()
            if stats.host_used_bytes > HOST_BUDGET or stats.used_bytes > 1000:
                violations.append(f"{when}: {stats.host_used_bytes} B host, {stats.used_bytes}")
            both = [m.name for m in stats.models if m.host_tier and m.state != "unloaded"]
            if both:
                violations.append(f"{when}: {both} on the device and in the tier")

        async def task(steps: list[tuple[str, str]]) -> None:
            for name, kind in steps:
                with contextlib.suppress(OverloadedError, ModelTooLargeError):
                    if kind == "use":
                        await use(manager, SPECS[name])
                    else:
                        await manager.unload(name)
                check(f"{kind} {name}")

        await asyncio.gather(*(task(steps) for steps in tasks))
        assert violations == []
        assert set(host.kept) == {m.name for m in manager.stats().models if m.host_tier}
        await manager.close()
        assert host.kept == {}
        assert manager.stats().host_used_bytes == 0

    asyncio.run(run())


async def test_a_copy_taken_back_is_no_drop_and_each_restore_and_drop_is_counted() -> None:
    manager, host, clock = make_manager(1000, 2000)
    # Loads and copies back of no stated time take none.
    a, b = make_spec("a", 600, host_tier=True), make_spec("b", 600, host_tier=True)
    await use(manager, a)
    for _ in range(2):
        await use(manager, b)  # a to the tier (b from it, the second time)
        await use(manager, a)  # b to the tier, a back from it
    assert (host.restores["a"], host.restores["b"]) == (2, 1)
    assert clock.now() == 0.0
    assert manager.stats().host_drops_total == 0  # copies taken back were not dropped
    for _ in range(2):
        await manager.unload("b")  # it waits in the tier: its copy is dropped
        await use(manager, b)  # from its files
        await use(manager, a)  # b to the tier again
    assert host.drops["b"] == 2
