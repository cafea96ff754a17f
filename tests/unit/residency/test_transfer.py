"""Transfers to and from the host tier (``transfer.py``): the bound on restores
in flight, drops, and a copy that comes back or not; fake models and host."""

from __future__ import annotations

import asyncio

import pytest

from builders import make_spec
from harness.fake_host import FakeModelHost
from harness.fake_models import make_fake_model
from tessera.clock import FakeClock
from tessera.footprint import Footprint
from tessera.residency import make_eviction_policy
from tessera.residency.table import ModelEntry
from tessera.residency.tier import HostTier
from tessera.residency.transfer import TierTransfers


def make_transfers(max_loads: int = 0) -> tuple[TierTransfers, FakeModelHost, list[str]]:
    clock = FakeClock()
    host = FakeModelHost(clock)
    tier = HostTier(1000, make_eviction_policy("cost", clock), clock)
    ended: list[str] = []
    return TierTransfers(tier, host, max_loads, lambda: ended.append("end")), host, ended


async def keep(transfers: TierTransfers, name: str, num_bytes: int = 300) -> bool:
    spec = make_spec(name, num_bytes, host_tier=True)
    model = make_fake_model(spec)
    return await transfers.offload(spec, model, ModelEntry(name), Footprint(num_bytes))


async def test_an_evicted_model_is_kept_and_restored_once() -> None:
    transfers, host, ended = make_transfers()
    assert await keep(transfers, "m")
    assert transfers.holds("m")
    assert host.offloads["m"] == 1
    model = await transfers.restore(make_spec("m", 300, host_tier=True))
    assert model is not None
    assert not transfers.holds("m")
    assert await transfers.restore(make_spec("m", 300, host_tier=True)) is None
    assert ended == []  # unbounded: no one waits for a restore to end
    assert transfers.num_loads == 0


async def test_a_model_that_cannot_be_offloaded_is_not_kept() -> None:
    transfers, host, _ = make_transfers()
    spec = make_spec("plain", 300)
    assert not await transfers.offload(
        spec, make_fake_model(spec), ModelEntry("plain"), Footprint(300)
    )
    assert not transfers.holds("plain")
    assert host.offloads["plain"] == 0


async def test_without_a_tier_nothing_is_kept() -> None:
    transfers = TierTransfers(None, FakeModelHost(), 0, lambda: None)
    assert not await keep(transfers, "m")
    assert not transfers.holds("m")
    assert await transfers.restore(make_spec("m", 300, host_tier=True)) is None
    await transfers.drop("m")


async def test_a_dropped_copy_is_gone() -> None:
    transfers, host, _ = make_transfers()
    assert await keep(transfers, "m")
    await transfers.drop("m")
    assert not transfers.holds("m")
    assert host.drops["m"] == 1
    await transfers.drop("m")  # dropping what is not held does nothing
    assert host.drops["m"] == 1


async def test_restores_in_flight_are_bounded_and_each_end_is_told() -> None:
    transfers, _, ended = make_transfers(max_loads=1)
    assert await keep(transfers, "a")
    assert await keep(transfers, "b")
    assert not transfers.loads_full("a")
    slow = make_spec("a", 300, host_tier=True, restore_s=1.0)
    restoring = asyncio.ensure_future(transfers.restore(slow))
    await asyncio.sleep(0)
    assert transfers.num_loads == 1
    assert transfers.loads_full("b")
    assert not transfers.loads_full("c")  # not in the tier: it loads from its files
    assert await restoring is not None
    assert ended == ["end"]
    assert not transfers.loads_full("b")


async def test_a_drop_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    transfers, _, _ = make_transfers()
    assert await keep(transfers, "m")
    with caplog.at_level("INFO", logger="tessera.residency"):
        await transfers.drop("m")
    assert [r.getMessage() for r in caplog.records] == ["dropping m from the host tier"]
