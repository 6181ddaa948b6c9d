"""The rules on several objectives: `ParetoRule` (successive halving by Pareto rank, with a noise margin) and
`MultiMetricRule` (OptunaHub's multi_metric_pruner), which judge what is known of a trial while it runs
(`Progress`: its curve, parameters and seconds per epoch), and the curve statistics they share."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from optuna.trial import TrialState

from headsearch.errors import ConfigError
from headsearch.search.hypervolume import dominates, hypervolume
from headsearch.search.pruning.rules import PruneDecision, RungRule, _check_call, _direction, _int, _repr, best_so_far
from headsearch.search.ranks import spearman

# The quantities a multi-objective trial's objectives are known by before it ends (`ParetoRule`'s kinds).
PROGRESS_KINDS = ("quality", "time", "params", "epochs")
NOISE_MARGIN = 0.9  # `ParetoRule`: a trial's quality gets this many sigmas of the noise (issue 39, RESULTS.md)


# ---------------------------------------------------------------------------------------------
# Pareto-aware successive halving (multi-objective studies)


@dataclass(frozen=True)
class Progress:
    """What is known of a trial after some epochs: its curve of the primary metric ``{epoch: value}``,
    its parameter count, and one epoch's training seconds with the device to itself (None: not yet known)."""

    curve: Mapping[int, float]
    params: float | None = None
    epoch_seconds: float | None = None
    number: int | None = None  # the trial's number, to name the trials ranked ahead of one pruned
    finished: bool = False  # trained to its last epoch (COMPLETE, not a duplicate): its curve's best is final


def progress_of(trial: Any) -> Progress:
    """A stored trial's `Progress` (its intermediate values; user_attrs params and epoch_seconds_alone)."""
    a = trial.user_attrs
    finished = trial.state == TrialState.COMPLETE and "duplicate_of" not in a
    return Progress(dict(trial.intermediate_values), a.get("params"), a.get("epoch_seconds_alone"), trial.number, finished)


# `ParetoRule(min_epochs="auto")`: the first rung is the earliest epoch whose ranks predict the final ones.
AUTO_RHO = 0.5  # Spearman's rho an epoch must reach with the finished trials' final values
AUTO_FINISHED = 5  # finished trials needed before the rho is trusted
AUTO_FALLBACK = 3  # the first rung until then (the rule's default)

# The normal distribution's MAD: sigma = 1.4826 * median(|x - median(x)|) for normal x (Hampel 1974).
_MAD_TO_SIGMA = 1.4826
MIN_NOISE_SAMPLES = 4  # residuals needed before the curves' noise is trusted


def curve_noise(curves: Iterable[Mapping[int, float]], epoch: int) -> float | None:
    """The noise of one epoch's value, estimated from the curves' own epoch-to-epoch changes up to `epoch`.

    Each step ``y(e) - y(e - 1)`` of a curve is the learning all trials share at that epoch plus two epochs'
    noise. The step's median over the curves that made it stands for the shared learning; what is left,
    ``r = step - median step``, has variance about ``2 sigma**2``. So ``sigma = 1.4826 * median |r| / sqrt(2)``:
    the median absolute deviation (robust to the few curves that jump; Hampel 1974), pooled over every epoch
    ``2..epoch`` and every curve. None before epoch 2 or with fewer than `MIN_NOISE_SAMPLES` residuals:
    one epoch shows no noise. On the 16-epoch deep-head table this gives about 0.01 in accuracy, the
    spread between seeds about 0.018 (benchmarks/RESULTS.md, issue 39)."""
    residuals: list[float] = []
    for e in range(2, epoch + 1):
        steps = [float(c[e]) - float(c[e - 1]) for c in curves if e in c and e - 1 in c]
        steps = [d for d in steps if math.isfinite(d)]
        if len(steps) < 2:
            continue
        middle = float(np.median(steps))
        residuals += [abs(d - middle) for d in steps]
    if len(residuals) < MIN_NOISE_SAMPLES:
        return None
    return _MAD_TO_SIGMA * float(np.median(residuals)) / math.sqrt(2.0)


