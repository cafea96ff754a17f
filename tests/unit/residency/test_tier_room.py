"""The host tier's room (``tier.py``), on its own: the copies it drops for a
newcomer, a newcomer it refuses, and the load time each copy is weighed by
(a load from its files, not the last copy back). A fake clock that stays at 0."""

from __future__ import annotations

from tessera.clock import FakeClock
from tessera.footprint import Footprint
from tessera.residency import make_eviction_policy
from tessera.residency.table import ModelEntry
from tessera.residency.tier import HostTier


def make_tier(budget: int = 1000, policy: str = "cost") -> HostTier:
    clock = FakeClock()
    return HostTier(budget, make_eviction_policy(policy, clock), clock)


def evicted(
    name: str,
    *,
    uses: float = 1.0,
    last_used: float = 0.0,
    load_s: float | None = None,
    files_load_s: float | None = None,
) -> ModelEntry:
    """The device's bookkeeping of a model being evicted."""
    return ModelEntry(
        name, use_weight=uses, last_used=last_used, load_s=load_s, files_load_s=files_load_s
    )


def admit(tier: HostTier, entry: ModelEntry, num_bytes: int) -> None:
    """Keep ``entry``'s model in ``tier``, where it fits without dropping anything."""
    footprint = Footprint(num_bytes)
    assert tier.make_room(entry, footprint) == []
    assert tier.begin_admit(entry.name, footprint)
    assert tier.settle(entry.name, footprint, entry)
    assert tier.holds(entry.name)


def test_a_newcomer_one_byte_short_of_room_has_a_copy_dropped_for_it() -> None:
    tier = make_tier(1000)
    admit(tier, evicted("old"), 400)
    assert tier.make_room(evicted("new", uses=10.0), Footprint(600)) == []
    assert tier.make_room(evicted("new", uses=10.0), Footprint(601)) == ["old"]


def test_under_the_none_policy_a_copy_that_fills_the_tier_exactly_is_kept_and_no_more() -> None:
    # The policy never drops a copy: a newcomer is kept only where it fits as is.
    tier = make_tier(1000, policy="none")
    admit(tier, evicted("old"), 400)
    assert tier.make_room(evicted("new"), Footprint(600)) == []
    assert tier.make_room(evicted("new"), Footprint(601)) is None
    assert tier.holds("old")


def test_a_newcomer_worth_less_than_the_copies_it_would_displace_is_refused() -> None:
    tier = make_tier(1000)
    admit(tier, evicted("hot", uses=10.0), 400)
    assert tier.make_room(evicted("rare", uses=0.1), Footprint(700)) is None


def test_a_newcomer_larger_than_the_whole_tier_is_refused() -> None:
    tier = make_tier(1000)
    assert tier.make_room(evicted("big", uses=10.0), Footprint(1001)) is None


def test_a_newcomer_is_weighed_by_its_load_from_files_not_its_last_copy_back() -> None:
    # "old": 1 use x 1 s per 500 B. The newcomer, half a use, took 4 s from its
    # files (worth more than "old") and 0.01 s back from the tier (worth less).
    tier = make_tier(1000)
    admit(tier, evicted("old", load_s=1.0), 500)
    newcomer = evicted("new", uses=0.5, load_s=0.01, files_load_s=4.0)
    assert tier.make_room(newcomer, Footprint(600)) == ["old"]
    cheap = evicted("new", uses=0.5, load_s=0.01, files_load_s=0.01)
    assert tier.make_room(cheap, Footprint(600)) is None


def test_a_newcomer_with_only_a_last_load_on_record_is_weighed_by_it() -> None:
    tier = make_tier(1000)
    admit(tier, evicted("old", load_s=1.0), 500)
    assert tier.make_room(evicted("new", uses=0.5, load_s=4.0), Footprint(600)) == ["old"]
    assert tier.make_room(evicted("new", uses=0.5, load_s=0.5), Footprint(600)) is None


def test_a_copy_kept_is_weighed_by_its_load_from_files() -> None:
    # Used alike, "slow" (5 s from its files) is worth more than "quick" (1 s),
    # although "quick" was used last: "quick" is the copy dropped.
    tier = make_tier(1000)
    admit(tier, evicted("slow", last_used=0.0, load_s=0.01, files_load_s=5.0), 400)
    admit(tier, evicted("quick", last_used=1.0, files_load_s=1.0), 400)
    assert tier.make_room(evicted("new", uses=10.0), Footprint(400)) == ["quick"]
