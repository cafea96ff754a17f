"""The batch-time predictor's fit and the tiers' parsing, figure by figure."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tessera.errors import ConfigError
from tessera.scheduling import DEFAULT_TIERS, BatchTimePredictor, TierSpec, parse_tiers

# -- BatchTimePredictor -----------------------------------------------------------


def test_predictor_with_one_batch_size_scales_its_mean_time_per_unit() -> None:
    predictor = BatchTimePredictor()
    predictor.observe(10, 0.02)
    predictor.observe(10, 0.04)
    intercept, slope = predictor.coefficients() or (None, None)
    assert intercept == 0.0
    assert slope == pytest.approx(0.003)
    assert predictor.predict(20) == pytest.approx(0.06)


def test_predictor_fits_a_line_exactly() -> None:
    predictor = BatchTimePredictor()
    for units in (1, 2, 4, 8):
        predictor.observe(units, 0.5 + 0.25 * units)
    intercept, slope = predictor.coefficients() or (None, None)
    assert intercept == pytest.approx(0.5)
    assert slope == pytest.approx(0.25)
    assert predictor.predict(0) == pytest.approx(0.5)


def test_predictor_fits_a_line_through_two_batch_sizes_one_unit_apart() -> None:
    predictor = BatchTimePredictor()
    predictor.observe(1, 2.0)
    predictor.observe(2, 3.0)  # the squared deviations sum to 0.5: a real line
    assert predictor.coefficients() == (1.0, 1.0)


def test_predictor_fits_no_line_through_sizes_close_together() -> None:
    predictor = BatchTimePredictor()
    predictor.observe(60, 0.06)
    predictor.observe(64, 1.6)  # slowed by a load beside it
    assert predictor.coefficients() == pytest.approx((0.0, 1.66 / 124))
    assert predictor.predict(80) == pytest.approx(80 * 1.66 / 124)  # not 31 s
    predictor.observe(120, 0.12)  # sizes twice apart: a line, here falling (noise)
    assert predictor.coefficients() == pytest.approx((1.78 / 3, 0.0))


def test_predictor_never_predicts_a_negative_slope_or_intercept() -> None:
    falling = BatchTimePredictor()
    for units, run_s in ((1, 1.0), (2, 0.5), (3, 0.1)):  # bigger batches faster: noise
        falling.observe(units, run_s)
    intercept, slope = falling.coefficients() or (None, None)
    assert slope == 0.0
    assert intercept == pytest.approx(1.6 / 3)  # the mean time

    steep = BatchTimePredictor()
    for units, run_s in ((10, 0.0), (20, 1.0)):  # the line crosses zero at 10 units
        steep.observe(units, run_s)
    intercept, slope = steep.coefficients() or (None, None)
    assert intercept == 0.0
    assert slope == pytest.approx(0.1)


def test_predictor_ignores_empty_batches_and_negative_times() -> None:
    predictor = BatchTimePredictor()
    predictor.observe(0, 1.0)
    predictor.observe(-1, 1.0)
    predictor.observe(5, -0.1)
    assert predictor.num_samples == 0
    assert predictor.coefficients() is None
    assert predictor.predict(5) is None
    predictor.observe(5, 0.0)  # a zero time is a measurement
    assert predictor.num_samples == 1
    assert predictor.predict(5) == 0.0


def test_predictor_forgets_beyond_its_window() -> None:
    predictor = BatchTimePredictor(window=2)
    predictor.observe(10, 100.0)
    predictor.observe(10, 0.01)
    predictor.observe(10, 0.01)
    assert predictor.num_samples == 2
    assert predictor.predict(10) == pytest.approx(0.01)
    assert BatchTimePredictor().num_samples == 0


def test_predictor_default_window_is_256() -> None:
    predictor = BatchTimePredictor()
    predictor.observe(1, 1000.0)
    for _ in range(256):
        predictor.observe(1, 1.0)
    assert predictor.num_samples == 256
    assert predictor.predict(1) == pytest.approx(1.0)


def test_predictor_window_holds_a_batch_at_least() -> None:
    with pytest.raises(ValueError, match=r"^window must be >= 1$"):
        BatchTimePredictor(window=0)


def test_the_rounding_a_huge_run_leaves_is_shed_by_the_recount_every_window() -> None:
    """A run far longer than the others (a batch stalled behind a load)
    swallows theirs in the running sums, and taking it away leaves the sums
    short. The sums are recounted from the samples every ``window`` batches,
    so the batch that pushes it out of the window, the second of the window
    here, finds the fit of what is left exact."""
    predictor = BatchTimePredictor(window=2)
    for run_s in (1.0, 1e17, 1.0, 1.0):
        predictor.observe(1, run_s)
    assert predictor.predict(1) == 1.0


def test_predictor_recounts_once_a_window_and_fits_once_per_batch() -> None:
    """Admission asks for a prediction at every request: the fit is worked
    out once per batch observed, and the sums recounted once a window."""
    predictor = BatchTimePredictor(window=4)
    recount = mock.patch.object(
        BatchTimePredictor, "_recount", autospec=True, side_effect=BatchTimePredictor._recount
    )
    fit = mock.patch.object(
        BatchTimePredictor,
        "_least_squares",
        autospec=True,
        side_effect=BatchTimePredictor._least_squares,
    )
    with recount as recounts, fit as fits:
        for i in range(40):
            predictor.observe(1 + i % 3, 0.1)
            for _ in range(3):
                predictor.predict(2)
    assert recounts.call_count == 10
    assert fits.call_count == 40


def refit(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """The fit recounted from the samples, as the module notes define it."""
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    var_x = sum((x - mean_x) ** 2 for x, _ in samples)
    sizes = [x for x, _ in samples]
    if var_x <= 1e-12 or max(sizes) < 2.0 * min(sizes):
        return 0.0, mean_y / mean_x
    slope = max(sum((x - mean_x) * (y - mean_y) for x, y in samples) / var_x, 0.0)
    return max(mean_y - slope * mean_x, 0.0), slope


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 8),
    st.lists(
        st.tuples(st.sampled_from([1, 2, 3, 8, 32, 64]), st.floats(0.0, 2.0)),
        min_size=1,
        max_size=60,
    ),
)
@example(2, [(1, 1.0), (2, 1.0), (3, 2.0)])  # the smallest size leaves the window
def test_predictor_running_sums_give_the_fit_of_its_window(
    window: int, samples: list[tuple[int, float]]
) -> None:
    # Sums kept as batches come and go (the smallest and largest size too)
    # fit what a recount of the last ``window`` samples fits.
    predictor = BatchTimePredictor(window=window)
    for i, (units, run_s) in enumerate(samples):
        predictor.observe(units, run_s)
        intercept, slope = refit(
            [(float(x), y) for x, y in samples[max(0, i + 1 - window) : i + 1]]
        )
        got = predictor.coefficients()
        assert got is not None
        assert got[0] == pytest.approx(intercept, abs=1e-9)
        assert got[1] == pytest.approx(slope, abs=1e-9)


# -- tiers ---------------------------------------------------------------------


def test_default_tiers() -> None:
    assert parse_tiers(None) == DEFAULT_TIERS
    assert parse_tiers({}) == DEFAULT_TIERS
    assert DEFAULT_TIERS["vip"] == TierSpec("vip", 4.0, 0.25)
    assert DEFAULT_TIERS["standard"] == TierSpec("standard", 2.0, None)
    assert DEFAULT_TIERS["batch"] == TierSpec("batch", 1.0, None)


def test_tier_override_keeps_what_it_does_not_set() -> None:
    tiers = parse_tiers({"vip": {"weight": 8}, "standard": {"latency_target_ms": 500}})
    assert tiers["vip"] == TierSpec("vip", 8.0, 0.25)
    assert tiers["standard"] == TierSpec("standard", 2.0, 0.5)
    assert tiers["batch"] == DEFAULT_TIERS["batch"]
    assert isinstance(tiers["vip"].weight, float)
    assert DEFAULT_TIERS["vip"].weight == 4.0  # the defaults are not changed


def test_new_tier_defaults_to_weight_one_and_no_target() -> None:
    assert parse_tiers({"gold": {}})["gold"] == TierSpec("gold", 1.0, None)
    assert parse_tiers({"gold": {"weight": 3, "latency_target_ms": 50}})["gold"] == TierSpec(
        "gold", 3.0, 0.05
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"vip": 3}, "tier 'vip' must be a mapping"),
        ({"vip": {"weight": 0}}, "tier 'vip': weight must be positive"),
        ({"vip": {"weight": -1}}, "weight must be positive"),
        ({"vip": {"weight": "heavy"}}, "weight must be positive"),
        ({"vip": {"latency_target_ms": 0}}, "tier 'vip': latency_target_ms must be positive"),
        ({"vip": {"latency_target_ms": -5}}, "latency_target_ms must be positive"),
        ({"vip": {"latency_target_ms": "fast"}}, "latency_target_ms must be positive"),
    ],
)
def test_invalid_tiers_are_config_errors(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_tiers(raw)
    assert message in str(info.value)


def test_smallest_valid_figures_are_accepted() -> None:
    tiers = parse_tiers({"t": {"weight": 0.001, "latency_target_ms": 0.5}})
    assert tiers["t"] == TierSpec("t", 0.001, 0.0005)


def test_a_line_is_given_only_over_sizes_far_enough_apart() -> None:
    """Batches all of one size show no fixed cost: parts sized from them
    would stay too small for a batch ever to show it."""
    predictor = BatchTimePredictor()
    for _ in range(4):
        predictor.observe(25, 0.025)
    assert predictor.coefficients() == (0.0, 0.001)  # the mean per unit
    assert predictor.line() is None
    predictor.observe(200, 0.06)
    line = predictor.line()
    assert line is not None
    assert line[0] > 0.015  # the fixed cost, seen


def test_a_line_is_given_from_two_batches_exactly_the_spread_apart() -> None:
    predictor = BatchTimePredictor()
    predictor.observe(1, 2.0)
    assert predictor.line() is None  # one batch: no line
    predictor.observe(2, 3.0)  # twice the size: a line at once
    assert predictor.line() == (1.0, 1.0)
