"""Statistics of multi-seed comparisons: means, spreads, paired differences with a bootstrap interval and
a paired t-test (`headsearch compare`).

A comparison trains every config with the same seeds 0..N-1, so two configs' runs pair up by seed: the
seed fixes the data split, the data order, the augmentation draws and, for configs of equal shapes, the
initial weights. The paired difference d_s = b_s - a_s removes what the seed alone moves, which is why
pairs, not two independent samples, are compared.

- Bootstrap interval (Efron & Tibshirani 1993, the percentile method): resample the N differences with
  replacement `resamples` times, take the mean of each resample, and report the 2.5th and 97.5th
  percentiles of those means. Seeded: the same numbers give the same interval.
- Paired t-test (Student 1908): t = mean(d) / (sd(d) / sqrt(N)), two-sided p-value from Student's t with
  N - 1 degrees of freedom, computed here through the regularised incomplete beta function (no SciPy):
  P(|T| > t) = I_{df / (df + t^2)}(df / 2, 1 / 2).

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


def paired_difference(a: Sequence[float], b: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                      seed: int = 0, level: float = LEVEL) -> PairedDifference:
    """The paired difference b - a of two configs' values on the same seeds (a[i] and b[i]: seed i)."""
    if len(a) != len(b):
        raise ValueError(f"paired values need the same seeds: {len(a)} and {len(b)} values")
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    if d.size < 2:
        raise ValueError("a paired difference needs at least 2 seeds")
    return PairedDifference(int(d.size), float(d.mean()), bootstrap_ci(d, resamples=resamples, seed=seed, level=level),
                            paired_t_test(d))


def bootstrap_ci(d: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                 level: float = LEVEL) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `d` (Efron & Tibshirani 1993)."""
    x = np.asarray(d, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)


def paired_t_test(d: Sequence[float]) -> float:
    """Two-sided p-value of the paired t-test that the mean of the differences `d` is 0 (Student 1908).

    All differences equal: no spread to test against, so p is 1 when they are 0 and 0 otherwise."""
    x = np.asarray(d, dtype=np.float64)
    n = x.size
    mean, sd = float(x.mean()), float(x.std(ddof=1))
    if sd == 0.0 or not math.isfinite(sd):
        return 1.0 if mean == 0.0 else 0.0
    t = mean / (sd / math.sqrt(n))
    return student_t_two_sided(t, n - 1)


def student_t_two_sided(t: float, df: int) -> float:
    """P(|T| > |t|) for Student's t with `df` degrees of freedom."""
    if df < 1:
        raise ValueError("Student's t needs at least 1 degree of freedom")
    return regularized_beta(df / (df + t * t), df / 2.0, 0.5)


def regularized_beta(x: float, a: float, b: float) -> float:
    """The regularised incomplete beta function I_x(a, b), by its continued fraction (Lentz's method), on the
    side where it converges fast (x < (a + 1) / (a + b + 2)), else through I_x(a, b) = 1 - I_{1-x}(b, a)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(x, a, b) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(1.0 - x, b, a) / b


def _beta_fraction(x: float, a: float, b: float, steps: int = 300, eps: float = 1e-15) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, steps + 1):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return f
