"""A request refused for good (413) before it queues: only once the model's
weights are measured and two real batches of no more units needed more than
fits beside them, within the budget or the model's cap. The refusal carries
the figures a client needs. Fake models, a fake clock."""

from __future__ import annotations

import pytest

from builders import make_spec
from harness.fake_host import FakeModelHost
from tessera.clock import FakeClock
from tessera.errors import RequestTooLargeError
from tessera.residency import ResidencyManager, make_eviction_policy


def make_manager(budget: int) -> ResidencyManager:
    clock = FakeClock()
    return ResidencyManager(budget, FakeModelHost(clock), make_eviction_policy("lru"), clock)


async def test_batches_measured_before_the_weights_refuse_nothing() -> None:
    manager = make_manager(1000)
    spec = make_spec("m", 600, estimate_bytes=600)
    manager.observe_batch("m", 900, 40)
    manager.observe_batch("m", 900, 40)
    manager.raise_if_never_fits(spec, 40)  # 600 + 900 > 1000, but the weights are a guess
    await manager.ensure_loaded(spec)
    with pytest.raises(RequestTooLargeError):
        manager.raise_if_never_fits(spec, 40)


async def test_the_refusal_says_what_the_batch_needs_beside_which_weights_within_what() -> None:
    manager = make_manager(1000)
    spec = make_spec("m", 600, estimate_bytes=100)
    await manager.ensure_loaded(spec)
    manager.observe_batch("m", 450, 40)
    manager.observe_batch("m", 500, 40)
    with pytest.raises(RequestTooLargeError) as refused:
        manager.raise_if_never_fits(spec, 40)
    error = refused.value
    assert (error.name, error.activation_bytes, error.weights_bytes, error.limit_bytes) == (
        "m",
        450,  # the lower of the two: both batches needed that much at least
        600,  # measured, not the estimate of 100
        1000,
    )
    assert str(error) == (
        "request to model 'm' needs 450 bytes of activations beside 600 bytes of weights,"
        " over the whole budget of 1,000 bytes: it could never run; send fewer or shorter inputs"
    )
    manager.raise_if_never_fits(spec, 39)  # no batch of 39 units or fewer was measured


async def test_a_batch_that_fits_the_budget_exactly_is_not_refused() -> None:
    manager = make_manager(1000)
    spec = make_spec("m", 600)
    await manager.ensure_loaded(spec)
    manager.observe_batch("m", 400, 10)
    manager.observe_batch("m", 400, 10)
    manager.raise_if_never_fits(spec, 10)  # 600 + 400 = 1000
    manager.observe_batch("m", 401, 10)
    manager.raise_if_never_fits(spec, 10)  # one batch of 401 may have been a one-off
    manager.observe_batch("m", 401, 10)
    with pytest.raises(RequestTooLargeError) as refused:
        manager.raise_if_never_fits(spec, 10)
    assert refused.value.activation_bytes == 401


async def test_the_models_cap_refuses_before_the_budget() -> None:
    manager = make_manager(10_000)
    spec = make_spec("capped", 600, max_bytes=700)
    await manager.ensure_loaded(spec)
    manager.observe_batch("capped", 150, 10)
    manager.observe_batch("capped", 150, 10)
    with pytest.raises(RequestTooLargeError) as refused:
        manager.raise_if_never_fits(spec, 10)
    assert (refused.value.activation_bytes, refused.value.limit_bytes) == (150, 700)
    assert "over its cap of 700 bytes" in str(refused.value)


async def test_more_units_than_any_measured_batch_are_refused_by_the_largest_two() -> None:
    manager = make_manager(1000)
    spec = make_spec("m", 600)
    await manager.ensure_loaded(spec)
    for peak, units in ((100, 10), (420, 20), (500, 30)):
        manager.observe_batch("m", peak, units)
    manager.raise_if_never_fits(spec, 25)  # of 25 units or fewer: 420 and 100, so 100 is proven
    with pytest.raises(RequestTooLargeError) as refused:
        manager.raise_if_never_fits(spec, 1_000)
    assert refused.value.activation_bytes == 420  # the lower of 500 and 420
