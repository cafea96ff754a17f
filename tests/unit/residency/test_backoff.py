"""Backoff of failed loads (``backoff.py``): doubling within a cap, reset by a
success, the public reason only; on a fake clock."""

from __future__ import annotations

import pytest

from tessera.clock import FakeClock
from tessera.errors import ModelUnavailableError
from tessera.residency.backoff import LOAD_FAILED, LoadBackoff


def test_each_failure_in_a_row_doubles_the_wait_within_the_cap() -> None:
    backoff = LoadBackoff(FakeClock(), retry_s=1.0, max_retry_s=5.0)
    assert [backoff.fail("m", LOAD_FAILED) for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff.fail("other", LOAD_FAILED) == 1.0  # each model its own row


def test_a_success_ends_the_row() -> None:
    backoff = LoadBackoff(FakeClock(), retry_s=1.0, max_retry_s=60.0)
    backoff.fail("m", LOAD_FAILED)
    backoff.fail("m", LOAD_FAILED)
    backoff.succeeded("m")
    backoff.raise_if_waiting("m")  # no retry time left
    assert backoff.fail("m", LOAD_FAILED) == 1.0


def test_callers_are_refused_with_the_public_reason_until_the_retry_time() -> None:
    clock = FakeClock()
    backoff = LoadBackoff(clock, retry_s=2.0, max_retry_s=60.0)
    backoff.raise_if_waiting("m")  # never failed
    backoff.fail("m", "over its cap")
    clock.advance(0.5)
    with pytest.raises(ModelUnavailableError) as info:
        backoff.raise_if_waiting("m")
    assert info.value.name == "m"
    assert info.value.reason == "over its cap; retried in 1.5s"
    assert info.value.retry_after_s == pytest.approx(1.5)
    clock.advance(1.5)
    backoff.raise_if_waiting("m")  # the retry time has come


def test_each_failure_tells_its_own_reason() -> None:
    clock = FakeClock()
    backoff = LoadBackoff(clock, retry_s=1.0, max_retry_s=60.0)
    backoff.fail("m", "first")
    backoff.fail("m", "second")
    with pytest.raises(ModelUnavailableError, match="second; retried in 2s"):
        backoff.raise_if_waiting("m")