def non_dominated_ranks(points: Sequence[Sequence[float]]) -> list[int]:
    """Each point's front in a non-dominated sort (all coordinates minimised): 0 for the points no other
    dominates, 1 for those only front 0 dominates, ... (Deb et al. 2002, NSGA-II's sorting, by peeling)."""
    ranks = [-1] * len(points)
    left = set(range(len(points)))
    front = 0
    while left:
        current = {i for i in left if not any(dominates(points[j], points[i]) for j in left if j != i)}
        for i in current:
            ranks[i] = front
        left -= current
        front += 1
    return ranks


def _nonnegative(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"pruning {name} must be a number >= 0, got {value!r}")
    return float(value)


def _check_kinds(rule: str, kinds: Sequence[str | None]) -> tuple[str | None, ...]:
    bad = [k for k in kinds if k is not None and k not in PROGRESS_KINDS]
    if bad or not any(k is not None for k in kinds):
        raise ConfigError(f"{rule} pruning: objective kinds {list(kinds)} must be among {', '.join(PROGRESS_KINDS)}")
    return tuple(kinds)


def progress_point(kinds: Sequence[str | None], direction: str, epoch: int, p: Progress) -> list[float] | None:
    """A trial's point at `epoch` on the objectives `kinds` names (see `ParetoRule`), every coordinate
    minimised; None when a quantity is not known yet. A curve with no finite value gives quality inf."""
    out = []
    for kind in kinds:
        if kind == "quality":
            best = best_so_far(p.curve, epoch, direction, finite=False)
            out.append(math.inf if math.isnan(best) else -best if direction == "maximize" else best)
        elif kind == "time":
            if p.epoch_seconds is None:
                return None
            out.append(epoch * float(p.epoch_seconds))
        elif kind == "params":
            if p.params is None:
                return None
            out.append(float(p.params))
        elif kind == "epochs":
            out.append(float(epoch))
    return out


def _gate(rule, epoch: int, mine: Progress, others: Sequence[Progress], judged_here: bool):
    """What `ParetoRule` and `MultiMetricRule` check before ranking, in order: warm-up, an epoch the rule
    judges (`judged_here`), enough others, the trial's own point known, quality NaN. Returns the decision
    when one of them decides, else (its point, the others' points at `epoch`, its value, the others judged)."""
    _check_call(epoch, mine.curve)
    value = float(mine.curve[epoch])
    judged = [(o, q) for o, q in ((o, rule.point(epoch, o)) for o in others if epoch in o.curve) if q is not None]
    theirs = [q for _, q in judged]
    n = len(theirs)

    def keep(note: str) -> PruneDecision:
        return PruneDecision(False, rule.rule, epoch, value, None, n, note, judged=False)

    if epoch <= rule.n_warmup_epochs:
        return keep(f"warm-up (epoch {epoch} <= n_warmup_epochs {rule.n_warmup_epochs})")
    if not judged_here:
        return keep("not a rung")
    if n < rule.n_startup_trials:
        return keep(f"too few trials ({n} < {rule.n_startup_trials})")
    own = rule.point(epoch, mine)
    if own is None:
        return keep("its epoch seconds are not known yet")
    if "quality" in rule.kinds and math.isinf(own[rule.kinds.index("quality")]):
        return PruneDecision(True, rule.rule, epoch, value, None, n, "value is NaN")
    return own, theirs, value, [o for o, _ in judged]


