"""The residency table's running totals against a recount from its entries.

The table keeps used, activation and shared-component bytes as totals changed
with each transition (a recount at every reservation cost O(models)). After
any sequence of calls each figure must equal a count made from scratch: own
and activation bytes of holding models, each component their footprints name
once (at the largest size a holder gives it), and what evicting a set of
models or loading one with a footprint would free or add; and never over the
budget, holders that disagree on a component's size included.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.footprint import Footprint
from tessera.residency import ModelState, ResidencyTable
from tessera.residency.table import HOLDING, Reservation

NAMES = ["a", "b", "c", "d"]
footprints = st.builds(
    Footprint,
    st.integers(0, 300),
    st.dictionaries(st.sampled_from(["enc", "dec", "graphs"]), st.sampled_from([50, 80, 200])),
)
step = st.one_of(
    st.tuples(st.just("begin_load"), st.sampled_from(NAMES), footprints),
    st.tuples(st.just("settle_load"), st.sampled_from(NAMES), footprints),
    st.tuples(st.sampled_from(["mark_ready", "fail", "unload", "finish"]), st.sampled_from(NAMES)),
    st.tuples(st.sampled_from(["reserve", "release"]), st.sampled_from(NAMES), st.integers(0, 90)),
)


def recount_shared(table: ResidencyTable, skip: set[str]) -> dict[str, int]:
    held: dict[str, int] = {}
    for e in table.entries.values():
        if e.state in HOLDING and e.name not in skip:
            for key, num_bytes in e.footprint.shared_bytes.items():
                held[key] = max(held.get(key, 0), num_bytes)
    return held


def recount_used(table: ResidencyTable, skip: set[str]) -> int:
    own = sum(
        e.footprint.own_bytes + e.activation_bytes
        for e in table.entries.values()
        if e.state in HOLDING and e.name not in skip
    )
    return own + sum(recount_shared(table, skip).values())


def apply(table: ResidencyTable, held: list[Reservation], call: tuple[object, ...]) -> None:
    kind, name = call[0], str(call[1])
    entry = table.entries.get(name)
    state = entry.state if entry is not None else ModelState.UNLOADED
    if kind == "begin_load" and state not in HOLDING:
        assert isinstance(call[2], Footprint)
        table.begin_load(name, call[2])
    elif kind == "settle_load" and state is ModelState.LOADING:
        assert isinstance(call[2], Footprint)
        table.settle_load(name, call[2])
    elif kind == "mark_ready" and state is ModelState.LOADING:
        table.mark_ready(name, 0.0)
    elif kind == "fail" and state is ModelState.LOADING:
        table.fail(name, "broken")
    elif kind == "unload" and state is ModelState.READY and entry is not None and not entry.pins:
        table.begin_unload(name, eviction=True)
    elif kind == "finish" and state is ModelState.UNLOADING:
        table.finish_unload(name)
    elif kind == "reserve" and state is ModelState.READY:
        assert isinstance(call[2], int)
        reservation = table.reserve(name, call[2], 0.0)
        if reservation is not None:
            held.append(reservation)
    elif kind == "release":
        mine = [r for r in held if r.name == name]
        if mine:
            held.remove(mine[0])
            table.release(mine[0], 0.0)


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=40), footprints)
def test_totals_equal_a_recount_after_any_calls(
    calls: list[tuple[object, ...]], probe: Footprint
) -> None:
    table = ResidencyTable(budget_bytes=1000)
    held: list[Reservation] = []
    for call in calls:
        apply(table, held, call)
        assert table.used_bytes() == recount_used(table, set()) <= 1000
        activation = sum(e.activation_bytes for e in table.entries.values())
        assert table.activation_bytes_held() == activation == sum(r.num_bytes for r in held)
        for victims in ({"a"}, {"a", "b"}, set(NAMES), {"z"}):
            assert table.freed_by(victims) == table.used_bytes() - recount_used(table, victims)
        for name in NAMES:
            others = recount_shared(table, {name})
            entry = table.entries.get(name)

            def unshared(f: Footprint, others: dict[str, int] = others) -> int:
                return f.own_bytes + sum(
                    max(0, v - others.get(k, 0)) for k, v in f.shared_bytes.items()
                )

            current = unshared(entry.footprint) if entry and entry.state in HOLDING else 0
            assert table.extra_bytes(name, probe) == unshared(probe) - current
