"""Throttling of failed authentication per client address, on a fake clock."""

from __future__ import annotations

import pytest

from tessera.clock import FakeClock
from tessera.tenants.throttle import AuthThrottle


def test_past_the_threshold_failures_wait_until_the_oldest_leaves_the_window() -> None:
    clock = FakeClock()
    throttle = AuthThrottle(clock, max_failures=3, window_s=10.0)
    for _ in range(3):
        assert throttle.failed("10.0.0.1") is None  # the first three are plain 401s
        clock.advance(1.0)
    assert throttle.failed("10.0.0.1") == pytest.approx(7.0)  # the oldest was at 0
    assert throttle.retry_after_s("10.0.0.1") == pytest.approx(7.0)
    assert throttle.retry_after_s("10.0.0.2") is None  # another address is not held
    assert throttle.failed("10.0.0.2") is None
    # Throttled attempts are not counted: the wait does not grow with hammering.
    for _ in range(50):
        assert throttle.failed("10.0.0.1") == pytest.approx(7.0)
    clock.advance(7.0)
    assert throttle.retry_after_s("10.0.0.1") is None
    assert throttle.failed("10.0.0.1") is None  # the window slid: one more is allowed
    assert throttle.failed("10.0.0.1") == pytest.approx(1.0)  # the next oldest, at 1


def test_memory_is_bounded_under_rotating_addresses() -> None:
    clock = FakeClock()
    throttle = AuthThrottle(clock, max_failures=2, window_s=60.0, max_addresses=100)
    throttle.failed("victim")
    throttle.failed("victim")
    for i in range(10_000):
        throttle.failed(f"rotating-{i}")
    assert len(throttle) == 100
    # The oldest addresses went first: the earliest rotating ones, and "victim".
    assert throttle.retry_after_s("victim") is None
    throttle.failed("rotating-9999")
    assert throttle.retry_after_s("rotating-9999") is not None


def test_an_address_that_fails_again_counts_as_recent() -> None:
    clock = FakeClock()
    throttle = AuthThrottle(clock, max_failures=2, window_s=60.0, max_addresses=2)
    throttle.failed("a")
    throttle.failed("b")
    throttle.failed("a")  # "a" is now the most recent; "b" goes first
    throttle.failed("c")
    assert throttle.retry_after_s("a") is not None
    throttle.failed("b")
    assert throttle.retry_after_s("b") is None  # forgotten: one failure only


@pytest.mark.parametrize("settings", [{"max_failures": 0}, {"window_s": 0.0}, {"max_addresses": 0}])
def test_settings_must_be_positive(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="positive"):
        AuthThrottle(FakeClock(), **settings)  # type: ignore[arg-type]
