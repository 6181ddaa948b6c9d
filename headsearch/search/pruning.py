"""Learning-curve pruning for multi-objective studies, and the same rules for single-objective ones.

Optuna refuses `trial.report` / `trial.should_prune` in multi-objective studies, so headsearch
judges a trial itself: after every epoch the search calls `CurvePruner.decide` with the trial's
curve of its primary metric (`{epoch: value}`, epochs numbered from 1) and the curves that
`comparison_curves` selects from the study, and raises `optuna.TrialPruned` when the decision says
prune, storing `decision.reason()` in the trial's user_attrs. Single-objective studies use Optuna's
own pruners, built with matching parameters by `make_optuna_pruner`, or (``"asha"``) the same
`RungRule` wrapped as an Optuna pruner (`RulePruner`): one rule, one code path, for one objective or several.

Which trials a trial is compared with (`comparison_curves`, `COMPARED_STATES`):

- median / percentile: the COMPLETE trials only, as Optuna's `MedianPruner` / `PercentilePruner`
  (which read ``study.get_trials(states=(COMPLETE,))``). A pruned trial's curve takes no part:
  however bad it was, it does not lower the bar for the trials after it. So single- and
  multi-objective studies prune alike.
- asha, pareto, multi-metric (rung rules): the COMPLETE, PRUNED and RUNNING trials, every trial that
  reached the rung, finished or not, as in ASHA (a trial pruned at a later rung did reach the earlier ones, and its value there counts).

Rejected trials (an invalid architecture, stored PRUNED with user_attr "rejected") and the trial
being judged are never compared with. A trial whose results were reused from an identical complete
trial (user_attr "duplicate_of") is COMPLETE with its twin's curve, and is compared with like any.

Rules (`PRUNERS`):

- ``"median"`` / ``"percentile"`` (`MedianRule`, `PercentileRule`): Optuna's `MedianPruner` /
  `PercentilePruner` (optuna/pruners/_percentile.py), decision for decision: a trial is pruned
  when its best value so far is strictly worse than the given percentile of the complete trials'
  values at the same epoch.
- ``"asha"`` (`RungRule`): asynchronous successive halving (ASHA; Li et al. 2020, "A System for
  Massively Parallel Hyperparameter Tuning", MLSys; successive halving: Jamieson & Talwalkar 2016,
  "Non-stochastic Best Arm Identification and Hyperparameter Optimization", AISTATS), one bracket:
  at the rung epochs ``min_epochs * reduction_factor**k`` only the top ``1/reduction_factor`` go on.
  The same decisions with one objective (`RulePruner`) and several. Optuna's counterpart is
  `SuccessiveHalvingPruner` (one bracket too; it differs in the cut and the startup, see `RungRule`).
- ``"hyperband"``: Optuna's `HyperbandPruner` (Li et al. 2018, "Hyperband: A Novel Bandit-Based Approach
  to Hyperparameter Optimization", JMLR): several brackets of successive halving, each with its own first
  rung, trials assigned to brackets by a hash. Single-objective studies only: with several objectives it
  is refused (`make_curve_pruner`), as ``"pareto"`` is with one. Before, ``hyperband`` meant this with
  one objective and `RungRule` with several: that rule is now called ``"asha"``.
- ``"multi-metric"`` (`MultiMetricRule`): the rule of OptunaHub's `multi_metric_pruner` (S. Watanabe, 2026),
  Optuna's own answer to pruning with several objectives, written here from its description as a baseline
  for the simulator: at each epoch the trials that reported it are ranked by non-dominated sorting, ties
  broken by hypervolume contribution; a trial on the current front is never pruned; the rank goes to a
  median rule (or, ``base="asha"``, to successive halving at the rungs). Several objectives only.
- ``"none"``: no pruning (`make_curve_pruner` returns None, `make_optuna_pruner` a `NopPruner`).

Steps and epochs: the search reports epoch ``e`` to Optuna as ``step=e``. Optuna's warm-up is
``step < n_warmup_steps`` (its steps usually count from 0, so ``n_warmup_steps`` steps are
protected); ours protects the first ``n_warmup_epochs`` epochs, ``1..n_warmup_epochs``, so the
Optuna pruner gets ``n_warmup_steps = n_warmup_epochs + 1``. Both paths then judge the same epochs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import optuna

from headsearch.errors import ConfigError
from headsearch.search.hypervolume import dominates, hypervolume

PRUNERS = ("pareto", "median", "percentile", "asha", "hyperband", "multi-metric", "none")
# The quantities a multi-objective trial's objectives are known by before it ends (`ParetoRule`'s kinds).
PROGRESS_KINDS = ("quality", "time", "params", "epochs")
DIRECTIONS = ("maximize", "minimize")
NOISE_MARGIN = 0.9  # `ParetoRule`: a trial's quality gets this many sigmas of the noise (issue 39, RESULTS.md)


@dataclass(frozen=True)
class PruneDecision:
    """What a `CurvePruner` decided for one trial at one epoch.

    - `prune`: stop the trial now.
    - `rule`: the pruner's rule ("median", "percentile", "asha", "pareto"; "none" for a caller's own
      no-pruning record), also when no judgement was made.
    - `epoch`: the epoch judged.
    - `value`: the value judged: the trial's best value so far for the percentile rules, its value
      at `epoch` for the rung rule. Computed even when no judgement was made.
    - `threshold`: the value it had to beat (see each rule); None when there was nothing to judge
      against (warm-up, too few trials, not a rung, a NaN value).
    - `n_compared`: how many of the other trials have a value at `epoch`.
    - `note`: why no judgement was made ("warm-up ...", "too few trials (1 < 2)", "not a rung",
      ...), or why a trial was pruned without one ("value is NaN"); "" for an ordinary judgement.
    - `ahead` (the rules on several objectives): the numbers of the trials ranked ahead of it.
    - `point`: its point there, every coordinate minimised (`progress_point`), before any margin.
    - `margin`: the noise margin its quality was given (`ParetoRule`), in the metric's units.
    """

    prune: bool
    rule: str
    epoch: int
    value: float
    threshold: float | None
    n_compared: int
    note: str = ""
    ahead: tuple[int, ...] = ()
    point: tuple[float, ...] | None = None
    margin: float | None = None

    def reason(self) -> dict[str, Any]:
        """All fields as a JSON-able dict (for ``user_attrs["pruned"]``); NaN and inf become None. The fields of
        the rules on several objectives (`ahead`, `point`, `margin`) only where a rule set them."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("ahead", "point", "margin") and v == f.default:
                continue
            if isinstance(v, float) and not math.isfinite(v):
                v = None
            if isinstance(v, tuple):
                v = [None if isinstance(x, float) and not math.isfinite(x) else x for x in v]
            out[f.name] = v
        return out


