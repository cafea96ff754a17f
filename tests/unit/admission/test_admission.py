"""Tenant admission with a fake clock and a fake wall clock."""

from __future__ import annotations

import pytest

from builders import make_admission
from tessera.admission import TenantLimits
from tessera.errors import PayloadTooLargeError, RateLimitedError


def test_token_bucket_allows_burst_then_refills_at_rate() -> None:
    controller, clock, _ = make_admission()
    limits = TenantLimits("t", qps=2.0, burst=2)
    controller.admit(limits, 1)
    controller.admit(limits, 1)
    for _ in range(10):
        with pytest.raises(RateLimitedError) as info:
            controller.admit(limits, 1)
        assert info.value.reason == "rate"
        assert 0 < info.value.retry_after_s <= 0.5
        assert info.value.limit == 2.0
    clock.advance(0.5)
    controller.admit(limits, 1)
    with pytest.raises(RateLimitedError):
        controller.admit(limits, 1)


def test_concurrency_limit_counts_in_flight_until_released() -> None:
    controller, _, _ = make_admission()
    limits = TenantLimits("t", max_concurrency=2)
    first = controller.admit(limits, 1)
    controller.admit(limits, 1)
    with pytest.raises(RateLimitedError) as info:
        controller.admit(limits, 1)
    assert info.value.reason == "concurrency"
    controller.release(first)
    controller.admit(limits, 1)
    assert controller.in_flight("t") == 2


def test_daily_quota_in_work_units_resets_at_utc_midnight() -> None:
    day = 86_400.0
    controller, _, wall = make_admission(wall_start=10 * day + 100)
    limits = TenantLimits("t", daily_units=100)
    controller.admit(limits, 60)
    with pytest.raises(RateLimitedError) as info:
        controller.admit(limits, 50)
    assert info.value.reason == "quota"
    assert "daily quota" in str(info.value)
    assert info.value.reset_s == pytest.approx(day - 100)
    wall.now = 11 * day + 1
    controller.admit(limits, 90)


def test_a_request_over_the_whole_quota_is_too_large_not_early() -> None:
    controller, _, _ = make_admission()
    limits = TenantLimits("t", daily_units=5)
    with pytest.raises(PayloadTooLargeError, match="needs 7 work units, more than"):
        controller.admit(limits, 7)
    controller.admit(limits, 5)  # nothing was charged for it


def test_quota_seeded_from_audit_after_restart() -> None:
    controller, _, _ = make_admission()
    controller.seed_usage("t", 95)
    with pytest.raises(RateLimitedError):
        controller.admit(TenantLimits("t", daily_units=100), 10)


def test_changed_limits_apply_without_restart() -> None:
    controller, _, _ = make_admission()
    controller.admit(TenantLimits("t", qps=1.0, burst=1), 1)
    with pytest.raises(RateLimitedError):
        controller.admit(TenantLimits("t", qps=1.0, burst=1), 1)
    controller.admit(TenantLimits("t", qps=100.0, burst=50), 1)


def test_settle_charges_what_ran_in_place_of_the_estimate() -> None:
    controller, _, wall = make_admission()
    limits = TenantLimits("t", daily_units=100)
    stopped = controller.admit(limits, 60)  # a generation admitted at its estimate
    with pytest.raises(RateLimitedError):
        controller.admit(limits, 50)
    controller.settle(stopped, 12)  # its caller left after 12 units ran
    never_ran = controller.admit(limits, 50)
    controller.settle(never_ran, 0)  # dropped before it ran: nothing
    with pytest.raises(RateLimitedError) as info:
        controller.admit(limits, 89)
    assert "(12 used" in str(info.value)
    # One admitted yesterday and settled today is charged to today, where its
    # audit row is written; yesterday's estimate went with yesterday.
    late = controller.admit(limits, 80)
    wall.now += 86_400
    controller.settle(late, 30)
    with pytest.raises(RateLimitedError) as info:
        controller.admit(limits, 71)
    assert "(30 used" in str(info.value)


def test_a_quota_refusal_made_by_estimates_in_flight_says_to_retry_soon() -> None:
    controller, _, _ = make_admission()
    limits = TenantLimits("t", daily_units=100)
    chat = controller.admit(limits, 90)  # a prompt and its max_tokens, held in flight
    with pytest.raises(RateLimitedError) as info:
        controller.admit(limits, 20)
    assert info.value.retry_after_s == 1.0
    assert info.value.reset_s is not None
    assert info.value.reset_s > 1.0
    assert "hold 90 of the 90 counted" in str(info.value)
    controller.settle(chat, 12)  # it wrote 12 tokens, not 90
    controller.admit(limits, 20)
    controller.release(chat)
