"""Admission at its edges: the bucket's cap, what a refusal costs, the figures a
429 carries. Fake clock and fake wall clock; each test is one bug it would catch."""

from __future__ import annotations

import math

import pytest

from builders import make_admission
from tessera.admission import AdmissionController, TenantLimits, TokenBucket
from tessera.admission.limits import DAY_S, default_burst
from tessera.errors import RateLimitedError


def refusal(
    controller: AdmissionController, limits: TenantLimits, units: float = 1
) -> RateLimitedError:
    with pytest.raises(RateLimitedError) as info:
        controller.admit(limits, units)
    return info.value


def admitted(controller: AdmissionController, limits: TenantLimits, attempts: int) -> int:
    """How many of ``attempts`` back-to-back requests are admitted."""
    count = 0
    for _ in range(attempts):
        try:
            controller.admit(limits, 1)
        except RateLimitedError:
            continue
        count += 1
    return count


# -- the token bucket ---------------------------------------------------------


def test_bucket_is_capped_at_its_burst_however_long_it_was_idle() -> None:
    controller, clock, _ = make_admission()
    limits = TenantLimits("t", qps=10.0, burst=3)
    assert admitted(controller, limits, 3) == 3
    clock.advance(3600.0)  # an hour idle refills 36 000 tokens without the cap
    assert admitted(controller, limits, 10) == 3


def test_bucket_object_caps_tokens_and_refills_at_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=4, now=0.0)
    assert bucket.tokens == 4.0
    assert all(bucket.try_take(0.0) for _ in range(4))
    assert not bucket.try_take(0.0)
    assert bucket.tokens == 0.0
    bucket.refill(0.25)
    assert bucket.tokens == pytest.approx(0.5)
    assert bucket.updated == 0.25
    bucket.refill(100.0)
    assert bucket.tokens == 4.0


def test_bucket_takes_its_last_whole_token() -> None:
    bucket = TokenBucket(rate=1.0, burst=1, now=0.0)
    assert bucket.try_take(0.0)
    assert not bucket.try_take(0.5)
    assert bucket.try_take(1.0)  # exactly one token refilled: taken
    assert bucket.tokens == pytest.approx(0.0)


def test_bucket_burst_is_at_least_one() -> None:
    bucket = TokenBucket(rate=1.0, burst=0, now=0.0)
    assert bucket.burst == 1.0
    assert bucket.try_take(0.0)


def test_bucket_wait_and_reset_figures() -> None:
    bucket = TokenBucket(rate=4.0, burst=2, now=0.0)
    assert bucket.wait_s() == 0.0
    assert bucket.reset_s() == 0.0
    bucket.try_take(0.0)
    bucket.try_take(0.0)
    assert bucket.wait_s() == pytest.approx(0.25)
    assert bucket.reset_s() == pytest.approx(0.5)
    bucket.refill(0.125)  # half a token
    assert bucket.wait_s() == pytest.approx(0.125)
    assert bucket.reset_s() == pytest.approx(0.375)


def test_bucket_slower_than_one_a_second_still_says_when() -> None:
    bucket = TokenBucket(rate=0.5, burst=2, now=0.0)
    bucket.try_take(0.0)
    bucket.try_take(0.0)
    assert bucket.wait_s() == pytest.approx(2.0)
    assert bucket.reset_s() == pytest.approx(4.0)


def test_bucket_of_zero_rate_never_refills() -> None:
    bucket = TokenBucket(rate=0.0, burst=1, now=0.0)
    assert bucket.try_take(0.0)
    assert bucket.wait_s() == math.inf
    assert bucket.reset_s() == math.inf
    assert not bucket.try_take(1e9)


def test_default_burst_is_one_second_of_rate_rounded_up() -> None:
    controller, _, _ = make_admission()
    assert admitted(controller, TenantLimits("a", qps=2.5), 10) == 3
    assert admitted(controller, TenantLimits("b", qps=0.5), 10) == 1


# -- what a refusal costs ------------------------------------------------------


