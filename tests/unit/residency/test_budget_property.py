"""The budget under concurrency: tasks that load, lease, run, evict and unload at
once, with bytes counted by the host (when a load starts until its unload ends)
and by the callers (a lease's activation bytes until it is released), not read
back from the residency table. An unloading model still holds its bytes; a
table that counted them free would let a load start beside it and overshoot.
"""

from __future__ import annotations

import asyncio
import contextlib

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
from tessera.residency import ModelState, ResidencyManager, make_eviction_policy
from tessera.runtimes.base import LoadedModel

BUDGET = 1000
NAMES = ["m0", "m1", "m2", "m3", "m4"]
SIZES = {"m0": 100, "m1": 250, "m2": 400, "m3": 700, "m4": 1200}
SHARED = {"m0": {"enc": 200}, "m1": {"enc": 200}, "m2": {}, "m3": {}, "m4": {}}
SPECS = {n: make_spec(n, SIZES[n], shared=SHARED[n]) for n in NAMES}


class CountingHost(FakeModelHost):
    """A fake host that keeps its own count of the bytes its models hold, and
    takes a few turns of the event loop to load and to unload (so that other
    tasks run in between)."""

    def __init__(self, turns: int) -> None:
        super().__init__()
        self.turns = turns
        self.manager: ResidencyManager | None = None
        self.own: dict[str, int] = {}  # model -> own bytes, while held
        self.users: dict[str, set[str]] = {}  # shared component -> models holding it
        self.component_bytes: dict[str, int] = {}
        self.activation_bytes = 0
        self.violations: list[str] = []

    def held_bytes(self) -> int:
        shared = sum(self.component_bytes[key] for key, users in self.users.items() if users)
        return sum(self.own.values()) + shared + self.activation_bytes

    def check(self, when: str) -> None:
        if self.held_bytes() > BUDGET:
            self.violations.append(f"{when}: {self.held_bytes()} bytes held")

    def _hold(self, spec: ModelSpec) -> None:
        if spec.name in self.own:
            self.violations.append(f"{spec.name} loaded while it was still held")
        self.own[spec.name] = int(spec.options["own_bytes"])
        for key, num_bytes in spec.options["shared"].items():
            self.users.setdefault(key, set()).add(spec.name)
            self.component_bytes[key] = num_bytes

    def _free(self, name: str) -> None:
        self.own.pop(name, None)
        for users in self.users.values():
            users.discard(name)

    async def _turns(self) -> None:
        for _ in range(self.turns):
            await asyncio.sleep(0)

    async def load(self, spec: ModelSpec) -> LoadedModel:
        self._hold(spec)
        self.check(f"load of {spec.name} began")
        try:
            await self._turns()
            return await super().load(spec)
        except BaseException:
            self._free(spec.name)
            raise

    async def unload(self, spec: ModelSpec, model: LoadedModel, *, eviction: bool = False) -> None:
        assert self.manager is not None
        if self.manager.table.entries[spec.name].pins:
            self.violations.append(f"{spec.name} unloaded while pinned")
        await self._turns()
        await super().unload(spec, model, eviction=eviction)
        self._free(spec.name)


step = st.one_of(
    st.tuples(st.just("lease"), st.sampled_from(NAMES), st.integers(0, 300), st.integers(0, 4)),
    st.tuples(st.just("load"), st.sampled_from(NAMES), st.just(0), st.just(0)),
    st.tuples(st.just("unload"), st.sampled_from(NAMES), st.just(0), st.just(0)),
)
Step = tuple[str, str, int, int]


async def _task(manager: ResidencyManager, host: CountingHost, steps: list[Step]) -> None:
    for kind, name, activation, hold_turns in steps:
        with contextlib.suppress(OverloadedError, ModelUnavailableError):
            if kind == "lease":
                lease = await manager.acquire(SPECS[name], activation)
                host.activation_bytes += activation
                host.check(f"lease of {name} with {activation} bytes")
                for _ in range(hold_turns):  # the batch runs
                    await asyncio.sleep(0)
                host.activation_bytes -= activation
                manager.release(lease)
            elif kind == "load":
                await manager.ensure_loaded(SPECS[name])
            else:
                await manager.unload(name)


async def _run_concurrently(tasks: list[list[Step]], turns: int) -> None:
    host = CountingHost(turns)
    manager = ResidencyManager(BUDGET, host, make_eviction_policy("lru"), FakeClock(), wait_s=0.0)
    host.manager = manager
    outcomes = await asyncio.gather(
        *(_task(manager, host, steps) for steps in tasks), return_exceptions=True
    )
    # The only errors a caller may see besides waiting too long: a model over the
    # budget, or a lease whose activations could never fit beside it.
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(
            outcome, ModelTooLargeError | RequestTooLargeError
        ):
            raise outcome
    assert host.violations == []
    assert manager.peak_used_bytes <= BUDGET
    # At rest, the table agrees with the host's own count, and nothing leaked.
    assert host.activation_bytes == 0
    assert manager.table.used_bytes() == host.held_bytes()
    assert all(e.pins == 0 and e.activation_bytes == 0 for e in manager.table.entries.values())
    for name in NAMES:
        resident = manager.state(name) is ModelState.READY
        assert host.loads[name] == host.unloads[name] + int(resident)
        assert (name in host.own) == resident
    assert not asyncio.all_tasks() - {asyncio.current_task()}


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.lists(step, min_size=1, max_size=5), min_size=2, max_size=5),
    st.integers(1, 3),
)
def test_budget_holds_when_tasks_interleave(tasks: list[list[Step]], turns: int) -> None:
    asyncio.run(_run_concurrently(tasks, turns))


async def test_a_load_never_starts_while_its_victim_is_still_unloading() -> None:
    # The case the property above would find: "b" needs room held by "a", which
    # is evicted; the bytes of "a" are free only once its unload has finished.
    host = CountingHost(turns=3)
    manager = ResidencyManager(BUDGET, host, make_eviction_policy("lru"), FakeClock(), wait_s=0.0)
    host.manager = manager
    await manager.ensure_loaded(SPECS["m3"])
    evicting = asyncio.ensure_future(manager.ensure_loaded(SPECS["m2"]))
    await asyncio.sleep(0)
    assert manager.state("m3") is ModelState.UNLOADING
    assert manager.table.used_bytes() == 700  # still held while it unloads
    assert manager.table.free_bytes() == 300
    await evicting
    assert host.violations == []
    assert manager.table.used_bytes() == host.held_bytes() == 400
