"""The choice of victims (``victim.py``): what is never evicted, waiting for a
busy model cheaper to evict while patient, room for the loads next in line;
over a real table and the cost policy, on a fake clock."""

from __future__ import annotations

import pytest

from tessera.clock import FakeClock
from tessera.footprint import Footprint
from tessera.residency import make_eviction_policy
from tessera.residency.fresh import FreshModels
from tessera.residency.patience import BatchEnds, Patience
from tessera.residency.table import ResidencyTable
from tessera.residency.victim import VictimChooser, Victims


class Setup:
    def __init__(self, budget: int = 1000) -> None:
        self.clock = FakeClock(100.0)
        self.table = ResidencyTable(budget)
        self.fresh = FreshModels(self.clock)
        self.ends = BatchEnds(self.clock)
        self.chooser = VictimChooser(
            self.table, make_eviction_policy("cost", self.clock), self.clock, self.fresh, self.ends
        )

    def ready(self, name: str, num_bytes: int, *, uses: int = 0, target_s: float = 1.0) -> None:
        """``name`` loaded (in 1 s), used ``uses`` times."""
        self.table.entry(name, target_s=target_s)
        assert self.table.begin_load(name, Footprint(num_bytes))
        self.table.mark_ready(name, self.clock.now(), 1.0)
        for _ in range(uses):
            reservation = self.table.reserve(name, 0, self.clock.now())
            assert reservation is not None
            self.table.release(reservation, self.clock.now())

    def pin(self, name: str) -> None:
        assert self.table.reserve(name, 0, self.clock.now()) is not None

    def patient(self) -> Patience:
        return Patience(self.clock.now() + 1.0)

    def impatient(self) -> Patience:
        return Patience(self.clock.now())


def test_nothing_is_chosen_when_nothing_is_short() -> None:
    setup = Setup()
    setup.ready("a", 300)
    assert setup.chooser.for_caller(0, "x", setup.patient()) == Victims(None)
    assert setup.chooser.for_caller(-5, "x", setup.patient()) == Victims(None)


def test_the_callers_own_kept_fresh_and_pinned_models_are_never_chosen() -> None:
    setup = Setup()
    for name in ("own", "kept", "fresh", "pinned", "idle"):
        setup.ready(name, 100)
    setup.chooser.keep("kept")
    setup.fresh.add("fresh")
    setup.pin("pinned")
    chosen = setup.chooser.for_caller(100, "own", setup.impatient())
    assert chosen == Victims(["idle"])
    assert setup.chooser.for_caller(200, "own", setup.impatient()) == Victims(None)
    # For a load's measured bytes any idle model may go but kept, fresh or pinned ones.
    assert setup.chooser.to_settle(200) == ["own", "idle"]
    assert setup.chooser.to_settle(300) is None


def test_a_model_no_longer_kept_may_be_chosen() -> None:
    setup = Setup()
    setup.ready("old", 100)
    setup.chooser.keep("old")
    assert setup.chooser.to_settle(100) is None
    setup.chooser.keep("old", kept=False)
    assert setup.chooser.to_settle(100) == ["old"]


def test_a_patient_caller_waits_for_a_busy_model_cheaper_to_evict() -> None:
    setup = Setup()
    setup.ready("busy", 300, uses=1, target_s=10.0)  # a reload is a tenth of its target
    setup.ready("idle", 300, uses=5, target_s=0.2)  # a reload is five of its targets
    setup.pin("busy")
    assert setup.chooser.for_caller(300, "x", setup.patient()) == Victims(["idle"], wait=True)
    assert setup.chooser.for_caller(300, "x", setup.impatient()) == Victims(["idle"])


def test_a_caller_does_not_wait_for_a_busy_model_dearer_to_evict() -> None:
    setup = Setup()
    setup.ready("busy", 300, uses=5, target_s=0.2)
    setup.ready("idle", 300, uses=1, target_s=10.0)
    setup.pin("busy")
    assert setup.chooser.for_caller(300, "x", setup.patient()) == Victims(["idle"])


def test_a_caller_does_not_wait_for_a_busy_model_that_costs_as_much_to_evict() -> None:
    # Each used once (the pin is the busy one's use), alike in bytes and target.
    setup = Setup()
    setup.ready("busy", 300)
    setup.ready("idle", 300, uses=1)
    setup.pin("busy")
    assert setup.chooser.for_caller(300, "x", setup.patient()) == Victims(["idle"])


def test_the_wait_ends_with_the_busy_models_predicted_batch() -> None:
    setup = Setup()
    setup.ready("busy", 300, uses=1, target_s=10.0)
    setup.ready("idle", 300, uses=5, target_s=0.2)
    setup.pin("busy")
    setup.ends.start("busy", 0.1)
    patience = Patience(setup.clock.now() + 1.0)
    assert setup.chooser.for_caller(300, "x", patience).wait
    assert patience.until == pytest.approx(setup.clock.now() + 0.2)
    setup.clock.advance(0.2)
    assert not setup.chooser.for_caller(300, "x", patience).wait


def test_the_wait_ends_with_the_busy_models_batch_when_idle_ones_would_go_beside_it() -> None:
    # The cheapest room is the busy model and a cheap idle one beside it; only
    # the busy one's batch bounds the wait (an idle model has no batch to end).
    setup = Setup()
    setup.ready("busy", 300, uses=1, target_s=10.0)
    setup.ready("cheap", 100, uses=1, target_s=10.0)
    setup.ready("dear", 400, uses=5, target_s=0.2)
    setup.pin("busy")
    setup.ends.start("busy", 0.1)
    patience = Patience(setup.clock.now() + 1.0)
    assert setup.chooser.for_caller(400, "x", patience) == Victims(["cheap", "dear"], wait=True)
    assert patience.until == pytest.approx(setup.clock.now() + 0.2)


def test_a_load_does_not_wait_for_a_model_that_is_still_loading() -> None:
    setup = Setup()
    setup.ready("idle", 300, uses=5, target_s=0.2)
    setup.table.entry("loading", target_s=10.0)
    assert setup.table.begin_load("loading", Footprint(300))
    batch = setup.chooser.for_caller(300, "x", setup.patient())
    load = setup.chooser.for_caller(300, "x", setup.patient(), load=True)
    assert batch == Victims(["idle"], wait=True)
    assert load == Victims(["idle"])


def test_room_for_the_loads_next_in_line_comes_from_idle_models_only_where_they_hold_it() -> None:
    setup = Setup()
    setup.ready("a", 100)
    setup.clock.advance(1.0)
    setup.ready("b", 100)
    ahead = setup.chooser.for_caller(100, "x", setup.impatient(), ahead_bytes=100)
    assert ahead == Victims(["a", "b"])
    too_much = setup.chooser.for_caller(100, "x", setup.impatient(), ahead_bytes=500)
    assert too_much == Victims(["a"])  # its own need still met