def test_request_refused_for_rate_charges_no_units_and_holds_no_slot() -> None:
    controller, clock, _ = make_admission()
    limits = TenantLimits("t", qps=1.0, burst=1, max_concurrency=2, daily_units=10)
    first = controller.admit(limits, 4)
    for _ in range(5):
        error = refusal(controller, limits, 4)
        assert error.reason == "rate"
    assert controller.in_flight("t") == 1
    controller.release(first)
    clock.advance(1.0)
    controller.admit(limits, 6)  # 4 + 6 = the whole quota: the refused 20 were not charged
    assert controller.in_flight("t") == 1


def test_request_refused_for_quota_takes_no_token() -> None:
    controller, _, _ = make_admission()
    limits = TenantLimits("t", qps=1.0, burst=2, daily_units=10)
    controller.admit(limits, 8)
    assert refusal(controller, limits, 5).reason == "quota"
    controller.admit(limits, 2)  # the second token is still there


def test_request_refused_for_concurrency_takes_no_token_and_no_units() -> None:
    controller, _, _ = make_admission()
    limits = TenantLimits("t", qps=1.0, burst=2, max_concurrency=1, daily_units=10)
    first = controller.admit(limits, 5)
    assert refusal(controller, limits, 5).reason == "concurrency"
    controller.release(first)
    controller.admit(limits, 5)


def test_quota_admits_a_request_that_uses_it_exactly() -> None:
    controller, _, _ = make_admission()
    limits = TenantLimits("t", daily_units=10)
    controller.admit(limits, 4)
    controller.admit(limits, 6)
    assert refusal(controller, limits, 0.5).reason == "quota"


def test_concurrency_limit_is_exact() -> None:
    controller, _, _ = make_admission()
    limits = TenantLimits("t", max_concurrency=3)
    grants = [controller.admit(limits, 1) for _ in range(3)]
    assert refusal(controller, limits).reason == "concurrency"
    assert controller.in_flight("t") == 3
    controller.release(grants[0])
    assert controller.in_flight("t") == 2


def test_release_never_goes_below_zero_and_ignores_strangers() -> None:
    controller, _, _ = make_admission()
    limits = TenantLimits("t", max_concurrency=1)
    grant = controller.admit(limits, 1)
    controller.release(grant)
    controller.release(grant)  # a double release
    assert controller.in_flight("t") == 0
    controller.admit(limits, 1)
    assert refusal(controller, limits).reason == "concurrency"
    assert controller.in_flight("nobody") == 0
    controller.release(type(grant)("nobody"))  # no state, no error
    assert controller.in_flight("nobody") == 0


def test_unlimited_tenant_is_always_admitted() -> None:
    controller, _, _ = make_admission()
    limits = TenantLimits("free")
    for _ in range(100):
        controller.admit(limits, 1000)
    assert controller.in_flight("free") == 100
    assert controller.remaining(limits) is None


def test_tenants_do_not_share_limits() -> None:
    controller, _, _ = make_admission()
    a = TenantLimits("a", qps=1.0, burst=1, max_concurrency=1, daily_units=5)
    b = TenantLimits("b", qps=1.0, burst=1, max_concurrency=1, daily_units=5)
    grant = controller.admit(a, 5)
    assert grant.tenant == "a"
    controller.admit(b, 5)
    assert controller.in_flight("a") == 1
    assert controller.in_flight("b") == 1


# -- the figures of a 429 ------------------------------------------------------


def test_rate_refusal_says_when_to_retry_and_when_the_bucket_is_full() -> None:
    controller, clock, _ = make_admission()
    limits = TenantLimits("t", qps=4.0, burst=2)
    controller.admit(limits, 1)
    controller.admit(limits, 1)
    clock.advance(0.125)  # half a token back
    error = refusal(controller, limits)
    assert error.reason == "rate"
    assert error.retry_after_s == pytest.approx(0.125)
    assert error.reset_s == pytest.approx(0.375)
    assert error.limit == 4.0
    assert error.remaining == 0
    assert "4 requests/s" in str(error)


