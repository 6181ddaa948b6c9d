"""The search checks its own rungs: does a trial's rank at a rung predict its rank at the end?

Successive halving stops, at each rung epoch ``min_epochs * reduction_factor**k``, every trial outside the
top ``1/reduction_factor`` (the ``pareto`` and ``asha`` rules of `headsearch.search.pruning`). That is only
safe under the assumption ASHA rests on (Li et al. 2020, "A System for Massively Parallel Hyperparameter
Tuning", MLSys): the ranks of the trials early in training predict their ranks at the end. When learning
curves cross, architectures that start slowly and end on top are the ones a rung drops.

The study can say how well that assumption held: `rung_correlations` computes, for each epoch, Spearman's
rank correlation (rho) between the trials' values at that epoch and their final values. Spearman's rho and
not Pearson's r, because the rules act on ranks only (which trials are in the top fraction), so a rung is
right exactly when it orders the trials as the end does, whatever the scale of the metric. rho near 1 at a
rung: pruning there kept the right trials; rho near 0 or below: it chose by chance or backwards.
`low_first_rung` turns a low rho at the first rung (the rung that prunes most) into a one-line warning.

The trials checked are the ones that ran to the end: only they have a final value. They are the startup
trials (judged by nothing) and the rungs' survivors, so the check sees a narrowed range of trials and is
a warning sign, not a measurement of what pruning lost (`headsearch report --pruning-audit` looks at the
pruned trials). A trial's value at epoch ``e`` is its best value so far (max when the primary metric is
maximised, min when minimised), as the rules judge it, and its final value the best over its whole curve,
what the search records as its objective. No Rich and no printing here: the report and the CLI use the rows.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from optuna.trial import TrialState

from headsearch.search.pruning import rule_rungs, rung_epochs
from headsearch.search.ranks import metric_direction, spearman

LOW_RHO = 0.5  # below this the first rung is flagged: it ranks the finished trials little better than chance
MIN_TRIALS = 5  # fewer finished trials: rho is too noisy to warn on
MIN_ROWS_TRIALS = 3  # fewer finished trials: no rows at all (Spearman's rho needs 3 pairs)


@dataclass(frozen=True)
class RungCorrelation:
    """Spearman's rho between the finished trials' values at `epoch` and their final values, over `n` of
    them (those that reached `epoch`); rho None when n < 3 or one side is constant. `is_rung`: a rung of
    the study's pruner."""

    epoch: int
    n: int
    rho: float | None
    is_rung: bool = False


def ran_to_the_end(t: Any) -> bool:
    """A trial with a final value to compare with: COMPLETE, trained itself (not a duplicate reusing a twin's
    curve, not a rejected architecture), with a value at its last epoch (`epochs_run` when recorded)."""
    a = t.user_attrs
    if (t.state != TrialState.COMPLETE or a.get("duplicate_of") is not None or "rejected" in a
            or not t.intermediate_values):
        return False
    last = a.get("epochs_run")
    return not isinstance(last, int) or max(t.intermediate_values) >= last


def running_best(curve: Mapping[int, float], direction: str) -> list[float | None]:
    """The best value so far at epochs 1..last (index e - 1), NaN and missing epochs skipped; None before
    the first finite value. The last entry is the curve's best: the trial's final value."""
    better = max if direction == "maximize" else min
    last = max(curve, default=0)
    out: list[float | None] = []
    best = None
    for epoch in range(1, last + 1):
        v = curve.get(epoch)
        if v is not None and math.isfinite(float(v)):
            best = float(v) if best is None else better(best, float(v))
        out.append(best)
    return out


def _check_direction(direction: str) -> None:
    if direction not in ("maximize", "minimize"):
        raise ValueError(f"direction must be 'maximize' or 'minimize', got {direction!r}")


