"""The doors between a search's units: what they are built with instead of the `Search` that owns them.

- `SearchDefinition`: what the search is, frozen once its base config is resolved (and the machine's plan
  applied to it): settings, task, space, objectives, study name, data source, base config, device; and the
  pruning rule those settle. A unit reads it and cannot change it.
- `WorkerContext`: what one worker process holds across its trials: its seat on the device (`machine.fairtime.Seat`:
  the device, the fair clock's lock, a lone process's threads), the data it loaded, the trial it trains alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headsearch.config import RunConfig
from headsearch.errors import ConfigError
from headsearch.machine.fairtime import Seat
from headsearch.search.objectives import Objective, progress_kinds
from headsearch.search.pruning import make_curve_pruner, make_optuna_pruner
from headsearch.search.pruning.resume import PAUSE_NOISE_MARGIN
from headsearch.search.settings import SearchSettings
from headsearch.search.space import SearchSpace
from headsearch.tasks import DataSource, Task


@dataclass(frozen=True)
class SearchDefinition:
    """A search as its settings and the plan define it; `Search` builds it once per process (and again,
    before any trial, when the machine's plan changes the base config's step mode)."""

    settings: SearchSettings
    task: Task
    space: SearchSpace
    objectives: tuple[Objective, ...]
    study_name: str
    source: DataSource
    base: RunConfig
    device: Any  # the torch.device `settings.device` resolves to in this process

    @property
    def directions(self) -> list[str]:
        return [o.direction for o in self.objectives]

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    def stacks(self) -> bool:
        """Whether the task trains cohorts and the base config can join one (headsearch.training.cohort)."""
        return self.task.stack_refusal is not None and self.task.stack_refusal(self.base) is None

    # -- pruning ----------------------------------------------------------------------------------
    def pruner_name(self) -> str:
        """The pruning rule: the one asked for, else pareto for several objectives (the simulator's choice:
        benchmarks/search_quality.py) and Optuna's median for one."""
        return self.settings.pruner or ("pareto" if self.multi_objective else "median")

    def _pruner_opts(self) -> dict[str, Any]:
        s = self.settings
        # Pruning starts once a quarter of the budget has finished (2 to 5 trials) unless told otherwise.
        startup = s.pruner_startup_trials if s.pruner_startup_trials is not None else max(2, min(5, s.trials // 4))
        return dict(n_startup_trials=startup, n_warmup_epochs=s.pruner_warmup_epochs, min_epochs=s.pruner_min_epochs,
                    reduction_factor=s.pruner_reduction_factor, percentile=s.pruner_percentile)

    def make_pruner(self):
        """(Optuna's pruner, None) for one objective; (None, the curve pruner or None) for several."""
        s, opts = self.settings, self._pruner_opts()
        if self.multi_objective:
            kinds = progress_kinds([o.stored() for o in self.objectives], self.task.primary.name)
            margin = s.pruner_noise_margin
            if margin is None and s.pruner_pause and self.pruner_name() == "pareto":
                margin = PAUSE_NOISE_MARGIN  # a pause can be undone: the rule stops more, the resume rule takes back
            return None, make_curve_pruner(self.pruner_name(), self.task.primary.direction, kinds=kinds,
                                           noise_margin=margin, noise=s.pruner_noise, **opts)
        return make_optuna_pruner(self.pruner_name(), epochs=self.base.train.epochs, **opts), None

    def pruner_options(self) -> dict[str, Any]:
        """The pruning rule's settings as it runs (its defaults filled in): rungs, startup, noise margin."""
        optuna_pruner, curve_pruner = self.make_pruner()
        rule = curve_pruner if curve_pruner is not None else getattr(optuna_pruner, "rule", None)
        if rule is None and optuna_pruner is not None:
            # Optuna's own pruner (median, percentile), built to decide as our curve rule: record that rule's
            # settings; a rule with no curve counterpart (hyperband) records none.
            try:
                rule = make_curve_pruner(self.pruner_name(), "maximize", **self._pruner_opts())
            except ConfigError:
                rule = None
        names = ("min_epochs", "reduction_factor", "n_startup_trials", "n_warmup_epochs", "noise_margin", "noise",
                 "percentile")
        return {n: getattr(rule, n) for n in names if rule is not None and hasattr(rule, n)}


@dataclass
class WorkerContext:
    """What one worker process holds across its trials (and across a rebuilt definition): its seat on the device
    (`headsearch.machine.fairtime.Seat`), its data cache, and the number of the trial it trains alone, if any (its
    failure line names it)."""

    seat: Seat
    data: Any
    current_trial: int | None = None