@runtime_checkable
class CurvePruner(Protocol):
    """Judges one trial's learning curve against the other trials' curves at the same epoch."""

    rule: str

    def decide(
        self, epoch: int, curve: Mapping[int, float], others: Sequence[Mapping[int, float]]
    ) -> PruneDecision:
        """`curve`: this trial's values so far ``{epoch: value}``, including `epoch`. `others`: the
        curves it is compared with, not its own (the search passes `comparison_curves`: COMPLETE
        trials for the percentile rules, COMPLETE, PRUNED and RUNNING trials for the rung rules)."""
        ...


# ---------------------------------------------------------------------------------------------
# validation


def _direction(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise ConfigError(
            f"pruning direction {direction!r} is not known: use one of {', '.join(DIRECTIONS)}"
        )
    return direction


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_call(epoch: int, curve: Mapping[int, float]) -> None:
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 1:
        raise ValueError(f"epochs are numbered from 1, got epoch={epoch!r}")
    if epoch not in curve:
        raise ValueError(f"the curve has no value at epoch {epoch} (it has epochs {sorted(curve)})")


def _values_at(epoch: int, others: Sequence[Mapping[int, float]]) -> list[float]:
    return [float(o[epoch]) for o in others if epoch in o]


# ---------------------------------------------------------------------------------------------
# percentile / median


class PercentileRule:
    """Optuna's `PercentilePruner` on learning curves: prune a trial whose best value so far is in
    the bottom `percentile` percent of the other trials' values at the same epoch.

    With ``W = n_warmup_epochs``, ``I = interval_epochs``, ``s = n_startup_trials``, `decide`
    goes through these steps in Optuna's order (optuna/pruners/_percentile.py, Optuna 5.0); it
    returns the decision of the first step that applies:

    1. warm-up: ``epoch <= W`` -> no judgement. (Optuna: ``step < n_warmup_steps`` with
       ``n_warmup_steps = W + 1``, see the module docstring.)
    2. interval: the judged epochs are ``W + 1, W + 1 + I, W + 1 + 2I, ...`` (the first epoch
       after the warm-up, then every `I` epochs): Optuna's ``_is_first_in_interval_step``. If a
       curve skips a judged epoch, the check is made at its next epoch instead (Optuna's
       "postponed" check): an epoch is judged when the curve's previous epoch lies before the
       latest judged epoch ``<= epoch``. With ``I = 1`` every epoch after the warm-up is judged.
    3. no other trials, or fewer than `s` -> no judgement (Optuna counts its COMPLETE trials; the
       search passes only COMPLETE trials, see `comparison_curves`).
    4. the judged value is this trial's best value so far: the max over ``curve[e], e <= epoch``
       when maximizing, the min when minimizing, ignoring NaN (``np.nanmax`` / ``np.nanmin``). If
       every value is NaN -> prune (threshold None, note "value is NaN"). A NaN at `epoch` after
       finite values is judged on the best finite value, as in Optuna.
    5. fewer than ``max(s, 1)`` others with a value at `epoch` -> no judgement (Optuna's
       ``n_min_trials``, which `make_optuna_pruner` sets to ``max(s, 1)``).
    6. threshold: ``np.nanpercentile(values, q)`` of the others' values AT `epoch`, with
       ``q = percentile`` when minimizing and ``q = 100 - percentile`` when maximizing (NaN values
       of others are ignored but counted in step 5; if all are NaN -> no judgement).
    7. prune iff the judged value is strictly worse: ``value > threshold`` when minimizing,
       ``value < threshold`` when maximizing. A tie is kept.

    Given the COMPLETE trials' curves as `others` (what the search passes: `comparison_curves`),
    the decisions equal those of ``optuna.pruners.PercentilePruner(percentile, s,
    n_warmup_steps=W + 1, interval_steps=I, n_min_trials=max(s, 1))`` with epochs reported as
    steps. Like Optuna's, the rule leaves PRUNED trials out: a pruned trial's curve does not move
    the percentile for the trials after it.
    """

    rule = "percentile"

    def __init__(
        self,
        direction: str,
        percentile: float = 25.0,
        n_startup_trials: int = 5,
        n_warmup_epochs: int = 0,
        interval_epochs: int = 1,
    ) -> None:
        self.direction = _direction(direction)
        if isinstance(percentile, bool) or not isinstance(percentile, (int, float, np.number)) or not (
            0.0 <= float(percentile) <= 100.0
        ):
            raise ConfigError(f"percentile must be a number in [0, 100], got {percentile!r}")
        self.percentile = float(percentile)
        self.n_startup_trials = _int("n_startup_trials", n_startup_trials, 0)
        self.n_warmup_epochs = _int("n_warmup_epochs", n_warmup_epochs, 0)
        self.interval_epochs = _int("interval_epochs", interval_epochs, 1)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(direction={self.direction!r}, percentile={self.percentile}, "
            f"n_startup_trials={self.n_startup_trials}, n_warmup_epochs={self.n_warmup_epochs}, "
            f"interval_epochs={self.interval_epochs})"
        )

    def _is_check_epoch(self, epoch: int, curve: Mapping[int, float]) -> bool:
        # Optuna's _is_first_in_interval_step with n_warmup_steps = W + 1.
        start = self.n_warmup_epochs + 1
        nearest_lower = (epoch - start) // self.interval_epochs * self.interval_epochs + start
        previous = max((e for e in curve if e < epoch), default=-1)
        return previous < nearest_lower

    def _best_so_far(self, epoch: int, curve: Mapping[int, float]) -> float:
        vals = np.asarray([float(v) for e, v in curve.items() if e <= epoch], dtype=float)
        vals = vals[~np.isnan(vals)]
        if vals.size == 0:
            return math.nan
        return float(vals.max() if self.direction == "maximize" else vals.min())

    def decide(
        self, epoch: int, curve: Mapping[int, float], others: Sequence[Mapping[int, float]]
    ) -> PruneDecision:
        _check_call(epoch, curve)
        value = self._best_so_far(epoch, curve)
        at = _values_at(epoch, others)
        n = len(at)

        def keep(note: str, threshold: float | None = None) -> PruneDecision:
            return PruneDecision(False, self.rule, epoch, value, threshold, n, note)

        w, s = self.n_warmup_epochs, self.n_startup_trials
        if epoch <= w:
            return keep(f"warm-up (epoch {epoch} <= n_warmup_epochs {w})")
        if not self._is_check_epoch(epoch, curve):
            return keep(f"not a check epoch (every {self.interval_epochs} epochs after warm-up)")
        if len(others) == 0 or len(others) < s:
            return keep(f"too few trials ({len(others)} < {max(s, 1)})")
        if math.isnan(value):
            return PruneDecision(True, self.rule, epoch, value, None, n, "value is NaN")
        if n < max(s, 1):
            return keep(f"too few trials with a value at epoch {epoch} ({n} < {max(s, 1)})")
        q = 100 - self.percentile if self.direction == "maximize" else self.percentile
        threshold = float(np.nanpercentile(np.array(at, dtype=float), q))
        if math.isnan(threshold):
            return keep(f"the other trials' values at epoch {epoch} are all NaN")
        prune = value < threshold if self.direction == "maximize" else value > threshold
        return PruneDecision(bool(prune), self.rule, epoch, value, threshold, n)


class MedianRule(PercentileRule):
    """Optuna's `MedianPruner` on learning curves: `PercentileRule` with percentile 50 (see there)."""

    rule = "median"

    def __init__(
        self,
        direction: str,
        n_startup_trials: int = 5,
        n_warmup_epochs: int = 0,
        interval_epochs: int = 1,
    ) -> None:
        super().__init__(direction, 50.0, n_startup_trials, n_warmup_epochs, interval_epochs)


# ---------------------------------------------------------------------------------------------
# successive halving (ASHA)


def rung_epochs(min_epochs: int, reduction_factor: int, below: int) -> list[int]:
    """The rungs ``min_epochs * reduction_factor**k`` (k = 0, 1, ...) before epoch `below`: the epochs a rung
    rule judges at when a trial's last epoch is `below` (its last is never judged)."""
    out, epoch = [], min_epochs
    while epoch < below:
        out.append(epoch)
        epoch *= reduction_factor
    return out


class RungRule:
    """Asynchronous successive halving (ASHA) on learning curves, one bracket: rule "asha".

    Successive halving (Jamieson & Talwalkar 2016) trains many configurations for a few epochs and
    keeps the best ``1/reduction_factor`` of them at each rung; ASHA (Li et al. 2020, "A System for
    Massively Parallel Hyperparameter Tuning") makes it asynchronous: a trial is judged against the
    trials that reached the same rung before it: the search passes the COMPLETE, PRUNED and RUNNING
    trials (`comparison_curves`), so a trial pruned at a later rung counts at the earlier ones. As
    in Optuna's SuccessiveHalvingPruner, a trial is stopped rather than paused, so "not promoted"
    means pruned.

    With ``m = min_epochs``, ``r = reduction_factor``, ``s = n_startup_trials``:

    1. rungs are the epochs ``m * r**k``, k = 0, 1, 2, ... (m = 1, r = 3: 1, 3, 9, 27, ...). At any
       other epoch: no judgement (note "not a rung").
    2. the values compared are the others' values AT the rung epoch; ``n`` of them. ``n < s`` ->
       no judgement.
    3. the judged value is this trial's value AT the rung (not its best so far). NaN -> prune.
    4. rank this trial with the n others, best first (NaN values of others last), placing it
       ahead of every other trial with an equal value (ties go to the trial). The top
       ``k = ceil((n + 1) / r)`` are kept. ``threshold`` is the value at position k of that
       ranking, the worst value still kept: when the trial is pruned, the k-th best of the
       others' values; when it is kept, its own value or a better one. The trial is pruned iff
       at least k others are strictly better, i.e. iff its value is strictly worse than the
       threshold.

    Single-objective studies use this rule too, as an Optuna pruner (`RulePruner`), so ``--pruner asha``
    decides alike with one objective and several. Differences from Optuna's own pruners:
    `SuccessiveHalvingPruner` (one bracket too) keeps the top ``floor(N / r)`` (at least 1) of the N
    trials, itself included, that reached a rung, and prunes while few trials have reached it (its
    `bootstrap_count` aside); here the cut is ``ceil(N / r)`` with ties kept, and nothing is judged
    before `s` others reached the rung. `HyperbandPruner` (``--pruner hyperband``, one objective only)
    runs several such brackets, each with its own first rung.
    """

    rule = "asha"

    def __init__(
        self,
        direction: str,
        min_epochs: int = 1,
        reduction_factor: int = 3,
        n_startup_trials: int = 3,
    ) -> None:
        self.direction = _direction(direction)
        self.min_epochs = _int("min_epochs", min_epochs, 1)
        self.reduction_factor = _int("reduction_factor", reduction_factor, 2)
        self.n_startup_trials = _int("n_startup_trials", n_startup_trials, 0)

    def __repr__(self) -> str:
        return (
            f"RungRule(direction={self.direction!r}, min_epochs={self.min_epochs}, "
            f"reduction_factor={self.reduction_factor}, n_startup_trials={self.n_startup_trials})"
        )

    def is_rung(self, epoch: int) -> bool:
        """Whether `epoch` is ``min_epochs * reduction_factor**k`` for some k >= 0 (one of `rung_epochs`)."""
        if epoch < self.min_epochs or epoch % self.min_epochs:
            return False
        q = epoch // self.min_epochs
        while q % self.reduction_factor == 0:
            q //= self.reduction_factor
        return q == 1

    def _better(self, a: float, b: float) -> bool:
        """a strictly better than b; NaN is worse than anything and never better."""
        if math.isnan(a):
            return False
        if math.isnan(b):
            return True
        return a > b if self.direction == "maximize" else a < b

    def decide(
        self, epoch: int, curve: Mapping[int, float], others: Sequence[Mapping[int, float]]
    ) -> PruneDecision:
        _check_call(epoch, curve)
        value = float(curve[epoch])
        at = _values_at(epoch, others)
        n = len(at)
        if not self.is_rung(epoch):
            return PruneDecision(False, self.rule, epoch, value, None, n, "not a rung")
        if n < self.n_startup_trials:
            return PruneDecision(
                False, self.rule, epoch, value, None, n,
                f"too few trials ({n} < {self.n_startup_trials})",
            )
        if math.isnan(value):
            return PruneDecision(True, self.rule, epoch, value, None, n, "value is NaN")
        k = -(-(n + 1) // self.reduction_factor)  # ceil((n + 1) / r)
        better = [v for v in at if self._better(v, value)]
        rest = [v for v in at if not self._better(v, value)]
        key = (lambda v: (math.isnan(v), -v)) if self.direction == "maximize" else (
            lambda v: (math.isnan(v), v)
        )
        ranking = sorted(better, key=key) + [value] + sorted(rest, key=key)
        threshold = ranking[k - 1]
        return PruneDecision(len(better) >= k, self.rule, epoch, value, float(threshold), n)


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
    finished = trial.state == _COMPLETE and "duplicate_of" not in a
    return Progress(dict(trial.intermediate_values), a.get("params"), a.get("epoch_seconds_alone"), trial.number, finished)


def best_so_far(curve: Mapping[int, float], epoch: int, direction: str) -> float:
    """The curve's best finite value up to `epoch` (max when maximizing); NaN when there is none."""
    vals = [float(v) for e, v in curve.items() if e <= epoch and math.isfinite(float(v))]
    if not vals:
        return math.nan
    return max(vals) if direction == "maximize" else min(vals)


def rank_correlation(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho (ties averaged); NaN values rank last; -1 when either side is constant (no evidence)."""
    from scipy import stats

    x = [math.inf if math.isnan(v) else v for v in x]
    y = [math.inf if math.isnan(v) else v for v in y]
    if len(set(x)) < 2 or len(set(y)) < 2:
        return -1.0
    return float(stats.spearmanr(x, y)[0])


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
            vals = [float(v) for e, v in p.curve.items() if e <= epoch and not math.isnan(float(v))]
            if not vals:
                out.append(math.inf)
                continue
            out.append(-max(vals) if direction == "maximize" else min(vals))
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
        return PruneDecision(False, rule.rule, epoch, value, None, n, note)

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
        return (f"ParetoRule(direction={self.direction!r}, kinds={list(self.kinds)}, min_epochs={self.min_epochs},"
                f" reduction_factor={self.reduction_factor}, n_startup_trials={self.n_startup_trials},"
                f" n_warmup_epochs={self.n_warmup_epochs}, noise_margin={self.noise_margin}, noise={self.noise})")

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
            if rank_correlation(early, final) >= AUTO_RHO:
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
                                 point=tuple(own))
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
        return (f"MultiMetricRule(direction={self.direction!r}, kinds={list(self.kinds)}, base={self.base!r},"
                f" n_startup_trials={self.n_startup_trials}, n_warmup_epochs={self.n_warmup_epochs})")

    def point(self, epoch: int, p: Progress) -> list[float] | None:
        return progress_point(self.kinds, self.direction, epoch, p)

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


PROGRESS_RULES = (ParetoRule, MultiMetricRule)  # rules that judge a trial's `Progress`, not its curve alone


# ---------------------------------------------------------------------------------------------
# which trials a trial is judged against

_COMPLETE, _PRUNED, _RUNNING = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
                                 optuna.trial.TrialState.RUNNING)
# The rung rules judge a trial against every trial that reached the rung, running ones included, as asynchronous
# successive halving does (Li et al. 2020): with 8 workers the first 8 trials would otherwise never be judged.
COMPARED_STATES = {"median": (_COMPLETE,), "percentile": (_COMPLETE,), "asha": (_COMPLETE, _PRUNED, _RUNNING),
                   "pareto": (_COMPLETE, _PRUNED, _RUNNING), "multi-metric": (_COMPLETE, _PRUNED, _RUNNING)}


def comparison_curves(trials: Iterable[Any], rule: str, number: int) -> list[dict[int, float]]:
    """The curves the trial numbered `number` is judged against under `rule` (see the module
    docstring): the intermediate values of `trials` (Optuna FrozenTrials) whose state is in
    ``COMPARED_STATES[rule]`` (COMPLETE for median and percentile, COMPLETE, PRUNED and RUNNING for
    the rung rules), leaving out rejected trials and trial `number` itself. Unknown rule -> ConfigError."""
    if rule not in COMPARED_STATES:
        raise _unknown(rule)
    return [dict(t.intermediate_values) for t in comparison_trials(trials, rule, number)]


def comparison_trials(trials: Iterable[Any], rule: str, number: int) -> list[Any]:
    """The trials behind `comparison_curves` (for `ParetoRule`, which reads more of them than their curves)."""
    if rule not in COMPARED_STATES:
        raise _unknown(rule)
    states = COMPARED_STATES[rule]
    return [t for t in trials if t.state in states and "rejected" not in t.user_attrs and t.number != number]


# ---------------------------------------------------------------------------------------------
# a curve rule as an Optuna pruner (single-objective studies)


class RulePruner(optuna.pruners.BasePruner):
    """`RungRule` as an Optuna pruner: `Trial.should_prune` in a single-objective study decides as the
    rule decides for a multi-objective one, on the same trials (`comparison_curves`). The rule is judged
    for the study's direction (the rule's own direction is ignored). `last` holds the latest decision,
    so the search can record its threshold and count in ``user_attrs["pruned"]``."""

    def __init__(self, rule: RungRule) -> None:
        self.rule = rule
        self.last: PruneDecision | None = None

    def __repr__(self) -> str:
        return f"RulePruner({self.rule!r})"

    def prune(self, study: "optuna.study.Study", trial: "optuna.trial.FrozenTrial") -> bool:
        epoch = trial.last_step
        if epoch is None:
            return False
        direction = "maximize" if study.direction == optuna.study.StudyDirection.MAXIMIZE else "minimize"
        rule = self.rule if direction == self.rule.direction else RungRule(
            direction, self.rule.min_epochs, self.rule.reduction_factor, self.rule.n_startup_trials)
        others = comparison_curves(study.get_trials(deepcopy=False), rule.rule, trial.number)
        self.last = rule.decide(epoch, dict(trial.intermediate_values), others)
        return self.last.prune


# ---------------------------------------------------------------------------------------------
# factories


def _unknown(name: str) -> ConfigError:
    return ConfigError(f"unknown pruner {name!r}: use one of {', '.join(PRUNERS)}")


def make_curve_pruner(
    name: str,
    direction: str,
    *,
    n_startup_trials: int | None = None,
    n_warmup_epochs: int | None = None,
    percentile: float | None = None,
    min_epochs: int | None = None,
    reduction_factor: int | None = None,
    kinds: Sequence[str | None] | None = None,
    noise_margin: float | None = None,
    noise: float | None = None,
) -> "CurvePruner | ParetoRule | MultiMetricRule | None":
    """The curve pruner `name` (one of `PRUNERS`) for a study whose primary metric goes `direction`.

    "none" -> None. None arguments take each rule's default; arguments a rule has no use for are
    ignored (`percentile` for "median"; `min_epochs` and `reduction_factor` for the percentile
    rules; `n_warmup_epochs` and `percentile` for "asha"; `kinds` for all but "pareto", whose
    `ParetoRule` judges the study's objectives as `kinds` names them). Unknown name -> ConfigError;
    "hyperband" (Optuna's, one objective only) -> ConfigError naming "asha".
    """
    if name not in PRUNERS:
        raise _unknown(name)
    if name == "hyperband":
        raise ConfigError("--pruner hyperband is Optuna's multi-bracket HyperbandPruner, for one objective: with several"
                          " use asha (one bracket of successive halving, what hyperband meant there before) or pareto")
    _direction(direction)
    if name == "none":
        return None
    if min_epochs == "auto" and name != "pareto":
        raise ConfigError(f"--pruner-min-epochs auto: only the pareto rule chooses its first rung from the finished"
                          f" trials; give {name} a number of epochs")

    def given(**kw: Any) -> dict[str, Any]:
        return {k: v for k, v in kw.items() if v is not None}

    if name == "median":
        return MedianRule(
            direction, **given(n_startup_trials=n_startup_trials, n_warmup_epochs=n_warmup_epochs)
        )
    if name == "percentile":
        return PercentileRule(
            direction,
            **given(
                percentile=percentile,
                n_startup_trials=n_startup_trials,
                n_warmup_epochs=n_warmup_epochs,
            ),
        )
    if name == "pareto":
        return ParetoRule(direction, **given(kinds=kinds, min_epochs=min_epochs, reduction_factor=reduction_factor,
                                             n_startup_trials=n_startup_trials, n_warmup_epochs=n_warmup_epochs,
                                             noise_margin=noise_margin), noise=noise)
    if name == "multi-metric":
        return MultiMetricRule(direction, **given(kinds=kinds, n_startup_trials=n_startup_trials,
                                                  n_warmup_epochs=n_warmup_epochs))
    return RungRule(
        direction,
        **given(
            min_epochs=min_epochs,
            reduction_factor=reduction_factor,
            n_startup_trials=n_startup_trials,
        ),
    )


def make_optuna_pruner(
    name: str,
    *,
    epochs: int,
    n_startup_trials: int | None = None,
    n_warmup_epochs: int | None = None,
    percentile: float | None = None,
    min_epochs: int | None = None,
    reduction_factor: int | None = None,
) -> optuna.pruners.BasePruner:
    """Optuna's pruner for rule `name`, for single-objective studies that report epoch e as step e.

    - "median" -> ``MedianPruner(n_startup_trials, n_warmup_steps=n_warmup_epochs + 1,
      n_min_trials=max(n_startup_trials, 1))``; "percentile" -> ``PercentilePruner`` likewise.
      These decide exactly as `MedianRule` / `PercentileRule` given the COMPLETE trials' curves
      (see `PercentileRule`): ``+ 1`` because Optuna's warm-up is ``step < n_warmup_steps`` and
      our epochs start at 1; ``n_min_trials`` because our startup count is of trials with a value
      at the epoch judged.
    - "asha" -> ``RulePruner(RungRule(...))``: the very rule of multi-objective studies, as an Optuna
      pruner (Optuna's `SuccessiveHalvingPruner` decides otherwise, see `RungRule`).
    - "hyperband" -> ``HyperbandPruner(min_resource=min_epochs, max_resource=epochs,
      reduction_factor)``: Optuna's multi-bracket Hyperband, with `RungRule`'s defaults (m = 1,
      r = 3). `n_startup_trials` has no counterpart there and is ignored (Optuna's
      `bootstrap_count` prunes, rather than spares, trials while few have reached a rung).
    - "none" -> ``NopPruner()``.

    Defaults (None) are those of the curve rules. Unknown name -> ConfigError.
    """
    if name not in PRUNERS:
        raise _unknown(name)
    if name in ("pareto", "multi-metric"):
        raise ConfigError(f"--pruner {name} judges several objectives at once: a single-objective study uses median,"
                          " percentile, asha, hyperband or none")
    epochs = _int("epochs", epochs, 1)
    if name == "none":
        return optuna.pruners.NopPruner()
    if name in ("median", "percentile"):
        rule = make_curve_pruner(
            name,
            "maximize",
            n_startup_trials=n_startup_trials,
            n_warmup_epochs=n_warmup_epochs,
            percentile=percentile,
        )
        assert isinstance(rule, PercentileRule)
        common = dict(
            n_startup_trials=rule.n_startup_trials,
            n_warmup_steps=rule.n_warmup_epochs + 1,
            interval_steps=rule.interval_epochs,
            n_min_trials=max(rule.n_startup_trials, 1),
        )
        if name == "median":
            return optuna.pruners.MedianPruner(**common)
        return optuna.pruners.PercentilePruner(rule.percentile, **common)
    given = {k: v for k, v in dict(min_epochs=min_epochs, reduction_factor=reduction_factor).items() if v is not None}
    if name == "asha":
        return RulePruner(RungRule("maximize", **given, **({} if n_startup_trials is None else
                                                             {"n_startup_trials": n_startup_trials})))
    rung = RungRule("maximize", **given)  # hyperband: the rung rule's defaults and checks
    if epochs < rung.min_epochs:
        raise ConfigError(
            f"hyperband pruning needs epochs >= min_epochs, got epochs={epochs}, "
            f"min_epochs={rung.min_epochs}"
        )
    return optuna.pruners.HyperbandPruner(
        min_resource=rung.min_epochs,
        max_resource=epochs,
        reduction_factor=rung.reduction_factor,
    )