def test_concurrency_refusal_figures() -> None:
    controller, _, _ = make_admission()
    limits = TenantLimits("t", max_concurrency=1)
    controller.admit(limits, 1)
    error = refusal(controller, limits)
    assert error.retry_after_s == 1.0
    assert error.limit == 1
    assert error.remaining == 0
    assert "1 requests in flight" in str(error)


def test_quota_refusal_figures() -> None:
    controller, _, wall = make_admission(wall_start=5 * DAY_S + 600.0)
    limits = TenantLimits("t", daily_units=100)
    controller.settle(controller.admit(limits, 70), 70)  # ran whole, still in flight
    error = refusal(controller, limits, 40)
    assert error.remaining == pytest.approx(30.0)
    assert error.limit == 100
    assert error.retry_after_s == pytest.approx(DAY_S - 600.0)
    assert error.reset_s == pytest.approx(DAY_S - 600.0)
    assert "70 used" in str(error)
    assert "needs 40" in str(error)
    wall.now += 300.0
    assert refusal(controller, limits, 40).reset_s == pytest.approx(DAY_S - 900.0)


def test_quota_remaining_is_never_negative() -> None:
    controller, _, _ = make_admission()
    controller.seed_usage("t", 120)  # the audit log says it went over (limit lowered)
    error = refusal(controller, TenantLimits("t", daily_units=100))
    assert error.remaining == 0.0


# -- the day and the seed ------------------------------------------------------


def test_quota_day_is_the_utc_day_not_a_rolling_window() -> None:
    controller, _, wall = make_admission(wall_start=7 * DAY_S - 1.0)  # one second before midnight
    limits = TenantLimits("t", daily_units=10)
    controller.admit(limits, 10)
    assert refusal(controller, limits).reason == "quota"
    wall.now = 7 * DAY_S  # midnight: a new day
    controller.admit(limits, 10)
    wall.now = 8 * DAY_S - 1.0  # still that day
    assert refusal(controller, limits).reason == "quota"


def test_seeded_usage_counts_today_and_only_today() -> None:
    controller, _, wall = make_admission(wall_start=3 * DAY_S + 10.0)
    controller.seed_usage("t", 95)
    limits = TenantLimits("t", daily_units=100)
    controller.admit(limits, 5)  # 95 + 5 fits exactly
    assert refusal(controller, limits).reason == "quota"
    wall.now = 4 * DAY_S
    controller.admit(limits, 100)


def test_seed_before_first_request_keeps_limits_applied_later() -> None:
    controller, _, _ = make_admission()
    controller.seed_usage("t", 0)
    limits = TenantLimits("t", qps=1.0, burst=1)
    controller.admit(limits, 1)
    assert refusal(controller, limits).reason == "rate"


# -- remaining -----------------------------------------------------------------


def test_remaining_counts_whole_tokens_after_refill() -> None:
    controller, clock, _ = make_admission()
    limits = TenantLimits("t", qps=2.0, burst=5)
    assert controller.remaining(limits) is None  # never seen
    for _ in range(5):
        controller.admit(limits, 1)
    assert controller.remaining(limits) == 0
    clock.advance(0.75)  # 1.5 tokens
    assert controller.remaining(limits) == 1
    clock.advance(100.0)
    assert controller.remaining(limits) == 5


def test_changed_rate_starts_a_fresh_bucket_and_same_limits_keep_it() -> None:
    controller, _, _ = make_admission()
    limits = TenantLimits("t", qps=1.0, burst=2)
    controller.admit(limits, 1)
    controller.admit(TenantLimits("t", qps=1.0, burst=2), 1)  # equal limits: the same bucket
    assert refusal(controller, limits).reason == "rate"
    controller.admit(TenantLimits("t", qps=1.0, burst=3), 1)  # changed: a full new bucket
    assert controller.remaining(TenantLimits("t", qps=1.0, burst=3)) == 2


def test_without_a_rate_or_a_burst_the_bucket_holds_one() -> None:
    assert default_burst(TenantLimits("t")) == 1
