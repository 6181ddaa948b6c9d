"""Statistics of multi-seed comparisons: means, spreads, paired differences with a bootstrap interval and
a paired t-test (`headsearch compare`).

A comparison trains every config with the same seeds 0..N-1, so two configs' runs pair up by seed: the
seed fixes the data split, the data order, the augmentation draws and, for configs of equal shapes, the
initial weights. The paired difference d_s = b_s - a_s removes what the seed alone moves, which is why
pairs, not two independent samples, are compared.

- Bootstrap interval (Efron & Tibshirani 1993, the percentile method): resample the N differences with
  replacement `BOOTSTRAP_RESAMPLES` times, take the mean of each resample, and report the 2.5th and 97.5th
  percentiles of those means. Seeded: the same numbers give the same interval.
- Paired t-test (Student 1908): t = mean(d) / (sd(d) / sqrt(N)), two-sided p-value from Student's t with
  N - 1 degrees of freedom (SciPy's `ttest_1samp` on the differences, which is `ttest_rel` on the pairs).

Both promise little with N = 2 or 3 seeds: an interval from two differences spans them, one from three
of the same sign excludes 0 whatever their spread (a quarter of the time when nothing differs), and a
t-test with one or two degrees of freedom needs a large t. So a difference counts as distinguishable
only when both agree: the interval excludes 0 and p < 0.05.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 10_000
LEVEL = 0.95


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (N - 1 in the denominator; NaN for one value)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan
    return float(x.mean()), float(x.std(ddof=1)) if x.size > 1 else math.nan


@dataclass(frozen=True)
class PairedDifference:
    """b - a over paired seeds: the mean difference, its bootstrap interval, the t-test's p-value."""

    n: int
    mean_diff: float
    ci95: tuple[float, float]
    p_value: float

    @property
    def distinguishable(self) -> bool:
        """More than the seeds' spread explains: the interval excludes 0 and the t-test's p < 0.05.

        Both, because the percentile bootstrap is too narrow with a few seeds: with 3, three differences
        of one sign always give an interval that excludes 0, which happens a quarter of the time when
        nothing differs. The t-test accounts for how few they are."""
        return distinguishable(self.ci95, self.p_value)


ALPHA = 0.05


def distinguishable(ci95: Sequence[float], p_value: float) -> bool:
    """A paired difference's interval excludes 0 and its p-value is below ALPHA (see PairedDifference)."""
    lo, hi = ci95
    return (lo > 0 or hi < 0) and p_value < ALPHA


def paired_difference(a: Sequence[float], b: Sequence[float], *, seed: int = 0) -> PairedDifference:
    """The paired difference b - a of two configs' values on the same seeds (a[i] and b[i]: seed i)."""
    if len(a) != len(b):
        raise ValueError(f"paired values need the same seeds: {len(a)} and {len(b)} values")
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    if d.size < 2:
        raise ValueError("a paired difference needs at least 2 seeds")
    return PairedDifference(int(d.size), float(d.mean()), bootstrap_ci(d, seed=seed), paired_t_test(d))


def bootstrap_ci(d: Sequence[float], *, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval (at LEVEL) of the mean of `d` (Efron & Tibshirani 1993)."""
    x = np.asarray(d, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(BOOTSTRAP_RESAMPLES, x.size))].mean(axis=1)
    tail = (1.0 - LEVEL) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)


def paired_t_test(d: Sequence[float]) -> float:
    """Two-sided p-value of the paired t-test that the mean of the differences `d` is 0 (Student 1908), by
    SciPy. All differences equal: no spread to test against (SciPy says NaN), so p is 1 when they are 0 and
    0 otherwise."""
    from scipy import stats

    x = np.asarray(d, dtype=np.float64)
    mean, sd = float(x.mean()), float(x.std(ddof=1))
    if sd == 0.0 or not math.isfinite(sd):
        return 1.0 if mean == 0.0 else 0.0
    return float(stats.ttest_1samp(x, 0.0).pvalue)


def wilson_interval(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The Wilson score interval (Wilson 1927) of a proportion k/n at `level`: p̂ = k/n, z the normal quantile,
    centre (p̂ + z²/2n) / (1 + z²/n), half-width z·sqrt(p̂(1 - p̂)/n + z²/4n²) / (1 + z²/n). Unlike p̂ ± z·se it
    stays inside [0, 1] and is not empty at k = 0 or k = n; (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    from scipy.stats import norm

    z = float(norm.ppf(0.5 + level / 2))
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)

