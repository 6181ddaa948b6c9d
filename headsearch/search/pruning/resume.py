"""When a paused trial should go on (--pruner-pause): its curve projected to the last epoch against the front.

A rung rule pauses a trial on what it shows at the rung; whether that was a mistake shows later, in the trials
that did go on. `could_reach_front` asks, of a trial paused at epoch ``e``: with the gain the finished trials at
least as slow an epoch made from ``e`` to their end (bigger models learn later: the fast ones that finish first
would undersell a slow starter), or the largest gain any finished trial made while fewer than three slower ones
have finished, would its end be dominated by a finished trial's? Its time at the end is known exactly (its
epoch seconds), so only its quality is projected. This is freeze-thaw's question (Swersky et al. 2014,
"Freeze-Thaw Bayesian Optimization") answered with an empirical learning-curve model: the study's own curves
rather than a fitted kernel, and a front rather than one best value.

The settings were chosen with the simulator (benchmarks/resume_rule.py, RESULTS.md "issue 51"): on the 16-epoch
table at 8 workers, crediting all finished trials' gains lost the slow, accurate end of the front as often as
killing did; crediting the slower ones' kept it.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from headsearch.search.hypervolume import dominates
from headsearch.search.pruning.progress import Progress, curve_noise, progress_point
from headsearch.search.pruning.rules import best_so_far

PAUSE_NOISE_MARGIN = 0.0  # the Pareto rule's noise margin with --pruner-pause: plain dominance (issue 51)
RESUME_QUANTILE = 0.25  # the quantile of those gains a paused trial is credited with
RESUME_SIGMAS = 0.0  # and this many sigmas of the curves' noise (`curve_noise`) on top
RESUME_FINISHED = 3  # finished trials needed before their gains are trusted
# Whose gains: "all" the finished trials, or "slower" those at least as slow an epoch (bigger models learn later),
# the largest of all while fewer than RESUME_FINISHED are
RESUME_GAINS = "slower"


def gain_after(epoch: int, finished: Sequence[Progress], direction: str) -> list[float]:
    """Each finished trial's gain in best value from `epoch` to its last epoch, in the better direction (>= 0)."""
    sign = 1.0 if direction == "maximize" else -1.0
    gains = []
    for p in finished:
        if epoch not in p.curve:
            continue
        before, after = best_so_far(p.curve, epoch, direction), best_so_far(p.curve, max(p.curve), direction)
        if math.isfinite(before) and math.isfinite(after):
            gains.append(sign * (after - before))
    return gains


def projected_end(rule, epoch: int, mine: Progress, others: Sequence[Progress], quantile: float | None = None,
                  sigmas: float | None = None, gains: str | None = None) -> tuple[Progress, int] | None:
    """Trial `mine`, paused at `epoch`, projected to the finished trials' last epoch: its curve with the hoped-for
    best value added there, and that epoch. None when that cannot be told yet: fewer than `RESUME_FINISHED`
    finished trials with a value at `epoch`, or no finite best value of its own. `quantile`, `sigmas`, `gains`:
    the module's RESUME_* when None."""
    finished = _finished(others, mine.number)
    credited = gain_after(epoch, finished, rule.direction)
    if len(credited) < RESUME_FINISHED or epoch not in mine.curve:
        return None
    if (RESUME_GAINS if gains is None else gains) == "slower" and mine.epoch_seconds is not None:
        slower = [o for o in finished if o.epoch_seconds is not None and o.epoch_seconds >= mine.epoch_seconds]
        theirs = gain_after(epoch, slower, rule.direction)
        credited = theirs if len(theirs) >= RESUME_FINISHED else [max(credited)]
    last = max(max(o.curve) for o in finished)
    quantile = RESUME_QUANTILE if quantile is None else quantile
    sigmas = RESUME_SIGMAS if sigmas is None else sigmas
    margin = sigmas * (curve_noise([mine.curve, *(o.curve for o in finished)], epoch) or 0.0) if sigmas else 0.0
    best = best_so_far(mine.curve, epoch, rule.direction)
    if not math.isfinite(best):
        return None
    sign = 1.0 if rule.direction == "maximize" else -1.0
    hopeful = best + sign * (float(np.quantile(credited, quantile)) + margin)
    return Progress({**dict(mine.curve), last: hopeful}, mine.params, mine.epoch_seconds, mine.number), last


def stands_on_front(rule, projected: Progress, last: int, others: Sequence[Progress]) -> bool | None:
    """Whether `projected` (`projected_end`'s curve) at epoch `last` is dominated by no finished trial's end among
    `others` (`rule`: for its kinds and direction). None when its point cannot be told (its epoch seconds not
    known)."""
    point = progress_point(rule.kinds, rule.direction, last, projected)
    if point is None:
        return None
    ends = [q for o in _finished(others, projected.number)
            if (q := progress_point(rule.kinds, rule.direction, max(o.curve), o)) is not None]
    return not any(dominates(q, point) for q in ends)


def could_reach_front(rule, epoch: int, mine: Progress, others: Sequence[Progress],
                      quantile: float | None = None, sigmas: float | None = None, gains: str | None = None) -> bool | None:
    """Whether trial `mine`, paused at `epoch`, projected to the last epoch (`projected_end`) could still stand on
    the front of the finished trials (`stands_on_front`). None when that cannot be told yet, False when it has no
    finite best value."""
    if epoch in mine.curve and not math.isfinite(best_so_far(mine.curve, epoch, rule.direction)):
        return False
    projection = projected_end(rule, epoch, mine, others, quantile, sigmas, gains)
    return None if projection is None else stands_on_front(rule, *projection, others)


def _finished(others: Sequence[Progress], mine: int | None) -> list[Progress]:
    """The finished trials with a curve, trial `mine` left out."""
    return [o for o in others if o.finished and o.curve and o.number != mine]
