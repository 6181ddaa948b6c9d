"""headsearch.analysis.stats: the numbers of `headsearch compare`, against cases worked out by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from scipy import stats

from headsearch.analysis.stats import bootstrap_ci, mean_std, paired_difference, paired_t_test
from headsearch.search.report import spearman

# make test-oldest runs this module on the floor: SciPy: the t-test and Spearman's rho.
pytestmark = pytest.mark.floor


def test_mean_and_sample_std():
    assert mean_std([1.0, 2.0, 3.0, 4.0]) == (2.5, pytest.approx(math.sqrt(5 / 3)))  # squares 2.25+0.25+0.25+2.25 = 5, / 3
    m, s = mean_std([0.7])
    assert m == 0.7 and math.isnan(s)


@pytest.mark.parametrize("t", [0.5, 1.0, 2.0, 6.3138, 40.0])
def test_the_t_test_matches_the_closed_forms_of_one_and_two_degrees_of_freedom(t):
    # d = (1 - c, 1 + c): mean 1, sd c sqrt 2, t = 1 / c: df = 1 is the Cauchy distribution, P(|T| > t) = 1 - (2 / pi) atan(t).
    c = 1 / t
    assert paired_t_test([1 - c, 1 + c]) == pytest.approx(1 - 2 / math.pi * math.atan(t), abs=1e-12)
    # d = (1 - c, 1, 1 + c): mean 1, sd c, t = sqrt 3 / c; df = 2: P(|T| > t) = 1 - t / sqrt(2 + t^2).
    c = math.sqrt(3) / t
    assert paired_t_test([1 - c, 1.0, 1 + c]) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-12)


def test_the_t_test_is_scipys_paired_test():
    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 30):
        a, b = rng.normal(0.8, 0.02, n), rng.normal(0.81, 0.02, n)
        assert paired_t_test(b - a) == pytest.approx(stats.ttest_rel(b, a).pvalue, rel=1e-12)


def test_spearman_by_hand_with_ties():
    # x ranks 1, 2, 3, 4 (deviations -1.5, -0.5, 0.5, 1.5); y = (1, 2, 2, 3) ranks 1, 2.5, 2.5, 4 (-1.5, 0, 0, 1.5):
    # rho = sum of products / sqrt(sums of squares) = 4.5 / sqrt(5 * 4.5).
    assert spearman([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 2.0, 3.0]) == pytest.approx(4.5 / math.sqrt(5 * 4.5))
    assert spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert spearman([1.0, 2.0], [1.0, 2.0]) is None  # fewer than 3 pairs
    assert spearman([1.0, 2.0, 3.0], [5.0, 5.0, 5.0]) is None  # a constant side has no ranks to correlate


def test_paired_t_test_by_hand():
    # d = 1, 2, 3: mean 2, sd 1, t = 2 / (1 / sqrt 3) = sqrt 12, df 2: p = 1 - sqrt12 / sqrt14.
    assert paired_t_test([1.0, 2.0, 3.0]) == pytest.approx(1 - math.sqrt(12 / 14), abs=1e-12)
    # d = 1, 3: mean 2, sd sqrt 2, t = 2 / (sqrt2 / sqrt2) = 2, df 1: p = 1 - (2 / pi) atan 2.
    assert paired_t_test([1.0, 3.0]) == pytest.approx(1 - 2 / math.pi * math.atan(2.0), abs=1e-12)
    # The sign does not matter (two-sided).
    assert paired_t_test([-1.0, -3.0]) == paired_t_test([1.0, 3.0])


def test_paired_t_test_without_spread():
    assert paired_t_test([0.0, 0.0, 0.0]) == 1.0  # nothing differs
    assert paired_t_test([0.5, 0.5]) == 0.0  # every seed differs by exactly the same


def test_bootstrap_of_two_differences_spans_them():
    # Resampling two values gives means d1 (1/4), (d1 + d2) / 2 (1/2), d2 (1/4): the 2.5% and 97.5% points are d1 and d2.
    assert bootstrap_ci([1.0, 3.0]) == (1.0, 3.0)


def test_bootstrap_is_seeded_and_close_to_the_normal_interval_for_many_values():
    d = np.random.default_rng(1).normal(0.02, 0.01, size=400)
    lo, hi = bootstrap_ci(d, seed=3)
    assert (lo, hi) == bootstrap_ci(d, seed=3)
    half = 1.96 * d.std(ddof=1) / math.sqrt(d.size)
    assert lo == pytest.approx(d.mean() - half, abs=0.15 * half)
    assert hi == pytest.approx(d.mean() + half, abs=0.15 * half)


def test_paired_difference_is_b_minus_a():
    a, b = [0.80, 0.78, 0.79], [0.81, 0.80, 0.82]  # d = 0.01, 0.02, 0.03
    diff = paired_difference(a, b)
    assert diff.n == 3 and diff.mean_diff == pytest.approx(0.02)
    assert diff.ci95[0] <= diff.mean_diff <= diff.ci95[1]
    assert diff.ci95 == pytest.approx((0.01, 0.03))  # 3 values: the extremes are resampled often enough
    assert diff.p_value == pytest.approx(1 - math.sqrt(12 / 14), abs=1e-9)  # the same t as d = 1, 2, 3
    # The interval excludes 0, but three differences of one sign always do: p = 0.074 says it is not enough.
    assert not diff.distinguishable
    tight = paired_difference([0.80, 0.78, 0.79, 0.81], [0.82, 0.80, 0.81, 0.83])  # d = 0.02 every seed (to rounding): p ~ 0
    assert tight.distinguishable and tight.p_value < 1e-6
    assert paired_difference(b, a).mean_diff == pytest.approx(-0.02)


def test_paired_difference_refuses_unpaired_or_single_seeds():
    with pytest.raises(ValueError, match="same seeds"):
        paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least 2"):
        paired_difference([1.0], [2.0])


def test_the_wilson_interval_by_hand():
    """1 of 10: p = 0.1, z = 1.95996; centre (0.1 + z^2/20) / (1 + z^2/10) = 0.21101, half-width
    z * sqrt(0.009 + z^2/400) / (1 + z^2/10) = 0.19314 -> (0.01788, 0.40415). 0 of 10 starts at 0, 10 of 10 ends at
    1, and nothing observed says nothing: (0, 1)."""
    from headsearch.analysis.stats import wilson_interval

    assert wilson_interval(1, 10) == pytest.approx((0.01788, 0.40415), abs=1e-5)
    low, high = wilson_interval(0, 10)
    assert low == 0 and high == pytest.approx(3.8415 / 13.8415, abs=1e-4)  # z^2 / (n + z^2)
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0) and wilson_interval(0, 0) == (0.0, 1.0)

