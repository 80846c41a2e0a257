"""Experiment statistics on synthetic curves with known answers."""

import math

import pytest

from unbubble.experiments.stats import (iso_loss_overhead, loss_at, loss_at_fraction, mean_curve, mean_std, rms_std,
                                        slowdown, smooth, time_to_target)


def test_mean_std():
    assert mean_std([2.0, 4.0, 6.0]) == (4.0, 2.0)
    assert mean_std([3.0]) == (3.0, 0.0)


def test_rms_std_of_constant_offsets():
    # runs differ by ±1 at every step: the across-run sample std is sqrt(2)… at every step
    a = [5.0, 4.0, 3.0]
    runs = [[v - 1 for v in a], a, [v + 1 for v in a]]
    assert rms_std(runs) == pytest.approx(1.0)
    runs = [[1.0, 1.0], [1.0, 3.0]]  # variances 0 and 2 → sqrt(mean) = 1
    assert rms_std(runs) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        rms_std([a])


def test_time_to_target_interpolates_the_crossing():
    curve = [(0, 5.0), (10, 3.0), (20, 2.0), (30, 1.0)]
    assert time_to_target(curve, 2.5) == pytest.approx(15.0)
    assert time_to_target(curve, 3.0) == 10.0
    assert time_to_target(curve, 6.0) == 0.0
    assert time_to_target(curve, 0.5) is None
    # exponential decay y = e^{-x}: the target e^{-2} is crossed at x = 2 between grid points 1 and 3
    exp_curve = [(x, math.exp(-x)) for x in (0, 1, 3)]
    x = time_to_target(exp_curve, math.exp(-2))
    assert 1 < x < 3


def test_slowdown_and_smooth():
    assert slowdown({1: 100.0, 8: 150.0, 32: None}) == {1: 1.0, 8: 1.5, 32: None}
    assert smooth([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5]


def test_loss_at_fraction_is_the_smoothed_loss_at_that_step():
    # a plateau at 3.0 for 4 steps, then 2.0: half of 10 steps is step 5, whose 2-point mean is (3 + 2) / 2
    losses = [3.0] * 4 + [2.0] * 6
    assert loss_at_fraction(losses, 0.5, 2) == 2.5
    assert loss_at_fraction(losses, 0.6, 2) == 2.0
    assert loss_at_fraction(losses, 0.4, 2) == 3.0
    assert loss_at_fraction(losses, 0.45, 1) == 2.0  # ⌈4.5⌉ = step 5
    assert loss_at_fraction(losses, 1.0, 10) == pytest.approx(2.4)
    with pytest.raises(ValueError):
        loss_at_fraction(losses, 0.0, 2)


def test_iso_loss_overhead_on_known_curves():
    # the baseline ends at 2.0 after 100 tokens; this method passes 2.0 at 150 tokens (linear between points)
    method = [(0, 5.0), (100, 2.5), (200, 1.5)]
    assert iso_loss_overhead(method, 2.0, 100) == (pytest.approx(1.5), True)
    # ahead of the baseline: 2.0 is reached at 50 tokens
    assert iso_loss_overhead([(0, 5.0), (50, 2.0), (100, 1.0)], 2.0, 100) == (0.5, True)
    # never reached: a lower bound, last tokens ÷ baseline tokens
    assert iso_loss_overhead([(0, 5.0), (120, 2.1)], 2.0, 100) == (pytest.approx(1.2), False)
    with pytest.raises(ValueError):
        iso_loss_overhead([], 2.0, 100)
    with pytest.raises(ValueError):
        iso_loss_overhead(method, 2.0, 0)


def test_mean_curve_and_loss_at():
    a = [(0, 4.0), (10, 2.0), (20, None)]
    b = [(0, 2.0), (10, 4.0), (20, 1.0)]
    assert mean_curve([a, b]) == [(0, 3.0), (10, 3.0)]  # the point with a missing value is dropped
    with pytest.raises(ValueError):
        mean_curve([a, [(0, 1.0), (5, 1.0), (20, 1.0)]])
    with pytest.raises(ValueError):
        mean_curve([])
    curve = [(0, 4.0), (10, 2.0), (30, 1.0)]
    assert loss_at(curve, 5) == 3.0
    assert loss_at(curve, 20) == 1.5
    assert loss_at(curve, 30) == 1.0
    assert loss_at(curve, 31) is None and loss_at(curve, -1) is None
