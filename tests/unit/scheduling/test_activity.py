"""Each tenant's activity on a model, judged by its own pace (``TenantActivity``)."""

from __future__ import annotations

import heapq
from unittest import mock

from tessera.scheduling.activity import (
    ACTIVE_GAPS,
    MAX_ACTIVE_S,
    PACE_ARRIVALS,
    SLACK,
    TenantActivity,
)


def test_a_first_arrival_is_active_for_the_horizon_alone() -> None:
    activity = TenantActivity(horizon_s=1.0)
    activity.arrived("a", 0.0)
    assert activity.num_active(1.0) == 1
    assert activity.num_active(1.001) == 0


def test_a_paced_tenant_stays_active_for_several_of_its_gaps() -> None:
    activity = TenantActivity(horizon_s=1.0)
    for i in range(10):
        activity.arrived("quiet", 2.0 * i)  # every 2 s: its last at 18 s
    window = ACTIVE_GAPS * 2.0
    assert activity.num_active(18.0 + window - 0.01) == 1
    assert activity.num_active(18.0 + window + 0.01) == 0


def test_parts_of_one_request_are_one_arrival() -> None:
    activity = TenantActivity(horizon_s=1.0)
    activity.arrived("flood", 0.0)
    activity.arrived("flood", 4.0)
    for _ in range(8):  # a request's parts share its arrival: no gap of 0
        activity.arrived("flood", 4.0)
    assert activity.num_active(4.0 + ACTIVE_GAPS * 4.0 - 0.01) == 1
    activity.arrived("flood", 8.0)  # gaps of 4 s, the parts no gap of their own
    assert activity.num_active(8.0 + ACTIVE_GAPS * 4.0 - 0.01) == 1


def test_a_pace_is_the_mean_gap_over_the_last_arrivals_only() -> None:
    activity = TenantActivity(horizon_s=1.0)
    arrivals = [0.0] + [0.1 + 2.0 * i for i in range(PACE_ARRIVALS)]  # 0.1 s, then 2 s gaps
    for at in arrivals:
        activity.arrived("a", at)
    # The first arrival, close to the second, is no longer in the pace: 2 s,
    # not the shorter mean gap of all nine.
    last = arrivals[-1]
    assert activity.num_active(last + ACTIVE_GAPS * 2.0 - 0.01) == 1
    assert activity.num_active(last + ACTIVE_GAPS * 2.0 + 0.01) == 0


def test_a_tenant_seen_within_the_longest_window_keeps_its_pace_past_a_prune() -> None:
    activity = TenantActivity(horizon_s=1.0)
    activity.arrived("a", 0.0)
    for i in range(SLACK):  # others, all at once, exactly the longest window later: a prune
        activity.arrived(f"t{i}", MAX_ACTIVE_S)
    activity.arrived("a", 70.0)  # a gap of 70 s: active for the longest window
    assert activity.num_active(70.0 + MAX_ACTIVE_S - 0.01) == 1


def test_a_slow_pace_is_capped() -> None:
    activity = TenantActivity(horizon_s=1.0)
    activity.arrived("rare", 0.0)
    activity.arrived("rare", 1000.0)
    assert activity.num_active(1000.0 + MAX_ACTIVE_S - 0.01) == 1
    assert activity.num_active(1000.0 + MAX_ACTIVE_S + 0.01) == 0


def test_a_tenant_back_after_a_lull_keeps_the_lull_in_its_pace() -> None:
    activity = TenantActivity(horizon_s=1.0)
    activity.arrived("a", 0.0)
    activity.arrived("a", 2.0)  # a gap of 2 s: active until 12 s
    assert activity.num_active(20.0) == 0
    activity.arrived("a", 30.0)  # back after a lull: 2 gaps in 30 s, five of them capped
    activity.arrived("a", 30.1)  # a close one after: its window does not shrink
    assert activity.num_active(30.0 + MAX_ACTIVE_S - 0.01) == 1
    assert activity.num_active(30.0 + MAX_ACTIVE_S + 0.01) == 0


def test_a_tenant_not_seen_for_the_longest_window_starts_afresh() -> None:
    activity = TenantActivity(horizon_s=1.0)
    activity.arrived("a", 0.0)
    activity.arrived("a", 2.0)
    for i in range(200):  # others' arrivals, long after: "a" is pruned on the way
        activity.arrived(f"t{i}", 100.0 + i)
    activity.arrived("a", 300.0)
    assert activity.num_active(301.0) == 1 + 0  # "a" alone: the others' windows ended
    assert not activity.active_other_than("a", 301.001)
    assert activity.num_active(301.001) == 0  # the horizon alone: no gap of 298 s


def test_counts_tenants_not_arrivals_and_holds_only_the_active() -> None:
    activity = TenantActivity(horizon_s=1.0)
    prune = mock.patch.object(
        TenantActivity, "_prune", autospec=True, side_effect=TenantActivity._prune
    )
    with prune as prunes:
        for i in range(1000):  # each tenant: two arrivals 0.5 s apart, active 2.5 s after
            activity.arrived(f"t{i}", float(i))
            activity.arrived(f"t{i}", float(i) + 0.5)
            # Tenants seen in the last 60 s (61 at a prune), twice over, and slack.
            assert len(activity._arrivals) <= 2 * 61 + SLACK
    # Pruned once the tenants are twice the live ones and SLACK more, not at each arrival.
    assert prunes.call_count <= 1000 // (61 + SLACK) + 1
    assert ACTIVE_GAPS * 0.5 == 2.5
    assert activity.num_active(999.5) == 3  # t997 (until 1000.0), t998, t999
    assert len(activity._ends) <= 2 * 3 + SLACK  # what ended was let go


def test_one_tenants_many_arrivals_hold_a_heap_rebuilt_once_in_a_while() -> None:
    # Each arrival extends the activity and files its end; the ends it
    # replaced are let go once they are SLACK more than twice the live ones.
    activity = TenantActivity(horizon_s=1.0)
    with mock.patch.object(heapq, "heapify", wraps=heapq.heapify) as heapify:
        for i in range(300):
            activity.arrived("a", float(i))
            assert len(activity._ends) <= 2 * 1 + SLACK
    assert heapify.call_count <= 300 // SLACK


def test_another_tenant_is_active_only_if_it_is_not_the_one_asking() -> None:
    activity = TenantActivity(horizon_s=1.0)
    activity.arrived("flood", 0.0)
    assert not activity.active_other_than("flood", 0.5)
    assert activity.active_other_than("quiet", 0.5)
    activity.arrived("quiet", 0.5)
    assert activity.active_other_than("flood", 1.2)  # "flood"'s activity has ended
    assert not activity.active_other_than("quiet", 1.2)
