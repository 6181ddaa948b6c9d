"""`headsearch run`: a multi-objective Optuna search over head architectures, defined once and run by one loop.

Each trial samples an architecture from a search space, trains it with the task's trainer in its own run
directory, and reports the objectives (`headsearch.search.objectives`): the task's quality metric on the
validation split and convergence figures (seconds or epochs to the best validation metric, parameter count).

`Search` is the definition (settings, task, space, objectives, base config, sampler, pruner, study); its
parts live beside it, in the shape of Optuna's `_optimize -> _run_trial` and Syne Tune's scheduler/backend:
`architectures` (what the space holds), `scheduler` (the next trial under the budget lock: dedup, budget,
dead workers), `trial_life` (begin and tell a trial), `trial_pruning` (each epoch judged), `backends` (what
trains: one slot, a cohort, the simulator's table) and `loop` (the one loop over a backend). Any number of
processes on any number of machines sharing one storage run exactly `trials` trials between them
(`headsearch.search.workers` starts several on one machine). The record a trial keeps: `record`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from headsearch.config import RunConfig
from headsearch.errors import ConfigError
from headsearch.search.architectures import SpaceArchitectures
from headsearch.search.backends import DataCache, machine_backend
from headsearch.search.cost_sampler import COST_AWARE, candidates, cost_aware_sampler
from headsearch.search.costs import CostSummary, check_cost_search, cost_seconds, measure_costs
from headsearch.search.loop import TrialLoop
from headsearch.search.objectives import Objective, resolve_objectives
from headsearch.search.plan import Plan, plan_search
from headsearch.search.pruning import make_curve_pruner, make_optuna_pruner
from headsearch.search.record import arch_summary, config_key, holds_architecture, record_result
from headsearch.search.scheduler import DUPLICATE_ASKS, WAIT, Scheduler, enqueue_first
from headsearch.search.settings import SearchSettings, check_settings, load_callback
from headsearch.search.space import SearchSpace, load_space
from headsearch.search.study import StudyStorage, check_sampler, default_sampler, make_sampler, open_study
from headsearch.search.trial_life import SearchCallback, TrialLife, TrialRun, with_storage_retries
from headsearch.search.trial_pruning import TrialPruning
from headsearch.tasks import DataSource, Task, apply_overrides, flag_overrides, get_task, resolve_config, task_reference
from headsearch.training import check_fits, preflight
from headsearch.training.runtime import resolve_device

__all__ = ["DUPLICATE_ASKS", "WAIT", "Search", "SearchCallback", "SearchSettings", "TrialPruning", "TrialRun",
           "arch_summary", "config_key", "holds_architecture", "record_result", "with_storage_retries"]


@dataclass
class Search:
    """A search: validated settings with everything derived from them (task, space, objectives, base config,
    sampler and pruner), and its parts: the space's architectures (`archs`), the scheduler, a trial's life
    (`life`) and the data (`data`). No study exists until `open`; `run_worker` runs the one loop."""

    settings: SearchSettings
    # The base config a parent process resolved and checked (a worker gets it instead of resolving again).
    resolved_base: RunConfig | None = None
    task: Task = field(init=False)
    space: SearchSpace = field(init=False)
    objectives: list[Objective] = field(init=False)
    base: RunConfig = field(init=False)
    study_name: str = field(init=False)
    source: DataSource = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.task = get_task(s.task)
        # A space's name or path, or a space object (a comparison's `ConfigGrid`: fixed configs x seeds).
        self.space = load_space(s.space) if isinstance(s.space, str) else s.space
        if self.space.tasks and self.task.name not in self.space.tasks:
            raise ConfigError(f"space {self.space.name} is for {', '.join(self.space.tasks)}, not {self.task.name}")
        self.objectives = resolve_objectives(self.task, s.objectives)
        self.optuna_callbacks = [load_callback(spec) for spec in s.callbacks]  # a bad one fails before any study
        # Every architecture's epoch seconds, known before training (`cost_sampler.Candidate`s): the cost-aware
        # sampler proposes from them. Measured before the first trial (`use_costs`); the simulator's table gives them.
        self.cost_candidates: list | None = None
        check_settings(s)
        check_sampler(self.sampler_name(), len(self.objectives))
        self.study_name = s.study or "-".join([self.task.name, self.space.name] + ([s.preset] if s.preset else []))
        self.source = DataSource(Path(s.data_dir) if s.data_dir else None, Path(s.data_file) if s.data_file else None)
        self.base = self.resolved_base if self.resolved_base is not None else self._resolve_base()
        self.make_pruner()  # bad pruner options fail here, before any storage is touched
        self.archs = SpaceArchitectures(self)
        if self.resolved_base is None:
            self.archs.check_feasible(resolve_device(s.device))
        if self.sampler_name() == COST_AWARE:
            check_cost_search(self)
        # The parts: the space's architectures, the scheduler, a trial's life, the data (one of each per worker).
        self.scheduler, self.life, self.data = Scheduler(self), TrialLife(self), DataCache(self)
        self._plan: Plan | None = None
        self.current_trial: int | None = None  # the number of the trial this worker trains alone, if any
        self.store: StudyStorage | None = None  # the storage of the study `open` (or `adopt`) gave this search
        self.adopted = False  # the study was made in this process (`adopt`): no storage URL, no budget lock to share

    def _resolve_base(self) -> RunConfig:
        """The base config, resolved once per search and checked before any study exists: the preset's search
        budget < --set < the flags < the space's fixed values."""
        s = self.settings
        flags = flag_overrides(seed=s.seed, epochs=s.epochs, compile=s.compile, diversity_samples=s.diversity_samples or None,
                               sets=s.sets)
        cfg = resolve_config(self.task, preset=s.preset, search=True, overrides=flags)
        base = self.space.base_config(cfg, lambda c, o: apply_overrides(self.task, c, o))
        preflight(self.task, base, self.source)  # e.g. CUDA graphs for a task whose shapes vary
        check_fits(self.task, base, resolve_device(s.device))  # a device that is not there; the size guard
        return base

    # -- the study --------------------------------------------------------------------------
    @property
    def directions(self) -> list[str]:
        return [o.direction for o in self.objectives]

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    def stacks(self) -> bool:
        """Whether the task trains cohorts and the base config can join one (headsearch.training.cohort)."""
        return self.task.stack_refusal is not None and self.task.stack_refusal(self.base) is None

    def sampler_name(self) -> str:
        if self.cost_candidates is not None:
            return COST_AWARE
        return default_sampler(self.settings.sampler, len(self.objectives))

    def make_sampler(self, trial_index: int = 0):
        """Seeded by the index of the trial about to start (see `headsearch.search.study.make_sampler`)."""
        if self.sampler_name() == COST_AWARE:
            if self.cost_candidates is None:
                raise RuntimeError("the cost-aware sampler has no costs yet: Search.use_costs first")
            return cost_aware_sampler(self, seed=self.settings.seed * 100_003 + trial_index)
        return make_sampler(self.sampler_name(), seed=self.settings.seed, trials=self.settings.trials, trial_index=trial_index,
                            curve_direction=self.task.primary.direction if self.multi_objective else None)

    def pruner_name(self) -> str:
        """The pruning rule: the one asked for, else pareto for several objectives (the simulator's choice:
        benchmarks/search_quality.py) and Optuna's median for one."""
        return self.settings.pruner or ("pareto" if self.multi_objective else "median")

    def progress_kinds(self) -> list[str | None]:
        """What each objective is known by while a trial runs (`ParetoRule`): the primary metric's curve, time,
        params, epochs; None for another task metric (known only at the end)."""
        kinds = {"time": "time", "params": "params", "epochs": "epochs", self.task.primary.name: "quality"}
        return [kinds.get(o.name) for o in self.objectives]

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
            return None, make_curve_pruner(self.pruner_name(), self.task.primary.direction, kinds=self.progress_kinds(),
                                           noise_margin=s.pruner_noise_margin, noise=s.pruner_noise, **opts)
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

    def study_attrs(self) -> dict[str, Any]:
        described = self.source.describe()
        return {
            "headsearch": {"task": task_reference(self.task), "space": self.space.summary(),
                           "objectives": [o.stored() for o in self.objectives],
                           "primary_metric": self.task.primary.name, "base_config": self.base.to_dict(),
                           "sampler": self.sampler_name(), "pruner": self.pruner_name(),
                           "pruner_options": self.pruner_options(), "seed": self.settings.seed,
                           "trials": self.settings.trials, "epochs": self.base.train.epochs,
                           "run_root": str(Path(self.settings.run_root).resolve() / self.study_name),
                           "data": str(Path(described).resolve()) if described != "download" else "download"},
        }

    def open(self):
        """Create the study, or load it and check it is the same search. The storage it was opened on is
        kept (`store`) for what Optuna's `Trial` has no public method for (`StudyStorage`)."""
        optuna_pruner, _ = self.make_pruner()
        study, self.store = open_study(
            self.settings.storage, self.settings.heartbeat, self.study_name,
            metric_names=[o.name for o in self.objectives], directions=self.directions,
            attrs=self.study_attrs()["headsearch"], sampler=self._first_sampler(), pruner=optuna_pruner)
        return study

    def _first_sampler(self):
        """The sampler a study opens with; None (Optuna's default, never asked) while the cost-aware sampler
        waits for its costs: the scheduler sets the sampler before every ask."""
        if self.sampler_name() == COST_AWARE and self.cost_candidates is None:
            return None
        return self.make_sampler(0)

    def use_costs(self, study, device, on_cost=None) -> CostSummary:
        """Every architecture's epoch seconds alone (`headsearch.search.costs`), measuring those `study` lacks,
        for the cost-aware sampler to propose from."""
        summary = measure_costs(self, study, device, on_cost)
        self.cost_candidates = candidates(self, cost_seconds(self, study, device))
        return summary

    def adopt(self, study, storage) -> None:
        """Run this search's trials in `study`, which the caller created on `storage` (an Optuna storage
        object: the simulator's in-memory study), instead of the one `open` would open."""
        self.store = StudyStorage(storage, study.study_name)
        self.adopted = True

    def store_of(self, study) -> StudyStorage:
        if self.store is None or self.store.study_name != study.study_name:
            raise RuntimeError(f"study {study.study_name} was not opened by this search: use Search.open(),"
                               " or Search.adopt(study, storage) for a study made elsewhere")
        return self.store

    # -- running ------------------------------------------------------------------------------
    def run_worker(self, worker_index: int = 0, callbacks: Sequence[SearchCallback] = (), argv: list[str] | None = None) -> None:
        """Run trials until the study holds `trials` finished ones or `timeout` passes, one at a time or in
        cohorts as the machine's plan says."""
        study = self.open()
        device = resolve_device(self.settings.device)
        if self.sampler_name() == COST_AWARE and self.cost_candidates is None:
            self.use_costs(study, device)  # measured before this worker started, unless it is on another machine
        backend = machine_backend(self, device, self.machine_plan().cohort)
        self.run(study, backend, device, callbacks, argv)

    def run(self, study, backend, device, callbacks: Sequence[SearchCallback] = (), argv: list[str] | None = None) -> None:
        """The one loop (`headsearch.search.loop`) over `backend`: a solo slot, a cohort, or the simulator's table."""
        TrialLoop(self, study, backend, device, callbacks, argv).run()

    def wait_seconds(self) -> float:
        """How long a worker waits before counting again while running trials hold the rest of the budget:
        a tenth of the silence after which a dead worker's trial is failed, between 1 and 10 seconds."""
        return min(10.0, max(1.0, 0.3 * (self.settings.heartbeat or 10)))

    # -- the machine ----------------------------------------------------------------------------
    def machine_plan(self) -> Plan:
        """How this machine runs the search (workers, trials per GPU, step mode, MPS): headsearch.search.plan."""
        if self._plan is None:
            self.use_plan(plan_search(self))
        return self._plan

    def use_plan(self, plan: Plan) -> None:
        """Run as `plan` says; a step mode it chose (a measurement's) becomes the trials' `train.compile`
        unless --compile gave one."""
        self._plan = plan
        if plan.compile is not None and self.settings.compile is None:
            self.base = apply_overrides(self.task, self.base, {"train": {"compile": plan.compile}})

    def step_footprint(self):
        """The base config's training footprint (headsearch.models.size), with the FLOPs of an average step on
        the data for a task whose step cost depends on it (`Task.data_footprint`: translation's lengths)."""
        if self.task.data_footprint is not None:
            return self.task.data_footprint(self.base, self.data.cpu_data())
        return self.task.footprint(self.base) if self.task.footprint else None

    def check_data(self) -> None:
        self.data.check()

    def prepare_data(self) -> None:
        self.data.prepare(resolve_device(self.settings.device))

    # -- the space (SpaceArchitectures) ---------------------------------------------------------
    def architectures(self):
        return self.archs.listing()

    def params_of(self, config) -> dict[str, Any]:
        return self.archs.params_of(config)

    def sample_config(self, trial, device) -> RunConfig:
        return self.archs.sample_config(trial, device)

    def trial_target(self) -> int:
        return self.archs.trial_target()

    def space_line(self) -> str | None:
        return self.archs.space_line()

    def enqueue(self, study, params: Sequence[dict[str, Any]]) -> list[int]:
        return enqueue_first(study, params)