class ParetoRule:
    """Multi-objective asynchronous successive halving: at each rung a trial goes on when it is among the
    top ``1/reduction_factor`` of the trials that reached the rung by non-dominated sorting, on every
    objective's value known there (Schmucker et al. 2021, "Multi-objective Asynchronous Successive
    Halving", arXiv 2106.12639: MO-ASHA, here with the trial's own front as its rank). Rule "pareto".

    A trial's point at epoch ``e``, per objective kind (`kinds`, one per study objective; None for an
    objective not known before a trial ends, left out):

    - "quality": the primary metric's best value so far (max when maximizing, min when minimizing);
    - "time": ``e * epoch_seconds`` (its training seconds so far with the device to itself);
    - "params": the parameter count, exactly;
    - "epochs": ``e`` (the same for every trial at a rung: it orders nothing, and is there for the record).

    With ``m = min_epochs``, ``r = reduction_factor``, ``s = n_startup_trials``, ``W = n_warmup_epochs``:

    1. ``epoch <= W``, or ``epoch`` not a rung ``m * r**k`` (m = 3, r = 3: 3, 9, 27, ...) -> no judgement.
    2. the others with a value at ``epoch`` and every known quantity (an other whose epoch seconds are
       not recorded is left out); ``n`` of them. ``n < s`` -> no judgement. A trial whose own point is
       incomplete (its epoch seconds not known) is not judged.
    3. quality NaN -> prune.
    4. dominance beyond noise: the trial's quality is taken ``noise_margin * sigma`` better than it looks
       (sigma: `noise` when given, e.g. the spread between seeds `compare` measured; else `curve_noise` of the
       curves in sight; not known at epoch 1 -> no judgement). A trial within noise of the front is so never
       dominated, and goes on. This is the epsilon-dominance of Laumanns et al. 2002 ("Combining Convergence
       and Diversity in Evolutionary Multiobjective Optimization"), with epsilon the noise the study shows,
       given to the trial judged: optimism under uncertainty, as in a confidence bound.
    5. sort the ``n + 1`` points into fronts; ``better`` = the points in fronts before the trial's. The
       top ``k = ceil((n + 1) / r)`` go on, ties with the trial going to the trial: prune iff
       ``better >= k``. A trial on the first front is never pruned: a trial is pruned only when it is
       dominated, and only when at least ``k`` trials rank ahead of it. The decision names them (`ahead`).

    ``min_epochs="auto"`` (`first_rung`): the first rung is the earliest epoch whose values rank the finished
    trials as their final values do; until 5 have finished, epoch 3.

    The search judges a trial against the COMPLETE, PRUNED and RUNNING trials (every trial that reached the rung,
    as asynchronous successive halving does, Li et al. 2020: with 8 workers the first 8 trials are judged too),
    and never at its last epoch.
    """

    rule = "pareto"

    # Defaults: rungs 3, 9, 27, ..., the top third going on; what benchmarks/search_quality.py measured best on
    # the 16-epoch deep-head table, where the curves cross (epoch 1 ranks the final accuracies backwards, epoch 2
    # barely), without losing on the 4-epoch one (RESULTS.md, issue 29). Rungs 2, 4, 8 lost the slow, most
    # accurate architectures at epoch 2 in about half the replays. The noise margin: issue 39 (RESULTS.md).
    def __init__(self, direction: str, kinds: Sequence[str | None] = ("quality", "time"), min_epochs: int | str = 3,
                 reduction_factor: int = 3, n_startup_trials: int = 3, n_warmup_epochs: int = 0,
                 noise_margin: float = NOISE_MARGIN, noise: float | None = None) -> None:
        self.direction = _direction(direction)
        self.kinds = _check_kinds("pareto", kinds)
        self.auto = min_epochs == "auto"
        self._rungs = RungRule(direction, AUTO_FALLBACK if self.auto else min_epochs, reduction_factor, n_startup_trials)
        self.min_epochs = "auto" if self.auto else self._rungs.min_epochs
        self.reduction_factor = self._rungs.reduction_factor
        self.n_startup_trials = self._rungs.n_startup_trials
        self.n_warmup_epochs = _int("n_warmup_epochs", n_warmup_epochs, 0)
        self.noise_margin = _nonnegative("noise margin", noise_margin)
        self.noise = None if noise is None else _nonnegative("noise", noise)

    def __repr__(self) -> str:
        return _repr(self, "direction", "kinds", "min_epochs", "reduction_factor", "n_startup_trials",
                     "n_warmup_epochs", "noise_margin", "noise")

    def point(self, epoch: int, p: Progress) -> list[float] | None:
        """The trial's point at `epoch`, every coordinate minimised; None when a quantity is not known."""
        return progress_point(self.kinds, self.direction, epoch, p)

    def margin(self, epoch: int, mine: Progress, others: Sequence[Progress]) -> float | None:
        """How much better its quality may truly be than it looks: ``noise_margin * sigma``, sigma the given
        `noise` or else `curve_noise` of every curve in sight. None when sigma cannot be estimated yet."""
        if self.noise_margin == 0:
            return 0.0
        sigma = self.noise if self.noise is not None else curve_noise([mine.curve, *(o.curve for o in others)], epoch)
        return None if sigma is None else self.noise_margin * sigma

    def first_rung(self, others: Sequence[Progress]) -> int | None:
        """The first rung: `min_epochs`, or with ``min_epochs="auto"`` the earliest epoch whose values rank the
        finished trials as their final values do (Spearman's rho >= `AUTO_RHO` over at least `AUTO_FINISHED`
        of them; the value at an epoch the best so far, as judged). Before that many have finished, epoch
        `AUTO_FALLBACK`; None when no epoch ranks them well enough yet (nothing is judged)."""
        if not self.auto:
            return self.min_epochs
        sign = -1.0 if self.direction == "maximize" else 1.0  # minimised, as the points
        finished = [o.curve for o in others if o.finished and o.curve]
        if len(finished) < AUTO_FINISHED:
            return AUTO_FALLBACK
        final = [sign * best_so_far(c, max(c), self.direction) for c in finished]
        for e in range(1, min(max(c) for c in finished)):
            early = [sign * best_so_far(c, e, self.direction) for c in finished]
            if spearman(early, final, min_pairs=2, nan_last=True, undefined=-1.0) >= AUTO_RHO:
                return e
        return None

    def is_rung(self, epoch: int, others: Sequence[Progress]) -> bool:
        first = self.first_rung(others)
        return first is not None and RungRule(self.direction, first, self.reduction_factor).is_rung(epoch)

    def decide(self, epoch: int, mine: Progress, others: Sequence[Progress]) -> PruneDecision:
        gate = _gate(self, epoch, mine, others, self.is_rung(epoch, others))
        if isinstance(gate, PruneDecision):
            return gate
        own, theirs, value, judged = gate
        n = len(theirs)
        margin = self.margin(epoch, mine, judged)
        if margin is None:
            return PruneDecision(False, self.rule, epoch, value, None, n, "the curves' noise is not known yet (one epoch)",
                                 point=tuple(own), judged=False)
        hopeful = list(own)
        if "quality" in self.kinds:  # the benefit of the doubt: its quality as good as the noise allows
            hopeful[self.kinds.index("quality")] -= margin
        ranks = non_dominated_ranks([hopeful, *theirs])
        ahead = tuple(o.number for o, r in zip(judged, ranks[1:]) if r < ranks[0] and o.number is not None)
        better = sum(1 for r in ranks[1:] if r < ranks[0])
        k = -(-(n + 1) // self.reduction_factor)  # ceil((n + 1) / r)
        beyond = f" beyond a noise margin of {margin:.4g}" if margin else ""
        note = f"front {ranks[0] + 1}{beyond}: {better} trials in fronts ahead of it, the top {k} of {n + 1} go on"
        return PruneDecision(better >= k, self.rule, epoch, value, None, n, note, ahead=ahead, point=tuple(own),
                             margin=margin)


def hypervolume_contributions(points: Sequence[Sequence[float]]) -> list[float]:
    """Each point's exclusive hypervolume (what the set loses without it; points minimised), the reference
    point 10% of each coordinate's finite range beyond the worst (1 beyond it where all agree); an infinite
    coordinate (a curve with no finite value) sits on the reference and adds no volume."""
    cols = [[v for v in c if math.isfinite(v)] or [0.0] for c in zip(*points)]
    reference = [max(c) + (0.1 * (max(c) - min(c)) or 1.0) for c in cols]
    points = [[min(v, r) for v, r in zip(p, reference)] for p in points]
    whole = hypervolume(points, reference)
    return [whole - hypervolume([q for j, q in enumerate(points) if j != i], reference) for i in range(len(points))]


class MultiMetricRule:
    """The rule of OptunaHub's `multi_metric_pruner` (S. Watanabe, 2026), Optuna's answer to pruning with
    several objectives, written here from its description as the simulator's baseline for "pareto". Rule
    "multi-metric".

    At epoch ``e``, the trial and the others that reported ``e`` (COMPLETE, PRUNED and RUNNING, as `ParetoRule`),
    each at its point on the objectives `kinds` names (`progress_point`):

    1. ``epoch <= n_warmup_epochs`` -> no judgement; with ``base="asha"``, an epoch that is not a rung
       ``min_epochs * reduction_factor**k`` -> none either.
    2. ``n`` others; ``n < n_startup_trials`` -> no judgement; its own point not known -> none.
    3. quality NaN -> prune.
    4. rank the ``n + 1`` points: non-dominated sorting, and within a front by hypervolume contribution
       (largest first; ties go to the trial). A trial on the current front (front 1) is never pruned.
    5. the rank goes to the base rule: ``median`` prunes a trial in the worse half (its position
       ``>= ceil((n + 1) / 2)``, i.e. behind the median of the others' ranks); ``asha`` keeps the top
       ``ceil((n + 1) / reduction_factor)``.

    Where it differs from "pareto": it judges at every epoch by default (a median rule), and it separates
    the points of one front by hypervolume contribution, so a dominated trial can be pruned behind others
    of its own front.
    """

    rule = "multi-metric"

    def __init__(self, direction: str, kinds: Sequence[str | None] = ("quality", "time"), base: str = "median",
                 n_startup_trials: int = 5, n_warmup_epochs: int = 0, min_epochs: int = 1, reduction_factor: int = 3) -> None:
        self.direction = _direction(direction)
        self.kinds = _check_kinds("multi-metric", kinds)
        if base not in ("median", "asha"):
            raise ConfigError(f"multi-metric pruning: base {base!r} must be median or asha")
        self.base = base
        self._rungs = RungRule(direction, min_epochs, reduction_factor, n_startup_trials)
        self.n_startup_trials = self._rungs.n_startup_trials
        self.n_warmup_epochs = _int("n_warmup_epochs", n_warmup_epochs, 0)

    def __repr__(self) -> str:
        return _repr(self, "direction", "kinds", "base", "n_startup_trials", "n_warmup_epochs")

    point = ParetoRule.point  # its point at an epoch, as the Pareto rule's

    def decide(self, epoch: int, mine: Progress, others: Sequence[Progress]) -> PruneDecision:
        gate = _gate(self, epoch, mine, others, self.base == "median" or self._rungs.is_rung(epoch))
        if isinstance(gate, PruneDecision):
            return gate
        own, theirs, value, _ = gate
        n = len(theirs)
        points = [own, *theirs]
        ranks = non_dominated_ranks(points)
        if ranks[0] == 0:
            return PruneDecision(False, self.rule, epoch, value, None, n, "on the current front")
        same = [i for i, r in enumerate(ranks) if r == ranks[0]]
        gain = dict(zip(same, hypervolume_contributions([points[i] for i in same])))
        position = sum(1 for r in ranks if r < ranks[0]) + sum(1 for i in same[1:] if gain[i] > gain[0])
        cut = 2 if self.base == "median" else self._rungs.reduction_factor
        k = -(-(n + 1) // cut)  # ceil((n + 1) / cut): the positions that go on
        note = f"front {ranks[0] + 1}, position {position + 1} of {n + 1} by front and hypervolume contribution; the top {k} go on"
        return PruneDecision(position >= k, self.rule, epoch, value, None, n, note)
