"""Pareto dominance and the hypervolume indicator (Zitzler & Thiele 1998, through Optuna's own implementation) of
points that are minimised (`minimised`: values with directions as such a point): the one measure of a front that
`headsearch report` (the anytime curve) and the simulator (a replay's score) share."""
from __future__ import annotations

from typing import Sequence

from headsearch.search.optuna_private import compute_hypervolume


def minimised(values: Sequence[float], directions: Sequence[str]) -> list[float]:
    """`values` as a point to minimise: a maximised one negated, any other kept."""
    return [-v if d == "maximize" else v for v, d in zip(values, directions)]


def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    """`a` is no worse than `b` on every (minimised) value and better on one."""
    return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))


def front_indices(points: Sequence[Sequence[float]]) -> list[int]:
    """The indices of the points (minimised) that no other point dominates, in order."""
    return [i for i, p in enumerate(points) if not any(dominates(q, p) for q in points)]


def hypervolume(points: Sequence[Sequence[float]], reference: Sequence[float]) -> float:
    """Optuna's hypervolume of `points` (minimised) up to `reference`; 0 for no points."""
    return compute_hypervolume(points, reference) if points else 0.0


def scale_minimised(values: Sequence[Sequence[float]], directions: Sequence[str]) -> list[list[float]]:
    """Every objective turned into one to minimise and scaled to [0, 1] over `values` (0 where all agree)."""
    signed = [minimised(row, directions) for row in values]
    if not signed:
        return []
    lo = [min(col) for col in zip(*signed)]
    hi = [max(col) for col in zip(*signed)]
    return [[(v - a) / (b - a) if b > a else 0.0 for v, a, b in zip(row, lo, hi)] for row in signed]
