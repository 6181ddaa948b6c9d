"""The pruning callback of a search's trial: each epoch's primary metric recorded, and the trial judged.

Optuna's `report`/`should_prune` refuse multi-objective studies, so there each epoch's value is written into
the trial's intermediate values through the storage and judged against the other trials' curves by the
study's rule (`headsearch.search.pruning`); single-objective studies use Optuna's own pruners with the same
rules. A pruned trial is stored PRUNED with its reason (user attribute `pruned`).
"""
from __future__ import annotations

from headsearch.search.pruning import Progress, RulePruner, comparison_trials, judges_progress, progress_of
from headsearch.search.study import StudyStorage
from headsearch.training.records import Callback, EpochRecord


class TrialPruning(Callback):
    """Trainer callback: record each epoch's primary metric as an intermediate value and prune.

    One objective: `Trial.report` and Optuna's pruner. Several: the value goes to the storage directly
    (`store`, the study's `StudyStorage`: needed then) and `curve_pruner` judges the curve against
    `comparison_curves` (see headsearch.search.pruning).
    A trial's last epoch is recorded but not judged: it is trained already, so pruning it saves nothing
    and would only throw its objectives away.
    """

    def __init__(self, study, trial, metric: str, curve_pruner, pruner_name: str, single_objective: bool,
                 epochs: int | None = None, store: StudyStorage | None = None):
        if not single_objective and store is None:
            raise ValueError("a multi-objective trial's pruning writes through the study's storage: pass store")
        self.study, self.trial, self.metric, self.store = study, trial, metric, store
        self.curve_pruner, self.pruner_name, self.single = curve_pruner, pruner_name, single_objective
        self.epochs = epochs  # the trial's last epoch: nothing is left to save there, so it is never pruned
        self.curve: dict[int, float] = {}

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
        others = comparison_trials(self.study.get_trials(deepcopy=False), self.curve_pruner.rule, self.trial.number)
        if judges_progress(self.curve_pruner):
            mine = Progress(self.curve, record.params, record.epoch_seconds_alone, self.trial.number)
            decision = self.curve_pruner.decide(epoch, mine, [progress_of(t) for t in others])
        else:
            decision = self.curve_pruner.decide(epoch, self.curve, [dict(t.intermediate_values) for t in others])
        if decision.prune:
            self._prune(decision.reason())

    def _prune(self, reason: dict) -> None:
        import optuna

        self.trial.set_user_attr("pruned", reason)
        raise optuna.TrialPruned(f"pruned at epoch {reason['epoch']} by the {reason['rule']} rule")
