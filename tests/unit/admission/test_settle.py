"""Settling an admission in this process's controller: the day's count takes
what a request is finally charged in place of its estimate, never goes below
zero, and the estimates still held in flight are exactly those not settled.
Fake clock and fake wall clock; the figures are read from the refusals that
report them."""

from __future__ import annotations

import pytest

from builders import make_admission
from tessera.admission import AdmissionController, TenantLimits
from tessera.admission.limits import DAY_S, HELD_RETRY_S, Admission
from tessera.errors import RateLimitedError

QUOTA = TenantLimits("t", daily_units=100)


def refusal(controller: AdmissionController, units: float) -> RateLimitedError:
    with pytest.raises(RateLimitedError) as info:
        controller.admit(QUOTA, units)
    return info.value


def test_settling_for_a_tenant_never_admitted_changes_nothing() -> None:
    controller, _, wall = make_admission()
    controller.settle(Admission("ghost", 5.0, int(wall.now // DAY_S)), 50.0)
    assert controller.in_flight("ghost") == 0
    controller.admit(TenantLimits("ghost", daily_units=100), 100)  # nothing was counted


def test_settling_below_the_estimate_counts_exactly_what_ran() -> None:
    controller, _, _ = make_admission()
    admission = controller.admit(QUOTA, 60)
    controller.settle(admission, 12)
    error = refusal(controller, 89)  # 12 + 89 > 100
    assert "(12 used, this request needs 89)" in str(error)
    assert error.remaining == 88
    controller.admit(QUOTA, 88)  # 12 + 88 = 100: exactly the quota


def test_settling_above_the_estimate_counts_exactly_what_ran() -> None:
    controller, _, _ = make_admission()
    controller.settle(controller.admit(QUOTA, 10), 25)
    assert "(25 used" in str(refusal(controller, 76))
    controller.admit(QUOTA, 75)


def test_a_request_settled_at_nothing_leaves_the_whole_quota() -> None:
    controller, _, _ = make_admission()
    controller.settle(controller.admit(QUOTA, 50), 0)
    controller.admit(QUOTA, 100)  # nothing counted: not even a fraction of a unit
    assert "hold 100 of the 100 counted" in str(refusal(controller, 1))


def test_a_settled_request_no_longer_holds_its_estimate_in_flight() -> None:
    controller, _, _ = make_admission()
    first = controller.admit(QUOTA, 60)
    controller.admit(QUOTA, 30)  # still in flight, unsettled: holds 30
    controller.settle(first, 60)
    error = refusal(controller, 20)  # 90 + 20 > 100, but 90 - 30 + 20 fits
    assert "hold 30 of the 90 counted" in str(error)
    assert error.retry_after_s == HELD_RETRY_S


def test_once_every_request_in_flight_is_settled_a_refusal_waits_for_the_day() -> None:
    controller, _, wall = make_admission(wall_start=3 * DAY_S + 400.0)
    controller.settle(controller.admit(QUOTA, 60), 60)  # settled, not yet released
    assert controller.in_flight("t") == 1
    # 60 + 41 is one unit over: no estimate is held, so retrying soon cannot help.
    error = refusal(controller, 41)
    assert "has used its daily quota of 100 work units (60 used" in str(error)
    assert error.retry_after_s == pytest.approx(DAY_S - 400.0)
    assert wall.now == 3 * DAY_S + 400.0


def test_settling_never_takes_the_count_below_zero() -> None:
    controller, _, _ = make_admission()
    admission = controller.admit(QUOTA, 50)
    assert controller.take_units() == {"t": 50}  # a shared store took the count over
    controller.settle(admission, 0)  # 0 + 0 - 50: counted as 0, not as a credit
    controller.admit(QUOTA, 100)
    assert "hold 100 of the 100 counted" in str(refusal(controller, 1))


def test_a_request_admitted_yesterday_is_charged_whole_to_today() -> None:
    controller, _, wall = make_admission(wall_start=8 * DAY_S + 10.0)
    late = controller.admit(QUOTA, 80)
    wall.now = 9 * DAY_S + 10.0
    controller.admit(QUOTA, 5)  # today's own: holds 5 in flight
    controller.settle(late, 30)  # today's count gains 30; yesterday's 80 is not taken off
    error = refusal(controller, 70)  # 35 + 70 > 100
    assert "hold 5 of the 35 counted" in str(error)  # yesterday's estimate is not held today


def test_the_first_call_of_a_new_day_may_be_a_settle() -> None:
    controller, _, wall = make_admission(wall_start=8 * DAY_S + 10.0)
    late = controller.admit(QUOTA, 80)
    wall.now = 9 * DAY_S + 10.0
    controller.settle(late, 30)  # the day turns here: yesterday's 80 go, today's 30 count
    assert "(30 used" in str(refusal(controller, 71))
    controller.admit(QUOTA, 70)


def test_a_request_that_would_not_fit_even_once_those_in_flight_settle_waits_for_the_day() -> None:
    controller, _, _ = make_admission()
    controller.settle(controller.admit(QUOTA, 90), 90)
    controller.admit(QUOTA, 10)  # in flight, unsettled: holds 10
    error = refusal(controller, 95)  # 100 - 10 + 95 > 100: its settling cannot make room
    assert "has used its daily quota of 100 work units (100 used" in str(error)
    assert error.retry_after_s is not None
    assert error.retry_after_s > HELD_RETRY_S


def test_a_single_unit_held_in_flight_still_makes_a_refusal_retry_soon() -> None:
    controller, _, _ = make_admission()
    controller.settle(controller.admit(QUOTA, 99), 99)
    controller.admit(QUOTA, 1)  # in flight, unsettled: holds 1
    error = refusal(controller, 1)  # 100 - 1 + 1 fits once it settles
    assert "hold 1 of the 100 counted" in str(error)
    assert error.retry_after_s == HELD_RETRY_S


def test_a_request_answered_but_not_yet_settled_holds_no_estimate_for_a_retry() -> None:
    # Only requests still in flight can settle for less soon.
    controller, _, _ = make_admission()
    controller.release(controller.admit(QUOTA, 90))  # released, its charge not yet settled
    assert controller.in_flight("t") == 0
    error = refusal(controller, 11)
    assert "has used its daily quota of 100 work units (90 used" in str(error)
    assert error.retry_after_s is not None
    assert error.retry_after_s > HELD_RETRY_S


def test_units_taken_over_by_a_shared_store_are_today_s_and_counted_from_zero() -> None:
    controller, _, wall = make_admission(wall_start=8 * DAY_S + 10.0)
    controller.admit(QUOTA, 0.5)
    controller.admit(TenantLimits("old", daily_units=100), 30)
    wall.now = 9 * DAY_S + 10.0
    controller.admit(QUOTA, 20)  # the day turns for "t"; "old" counted yesterday only
    controller.admit(TenantLimits("idle", daily_units=100), 0)  # today, nothing counted
    assert controller.take_units() == {"t": 20}
    assert controller.take_units() == {}  # counted from zero again
    first = controller.admit(QUOTA, 60)
    controller.settle(first, 60)
    error = refusal(controller, 41)  # 60 + 41: nothing else is counted or held
    assert "has used its daily quota of 100 work units (60 used" in str(error)


def test_fractions_of_a_unit_are_taken_over_too() -> None:
    controller, _, _ = make_admission()
    controller.admit(QUOTA, 0.5)
    assert controller.take_units() == {"t": 0.5}