def rung_correlations(trials: Iterable[Any], direction: str, rungs: Sequence[int] | None = None, *,
                      epochs: Sequence[int] | None = None) -> list[RungCorrelation]:
    """One row per epoch: Spearman's rho between the finished trials' best values so far at that epoch and
    their final values (see the module's docstring for why). `trials`: Optuna FrozenTrials, of which those
    that `ran_to_the_end` count; `direction`: the primary metric's; `rungs`: the pruner's rung epochs, marked
    in the rows and added to them. Default `epochs`: 1 to the last epoch every finished trial has, and the
    rungs up to the longest trial's last epoch (over the trials that reached them)."""
    _check_direction(direction)
    bests = [b for b in (running_best(t.intermediate_values, direction) for t in trials if ran_to_the_end(t))
             if b and b[-1] is not None]
    if not bests:
        return []
    marked = set(rungs or ())
    if epochs is None:
        shortest, longest = min(map(len, bests)), max(map(len, bests))
        epochs = sorted(set(range(1, shortest + 1)) | {r for r in marked if 1 <= r <= longest})
    return [_correlation(bests, epoch, epoch in marked) for epoch in epochs]


def _correlation(bests: list[list[float | None]], epoch: int, is_rung: bool) -> RungCorrelation:
    pairs = [(b[epoch - 1], b[-1]) for b in bests if 1 <= epoch <= len(b) and b[epoch - 1] is not None]
    rho = spearman([x for x, _ in pairs], [y for _, y in pairs])
    return RungCorrelation(epoch=epoch, n=len(pairs), rho=rho, is_rung=is_rung)


def low_first_rung(rows: Sequence[RungCorrelation], first_rung: int | None, threshold: float = LOW_RHO,
                   min_trials: int = MIN_TRIALS, *, metric: str = "value") -> str | None:
    """A one-line warning when the first rung ranks the finished trials poorly: its rho known, over at least
    `min_trials` trials, and below `threshold`; else None. The first rung matters most: it judges every
    trial, and prunes the largest share. `metric` names the final value in the text."""
    row = next((r for r in rows if r.epoch == first_rung), None) if first_rung is not None else None
    if row is None or row.rho is None or row.n < min_trials or row.rho >= threshold:
        return None
    e = row.epoch
    return (f"the first rung (epoch {e}) ranks the finished trials poorly: Spearman's rho {row.rho:.2f} between"
            f" epoch {e} and the final {metric} over {row.n} trials; pruning there may drop slow starters"
            " (see `headsearch report --pruning-audit`; try --pruner-min-epochs auto or a later rung)")


# -- a stored study's rungs -----------------------------------------------------------------------

def _positive_int(value: Any, default: int) -> int:
    # A stored setting may be absent (studies before it was stored), None (the rule's default) or a word
    # ("auto" before it was resolved): the rule's default then.
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default


def rung_schedule(meta: Mapping[str, Any]) -> tuple[int, int] | None:
    """(first rung, reduction factor) of a study's pruner, from its `headsearch` user attrs (`Search.study_attrs`:
    "pruner", and "pruner_options" {"min_epochs", "reduction_factor"} where stored; studies from before it was
    stored get the rule's defaults); None for a rule without rungs."""
    # The rule's default rungs (`PruningRule.rungs`) when the study does not store its own. The other rules
    # judge every epoch or none; hyperband's brackets each have their own first rung.
    default = rule_rungs(meta.get("pruner"))
    if default is None:
        return None
    options = meta.get("pruner_options")
    options = options if isinstance(options, Mapping) else {}
    first = _positive_int(options.get("min_epochs"), default[0])
    factor = _positive_int(options.get("reduction_factor"), default[1])
    return first, max(factor, 2)


def study_rungs(meta: Mapping[str, Any], up_to: int) -> list[int]:
    """The study's rung epochs ``min_epochs * reduction_factor**k`` up to epoch `up_to`; [] without rungs."""
    schedule = rung_schedule(meta)
    return [] if schedule is None else rung_epochs(*schedule, up_to + 1)


