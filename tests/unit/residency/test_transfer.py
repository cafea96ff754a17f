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
from tessera.repository import ModelSpec
from tessera.residency import make_eviction_policy
from tessera.residency.table import ModelEntry
from tessera.residency.tier import HostTier
from tessera.residency.transfer import TierTransfers
from tessera.runtimes.base import LoadedModel


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


async def test_a_copy_larger_than_the_tier_is_not_kept_and_the_debug_log_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    transfers, host, _ = make_transfers()
    with caplog.at_level("DEBUG", logger="tessera.residency"):
        assert not await keep(transfers, "big", 1001)
    assert not transfers.holds("big")
    assert host.offloads["big"] == 0
    assert [r.getMessage() for r in caplog.records] == [
        "big is not kept in the host tier: no room worth making"
    ]


async def test_a_copy_reported_larger_than_its_room_is_dropped_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Expected at 300 B, it reports 1200 once copied: it went to the host (True:
    # it is off the device), and is dropped there at once.
    transfers, host, _ = make_transfers()
    spec = make_spec("m", 300, host_tier=True, host_bytes=1200)
    with caplog.at_level("INFO", logger="tessera.residency"):
        assert await transfers.offload(spec, make_fake_model(spec), ModelEntry("m"), Footprint(300))
    assert (host.offloads["m"], host.drops["m"]) == (1, 1)
    assert not transfers.holds("m")
    assert transfers.tier is not None
    assert transfers.tier.used_bytes() == 0
    assert [r.getMessage() for r in caplog.records] == [
        "m holds 1200 host bytes, more than its room"
    ]


class NoCopies(FakeModelHost):
    """A host that cannot copy a model to host memory (``None``), or fails to (``error``)."""

    def __init__(self, error: Exception | None = None) -> None:
        super().__init__()
        self.error = error

    async def offload(self, spec: ModelSpec, model: LoadedModel) -> Footprint | None:
        if self.error is not None:
            raise self.error
        return None


async def test_a_copy_the_host_does_not_make_frees_its_room_and_is_not_kept() -> None:
    tier = HostTier(1000, make_eviction_policy("cost", FakeClock()), FakeClock())
    transfers = TierTransfers(tier, NoCopies(), 0, lambda: None)
    assert not await keep(transfers, "m")
    assert not transfers.holds("m")
    assert tier.used_bytes() == 0


async def test_a_copy_that_fails_frees_its_room_and_its_error_is_raised() -> None:
    tier = HostTier(1000, make_eviction_policy("cost", FakeClock()), FakeClock())
    transfers = TierTransfers(tier, NoCopies(OSError("host memory")), 0, lambda: None)
    with pytest.raises(OSError, match="host memory"):
        await keep(transfers, "m")
    assert not transfers.holds("m")
    assert tier.used_bytes() == 0


async def test_room_is_made_again_when_a_dropped_copy_took_the_newcomers_shared_component() -> None:
    # "x" holds the encoder "y" counts as already there; dropping "x" (first
    # in the policy's order: every use weighs 0, ties in order of arrival)
    # takes the encoder with it, and "y" with its own encoder needs "z"'s room
    # too. Before, "x" was dropped and "y" was not kept.
    transfers, host, _ = make_transfers()
    x = make_spec("x", 100, host_tier=True, shared={"enc": 500})
    z = make_spec("z", 300, host_tier=True)
    y = make_spec("y", 300, host_tier=True, shared={"enc": 500})
    for spec in (x, z):
        footprint = Footprint(spec.options["own_bytes"], dict(spec.options["shared"]))
        assert await transfers.offload(spec, make_fake_model(spec), ModelEntry(spec.key), footprint)
    assert await transfers.offload(
        y, make_fake_model(y), ModelEntry("y"), Footprint(300, {"enc": 500})
    )
    assert transfers.holds("y")
    assert host.drops == {"x": 1, "z": 1}
    assert transfers.tier is not None
    assert transfers.tier.used_bytes() == 800


async def test_a_copy_that_does_not_come_back_is_logged_and_one_that_does_is_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    transfers, _, _ = make_transfers()
    broken = make_spec("bad", 300, host_tier=True, fail_restore=True)
    assert await transfers.offload(
        broken, make_fake_model(broken), ModelEntry("bad"), Footprint(300)
    )
    assert await keep(transfers, "good")
    with caplog.at_level("INFO", logger="tessera.residency"):
        assert await transfers.restore(broken) is None
        assert await transfers.restore(make_spec("good", 300, host_tier=True)) is not None
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "bad did not come back from the host tier: loaded from files")
    ]
