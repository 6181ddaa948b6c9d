"""The rules on one learning curve: Optuna's median and percentile rules, decision for decision, and
asynchronous successive halving (`RungRule`). Each judges a trial's curve of its primary metric against the
other trials' curves at the same epoch and returns a `PruneDecision`; `registry` says which trials those are."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from headsearch.errors import ConfigError

DIRECTIONS = ("maximize", "minimize")


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
    - `judged`: whether the rule compared the trial at all (False: the warm-up, not a rung, too few trials, the
      noise not known yet). A paused trial is resumed only on a judgement (`trial_pruning.resumable`). Not stored.
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
    judged: bool = True

    def reason(self) -> dict[str, Any]:
        """All fields as a JSON-able dict (for ``user_attrs["pruned"]``); NaN and inf become None. The fields of
        the rules on several objectives (`ahead`, `point`, `margin`) only where a rule set them."""
        def json_able(x: Any) -> Any:
            return None if isinstance(x, float) and not math.isfinite(x) else x

        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "judged":
                continue
            v = getattr(self, f.name)
            if f.name in ("ahead", "point", "margin") and v == f.default:
                continue
            out[f.name] = [json_able(x) for x in v] if isinstance(v, tuple) else json_able(v)
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


def best_so_far(curve: Mapping[int, float], epoch: int, direction: str, finite: bool = True) -> float:
    """The curve's best value up to `epoch` (max when maximizing), NaN left out, and infinities too when `finite`;
    NaN when there is none."""
    vals = [float(v) for e, v in curve.items() if e <= epoch and not math.isnan(float(v))]
    if finite:
        vals = [v for v in vals if math.isfinite(v)]
    if not vals:
        return math.nan
    return max(vals) if direction == "maximize" else min(vals)


def _repr(rule: Any, *names: str) -> str:
    """``Class(name=value, ...)``: `rule`'s attributes `names`, as its constructor takes them (a tuple as a list)."""
    values = {name: getattr(rule, name) for name in names}
    shown = [f"{name}={list(v) if isinstance(v, tuple) else v!r}" for name, v in values.items()]
    return f"{type(rule).__name__}({', '.join(shown)})"


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
        return _repr(self, "direction", "percentile", "n_startup_trials", "n_warmup_epochs", "interval_epochs")

    def _is_check_epoch(self, epoch: int, curve: Mapping[int, float]) -> bool:
        # Optuna's _is_first_in_interval_step with n_warmup_steps = W + 1.
        start = self.n_warmup_epochs + 1
        nearest_lower = (epoch - start) // self.interval_epochs * self.interval_epochs + start
        previous = max((e for e in curve if e < epoch), default=-1)
        return previous < nearest_lower

    def decide(
        self, epoch: int, curve: Mapping[int, float], others: Sequence[Mapping[int, float]]
    ) -> PruneDecision:
        _check_call(epoch, curve)
        value = best_so_far(curve, epoch, self.direction, finite=False)
        at = _values_at(epoch, others)
        n = len(at)

        def keep(note: str) -> PruneDecision:
            return PruneDecision(False, self.rule, epoch, value, None, n, note, judged=False)

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
        return _repr(self, "direction", "min_epochs", "reduction_factor", "n_startup_trials")

    def is_rung(self, epoch: int) -> bool:
        """Whether `epoch` is ``min_epochs * reduction_factor**k`` for some k >= 0 (one of `rung_epochs`)."""
        return epoch in rung_epochs(self.min_epochs, self.reduction_factor, epoch + 1)

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
            return PruneDecision(False, self.rule, epoch, value, None, n, "not a rung", judged=False)
        if n < self.n_startup_trials:
            return PruneDecision(
                False, self.rule, epoch, value, None, n,
                f"too few trials ({n} < {self.n_startup_trials})", judged=False,
            )
        if math.isnan(value):
            return PruneDecision(True, self.rule, epoch, value, None, n, "value is NaN")
        k = -(-(n + 1) // self.reduction_factor)  # ceil((n + 1) / r)
        better = [v for v in at if self._better(v, value)]
        rest = [v for v in at if not self._better(v, value)]
        key = lambda v: (math.isnan(v), -v if self.direction == "maximize" else v)  # noqa: E731
        ranking = sorted(better, key=key) + [value] + sorted(rest, key=key)
        threshold = ranking[k - 1]
        return PruneDecision(len(better) >= k, self.rule, epoch, value, float(threshold), n)
