"""How a metric ranks trials: which way is better (`metric_direction`), how well two rankings agree (`spearman`)."""
from __future__ import annotations

import math

from headsearch.errors import HeadsearchError


def metric_direction(task: str | None, metric: str | None) -> str | None:
    """The direction ("maximize" or "minimize") of `task`'s `metric`; None when either is unknown."""
    if not task or not metric:
        return None
    try:
        from headsearch.tasks import get_task

        return get_task(task).metric(metric).direction
    except HeadsearchError:
        return None


def spearman(x: list[float], y: list[float], *, min_pairs: int = 3, nan_last: bool = False,
             undefined: float | None = None) -> float | None:
    """Spearman's rank correlation (SciPy's, ties averaged); `undefined` with fewer than `min_pairs` pairs or a
    constant side (no ranks to correlate). `nan_last`: NaN ranks after every number (else the result is NaN)."""
    from scipy import stats

    if nan_last:
        x, y = ([math.inf if math.isnan(v) else v for v in side] for side in (x, y))
    if len(x) < min_pairs or len(set(x)) < 2 or len(set(y)) < 2:
        return undefined
    return float(stats.spearmanr(x, y)[0])
