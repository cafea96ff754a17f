"""Activation room (``room.py``): the pool beside every model while all fit,
the budget less a model's weights otherwise, within its cap; what never fits."""

from __future__ import annotations

import asyncio

import pytest

from builders import make_spec
from tessera.errors import ModelTooLargeError, RequestTooLargeError
from tessera.footprint import Footprint
from tessera.repository import ModelSpec
from tessera.request import QueuedRequest
from tessera.residency.activation import ActivationBook
from tessera.residency.catalogue import Catalogue
from tessera.residency.room import ActivationRoom


def estimate(spec: ModelSpec) -> Footprint:
    return Footprint(int(spec.options["own_bytes"]))


def make_room(budget: int, *specs: ModelSpec) -> tuple[ActivationRoom, Catalogue, ActivationBook]:
    catalogue, book = Catalogue(estimate), ActivationBook()
    for spec in specs:
        catalogue.register(spec)
    return ActivationRoom(budget, catalogue, book), catalogue, book


def test_while_every_model_fits_a_batch_takes_at_most_the_pool_beside_them() -> None:
    a, b = make_spec("a", 300), make_spec("b", 400)
    room, _, _ = make_room(1000, a, b)
    assert room.for_batch(a) == 300
    assert room.most(a) == 700


def test_under_pressure_a_batch_may_take_the_budget_less_its_own_weights() -> None:
    a, b = make_spec("a", 300), make_spec("b", 800)
    room, _, _ = make_room(1000, a, b)
    assert room.for_batch(a) == 700
    assert room.for_batch(b) == 200


def test_the_room_is_within_the_models_cap() -> None:
    capped = make_spec("capped", 300, max_bytes=350)
    room, _, _ = make_room(1000, capped)
    assert room.most(capped) == 50
    assert room.for_batch(capped) == 50


def test_weights_over_the_cap_or_budget_never_fit_and_a_batch_beside_them_is_too_large() -> None:
    spec = make_spec("a", 300, max_bytes=500)
    room, _, _ = make_room(1000, spec)
    room.check_fits(spec, Footprint(300), 200)
    with pytest.raises(RequestTooLargeError):
        room.check_fits(spec, Footprint(300), 201)
    with pytest.raises(ModelTooLargeError, match="over its cap of 500 bytes"):
        room.check_fits(spec, Footprint(501), 0)
    loose = make_spec("loose", 300)
    with pytest.raises(ModelTooLargeError, match="over the whole budget of 1000 bytes"):
        room.check_fits(loose, Footprint(1001), 0)


def test_only_proven_needs_refuse_a_request_for_good() -> None:
    spec = make_spec("a", 300)
    room, catalogue, book = make_room(1000, spec)
    book.observe("a", 800, 1.0)
    book.observe("a", 800, 1.0)
    room.raise_if_never_fits(spec, 1.0)  # not measured yet: an estimate refuses nothing
    catalogue.measure("a", Footprint(300))
    with pytest.raises(RequestTooLargeError):
        room.raise_if_never_fits(spec, 1.0)


async def test_a_batch_over_the_room_is_planned_in_parts_the_single_request_cut_to_most() -> None:
    spec = make_spec("a", 600)
    room, _, book = make_room(1000, spec, make_spec("b", 100))
    book.observe("a", 100, 1.0)
    book.observe("a", 100, 1.0)  # 100 bytes a unit; the pool beside both is 300
    loop = asyncio.get_running_loop()
    batch = [QueuedRequest([i], 1.0, 0.0, loop.create_future()) for i in range(4)]
    parts = room.plan_batch(spec, batch)
    assert [len(p.requests) for p in parts] == [2, 2]
    assert [p.activation_bytes for p in parts] == [200, 200]
    (huge,) = room.plan_batch(spec, [QueuedRequest([0], 9.0, 0.0, loop.create_future())])
    assert huge.activation_bytes == room.most(spec) == 400
