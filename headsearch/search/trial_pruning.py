"""The pruning callback of a search's trial: each epoch's primary metric recorded, and the trial judged.

Optuna's `report`/`should_prune` refuse multi-objective studies, so there each epoch's value is written into
the trial's intermediate values through the storage and judged against the other trials' curves by the
study's rule (`headsearch.search.pruning`); single-objective studies use Optuna's own pruners with the same
rules. A pruned trial is stored PRUNED with its reason (user attribute `pruned`).

With --pruner-pause a trial the rule stops is paused instead (`TrialPaused`): the trainer keeps its state, it is
stored PRUNED with `paused` too, and the scheduler resumes it in a later trial when the rule, asked again with
what the study knows then, lets it go on (`resumable`).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import optuna

from headsearch.search.pruning import (Progress, PruneDecision, RulePruner, comparison_trials, judges_progress,
                                       progress_of)
from headsearch.search.pruning.resume import projected_end, stands_on_front
from headsearch.search.record import is_paused, resumed
from headsearch.search.study import StudyStorage
from headsearch.training.records import Callback, EpochRecord, PauseRun


class TrialPaused(optuna.TrialPruned, PauseRun):
    """A trial stopped by its rule with its state kept: Optuna's record of it is a pruned trial's, and the trainer
    (a `PauseRun`) keeps what a resumption needs. `kept` says where, once kept (None: it was not, e.g. in a cohort:
    the trial is then an ordinary pruned one)."""


class TrialPruning(Callback):
    """Trainer callback: record each epoch's primary metric as an intermediate value and prune.

    One objective: `Trial.report` and Optuna's pruner. Several: the value goes to the storage directly
    (`store`, the study's `StudyStorage`: needed then) and `curve_pruner` judges the curve against
    `comparison_curves` (see headsearch.search.pruning).
    A trial's last epoch is recorded but not judged: it is trained already, so pruning it saves nothing
    and would only throw its objectives away.
    """

    def __init__(self, study, trial, metric: str, curve_pruner, pruner_name: str, single_objective: bool,
                 epochs: int | None = None, store: StudyStorage | None = None, pause: bool = False,
                 earlier: dict[int, float] | None = None):
        if not single_objective and store is None:
            raise ValueError("a multi-objective trial's pruning writes through the study's storage: pass store")
        self.study, self.trial, self.metric, self.store = study, trial, metric, store
        self.curve_pruner, self.pruner_name, self.single = curve_pruner, pruner_name, single_objective
        self.epochs = epochs  # the trial's last epoch: nothing is left to save there, so it is never pruned
        self.pause = pause  # stop with the state kept (TrialPaused) rather than for good
        # A resumption's curve starts with its paused trial's epochs (`earlier`), which it does not train again.
        self.curve: dict[int, float] = dict(earlier or {})

    def on_epoch_end(self, record: EpochRecord) -> None:
        epoch, value = record.epoch, float(record.metrics[self.metric])
        self.curve[epoch] = value
        if epoch == 1 and record.epoch_seconds_alone is not None:  # a pruned trial's measurement serves later ones too
            self.trial.set_user_attr("epoch_seconds_alone", record.epoch_seconds_alone)
        if epoch == 1 and record.params is not None:  # the Pareto rule compares a pruned trial's params too
            self.trial.set_user_attr("params", record.params)
        last = self.epochs is not None and epoch >= self.epochs
        if self.single:
            self.trial.report(value, epoch)
            if not last and self.trial.should_prune():
                pruner = self.study.pruner
                if isinstance(pruner, RulePruner) and pruner.last is not None:  # our rule: its decision, threshold and all
                    self._prune(pruner.last.reason())
                else:
                    self._prune({"prune": True, "rule": self.pruner_name, "epoch": epoch, "value": value, "threshold": None,
                                 "n_compared": None, "note": "Optuna's pruner (single objective): it does not expose its threshold"})
            return
        # Multi-objective: Trial.report refuses, the storage API does not (docs/design.md §7).
        self.store.set_intermediate_value(self.trial.number, epoch, value)
        if self.curve_pruner is None or last:
            return
        mine = Progress(self.curve, record.params, record.epoch_seconds_alone, self.trial.number)
        decision = judge(self.curve_pruner, self.study.get_trials(deepcopy=False), epoch, mine)
        if decision.prune:
            self._prune(decision.reason())

    def _prune(self, reason: dict) -> None:
        self.trial.set_user_attr("pruned", {**reason, "pause": True} if self.pause else reason)
        if self.pause:
            raise TrialPaused(f"paused at epoch {reason['epoch']} by the {reason['rule']} rule")
        raise optuna.TrialPruned(f"pruned at epoch {reason['epoch']} by the {reason['rule']} rule")


def judge(curve_pruner, trials, epoch: int, mine: Progress) -> PruneDecision:
    """`curve_pruner`'s decision on `mine` (trial `mine.number`'s progress) at `epoch`, against the study's `trials`
    it compares with (`comparison_trials`)."""
    others = comparison_trials(trials, curve_pruner.rule, mine.number)
    if judges_progress(curve_pruner):
        return curve_pruner.decide(epoch, mine, [progress_of(t) for t in others])
    return curve_pruner.decide(epoch, dict(mine.curve), [dict(t.intermediate_values) for t in others])


RESUME_PROJECTED = "spent"  # project a paused trial's end: "spent" once the budget is spent, "always", or "never"


class Resumption(NamedTuple):
    """A paused trial to resume, and why (the resumption's `resumed_because`)."""

    trial: Any
    because: str


def projection_words(epoch: int, projected: Progress, last: int) -> str:
    """Why the projection (`projected_end`) resumes a trial paused at `epoch`, e.g. "its end projected to epoch 16
    (a best value of 0.31, with the gains the finished trials made after epoch 3) is dominated by no finished
    trial's"."""
    return (f"its end projected to epoch {last} (a best value of {projected.curve[last]:.4g}, with the gains the"
            f" finished trials made after epoch {epoch}) is dominated by no finished trial's")


def resumable(study, trials: list, curve_pruner, optuna_pruner: Any, spent: bool = True) -> Resumption | None:
    """The paused trial to resume now and why (`Resumption`), or None: of the paused trials no trial resumes yet,
    those whose rule, asked again at the epoch it paused them with what the study knows now, judges them and lets
    them go on (a rung rule: they rank among the trials that may go on past their rung now; Li et al. 2020's
    promotions, for any rule), or, with several objectives and once the budget is `spent` (`RESUME_PROJECTED`),
    whose curve projected to the end could still reach the finished trials' front (`projected_end`,
    `stands_on_front`: the search would otherwise stop there, and by then the finished trials say most about what
    a paused one may gain). The latest-paused first (the nearest the end), then the earliest trial.
    A decision that judged nothing (not a rung now, too few trials: `PruneDecision.judged`) resumes nothing.

    Several objectives: the rule's judge (`curve_pruner`). One: Optuna's pruner on the paused trial's record (for
    `RulePruner` its decision must be a judgement; Optuna's own pruners give none to check, so their "go on" is
    taken as it is)."""
    gone_on = resumed(trials)
    candidates = sorted((t for t in trials if is_paused(t) and t.number not in gone_on),
                        key=lambda t: (-int(t.user_attrs["paused"]["epoch"]), t.number))
    project = curve_pruner is not None and judges_progress(curve_pruner) and (
        RESUME_PROJECTED == "always" or (RESUME_PROJECTED == "spent" and spent))
    progress = [progress_of(o) for o in trials] if project and candidates else []  # once, for every candidate
    for t in candidates:
        epoch = int(t.user_attrs["paused"]["epoch"])
        if curve_pruner is not None:
            mine = progress_of(t)
            decision = judge(curve_pruner, trials, epoch, mine)
            if decision.judged and not decision.prune:
                return Resumption(t, f"the {decision.rule} rule, asked again at epoch {epoch} with"
                                     f" {decision.n_compared} trials there, lets it go on")
            projection = projected_end(curve_pruner, epoch, mine, progress) if project else None  # leaves `mine` out
            if projection is not None and stands_on_front(curve_pruner, *projection, progress):
                return Resumption(t, projection_words(epoch, *projection))
        elif optuna_pruner is not None and not optuna_pruner.prune(study, t):
            last = getattr(optuna_pruner, "last", None)
            if last is None or last.judged:
                rule = getattr(last, "rule", None) or type(optuna_pruner).__name__
                return Resumption(t, f"the {rule} rule, asked again at epoch {epoch}, lets it go on")
    return None
