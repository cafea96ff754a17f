"""The waiting line for room (``line.py``): tickets in order of arrival, shared
load places, the loads next in line and backfilling."""

from __future__ import annotations

from tessera.residency.line import LoadPlace, NextLoad, WaitingLine
from tessera.residency.patience import Patience


def test_the_head_is_the_place_that_began_to_wait_first() -> None:
    line = WaitingLine()
    first, second = object(), object()
    assert line.head() is None
    line.join(first, 10)
    line.join(second, 20)
    line.join(first, 30)  # waiting again keeps its ticket
    assert line.head() is first
    assert line.behind(second)
    assert not line.behind(first)
    assert line.leave(first) == 0
    assert line.head() is second
    assert not line.behind(second)
    assert len(line) == 1


def test_a_place_out_of_line_is_behind_anyone_in_it() -> None:
    line = WaitingLine()
    outside = object()
    assert not line.behind(outside)  # an empty line holds no one up
    line.join(object(), 10)
    assert line.behind(outside)


def test_a_ticket_held_before_keeps_its_place() -> None:
    line = WaitingLine()
    early = object()
    line.join(early, 10)
    later = object()
    line.join(later, 10)
    ticket = line.leave(early)
    assert ticket is not None
    line.join(LoadPlace("m"), 100, ticket=ticket)  # the batch hands its place to the reload
    assert line.head() == LoadPlace("m")
    assert line.behind(later)


def test_leaving_tells_whether_a_ticket_was_held() -> None:
    line = WaitingLine()
    assert line.leave(object()) is None
    assert not line


def test_callers_loading_one_model_share_a_place() -> None:
    line = WaitingLine()
    line.join(LoadPlace("m"), 100)
    line.join(LoadPlace("m"), 150)
    assert len(line) == 1
    assert LoadPlace("m") in line
    assert LoadPlace("other") not in line


def test_the_loads_next_in_line_are_those_behind_in_order_and_loads_only() -> None:
    line = WaitingLine()
    head = object()
    line.join(head, 5)
    line.join(LoadPlace("a"), 100)
    line.join(object(), 7)  # a batch: not a load
    line.join(LoadPlace("b"), 200)
    line.join(LoadPlace("c"), 300)
    assert line.loads_next(head, 2) == [NextLoad("a", 100), NextLoad("b", 200)]
    assert line.loads_next(LoadPlace("a"), 5) == [NextLoad("b", 200), NextLoad("c", 300)]
    assert line.loads_next(LoadPlace("c"), 5) == []


def test_the_first_patience_a_place_joins_with_is_kept() -> None:
    line = WaitingLine()
    place = object()
    line.join(place, 10, Patience(5.0))
    line.join(place, 10, Patience(1.0))
    assert line.patience_ends_before(5.5)
    assert not line.patience_ends_before(5.0)
    line.leave(place)
    assert not line.patience_ends_before(100.0)


def test_a_batch_passes_only_while_the_pool_still_holds_each_older_need() -> None:
    line = WaitingLine()
    older = object()
    line.join(older, 600)
    batch = object()
    line.join(batch, 100)
    assert line.may_pass(batch, 100, pool_bytes=700)  # 700 - 100 leaves the 600 waited for
    assert not line.may_pass(batch, 101, pool_bytes=700)
    line.passed_bytes = 50  # batches that passed before still run
    assert not line.may_pass(batch, 100, pool_bytes=700)
    assert line.may_pass(older, 700, pool_bytes=750)  # no one older than the head


def test_a_newer_place_does_not_hold_up_an_older_one() -> None:
    line = WaitingLine()
    older = object()
    line.join(older, 10)
    line.join(object(), 10_000)
    assert line.may_pass(older, 100, pool_bytes=100)


def test_no_load_is_next_behind_a_place_out_of_line() -> None:
    line = WaitingLine()
    line.join(LoadPlace("a"), 100)
    assert line.loads_next(object(), 5) == []