def primary_direction(meta: Mapping[str, Any]) -> str | None:
    """The direction of the primary metric (the curve's): its objective's, else its task's; None if unknown."""
    primary = meta.get("primary_metric")
    for o in meta.get("objectives") or []:
        if isinstance(o, Mapping) and o.get("name") == primary and o.get("direction") in ("maximize", "minimize"):
            return o["direction"]
    return metric_direction(meta.get("task"), primary)


def check_rungs(trials: Sequence[Any], meta: Mapping[str, Any], *,
                epochs: Sequence[int] | None = None) -> tuple[list[RungCorrelation], str | None]:
    """A stored study's rows (`rung_correlations`, its rungs marked) and the first rung's warning
    (`low_first_rung`, or None). `trials`: the study's; `meta`: its `headsearch` user attrs. No rows with
    fewer than 3 finished trials, or when the primary metric's direction is unknown. `epochs`: only these
    (the progress display asks for the first rung alone)."""
    direction = primary_direction(meta)
    done = [t for t in trials if ran_to_the_end(t)]
    if direction is None or len(done) < MIN_ROWS_TRIALS:
        return [], None
    longest = max(max(t.intermediate_values) for t in done)
    rungs = study_rungs(meta, longest)
    rows = rung_correlations(done, direction, rungs, epochs=epochs)
    first = rungs[0] if rungs else None
    return rows, low_first_rung(rows, first, metric=meta.get("primary_metric") or "value")


class RungWatch:
    """The search checks its own first rung while it runs: once the trials that ran to the end rank poorly at
    the first rung (`headsearch.search.rungcheck.low_first_rung`), `warning` returns that line, once per run.

    Cheap by design, as it runs on every poll of the display: it recomputes only when the number of COMPLETE
    trials changed (nothing else changes the answer), at most every `every` seconds (a burst of finishing
    workers is checked once), and then only the first rung's correlation. A study whose pruner has no rungs
    is never checked."""

    EVERY = 30.0

    def __init__(self, study, every: float = EVERY, clock: Callable[[], float] = time.monotonic):
        self.meta = study.user_attrs.get("headsearch") or {}
        schedule = rung_schedule(self.meta)
        self.first = schedule[0] if schedule else None
        self.every, self.clock = every, clock
        self.done = self.first is None  # warned already, or nothing to check
        self.checked = 0  # COMPLETE trials at the last check
        self.next_check = -math.inf

    def warning(self, trials, final: bool = False) -> str | None:
        """The warning when it is first due, else None; `final`: the run's last look, not held back by `every`."""
        if self.done:
            return None
        complete = sum(1 for t in trials if t.state == TrialState.COMPLETE)
        now = self.clock()
        if complete < MIN_TRIALS or complete == self.checked or (now < self.next_check and not final):
            return None
        self.checked, self.next_check = complete, now + self.every
        _, text = check_rungs(trials, self.meta, epochs=[self.first])
        self.done = text is not None
        return text


class RungWarning(UserWarning):
    """The first rung ranks the trials that ran to the end poorly (`low_first_rung`'s line)."""


class FirstRungCheck:
    """An Optuna callback `(study, FrozenTrial)`, called after each trained trial: the `RungWatch` of a search
    without the CLI's display (`headsearch.api.search`), whose line becomes a `RungWarning`, once per study and
    process. Given to the search as the spec `FIRST_RUNG_CHECK`, so that worker processes import it too."""

    def __init__(self):
        self.watches: dict[str, RungWatch] = {}

    def __call__(self, study, trial) -> None:
        if (watch := self.watches.get(study.study_name)) is None:
            watch = self.watches[study.study_name] = RungWatch(study)
        if text := watch.warning(study.get_trials(deepcopy=False)):
            warnings.warn(text, RungWarning, stacklevel=2)


first_rung_check = FirstRungCheck()
FIRST_RUNG_CHECK = "headsearch.search.rungcheck:first_rung_check"
