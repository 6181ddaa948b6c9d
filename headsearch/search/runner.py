"""`headsearch run`: a multi-objective Optuna search over head architectures, defined once and run by one loop.

Each trial samples an architecture from a search space, trains it with the task's trainer in its own run
directory, and reports the objectives (`headsearch.search.objectives`): the task's quality metric on the
validation split and convergence figures (seconds or epochs to the best validation metric, parameter count).

`Search` resolves the definition once (`headsearch.search.definition.SearchDefinition`, frozen: settings,
task, space, objectives, base config, device, pruner), opens the study, and builds the parts, each with only
what it uses (none reaches back into `Search`), in the shape of Optuna's `_optimize -> _run_trial` and Syne
Tune's scheduler/backend:
`architectures` (what the space holds), `scheduler` (the next trial under the budget lock: dedup, budget,
dead workers), `trial_life` (begin and tell a trial), `trial_pruning` (each epoch judged), `backends` (what
trains: one slot, a cohort, the simulator's table) and `loop` (the one loop over a backend). Any number of
processes on any number of machines sharing one storage run exactly `trials` trials between them
(`headsearch.search.workers` starts several on one machine). The record a trial keeps: `record`.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from headsearch.config import RunConfig
from headsearch.errors import ConfigError
from headsearch.machine.fairtime import Seat
from headsearch.machine.plan import Plan, PlanInputs, plan_search
from headsearch.search.architectures import SpaceArchitectures
from headsearch.search.backends import DataCache, machine_backend
from headsearch.search.cost_sampler import COST_AWARE, candidates, cost_aware_sampler
from headsearch.search.costs import CostSummary, check_cost_search, cost_seconds, measure_costs
from headsearch.search.definition import SearchDefinition, WorkerContext
from headsearch.search.loop import TrialLoop
from headsearch.search.objectives import resolve_objectives
from headsearch.search.record import arch_summary, config_key, holds_architecture, record_result
from headsearch.search.scheduler import DUPLICATE_ASKS, WAIT, Scheduler
from headsearch.search.settings import SearchSettings, check_settings, load_callback
from headsearch.search.space import SearchSpace, load_space
from headsearch.search.study import (StudyHandle, StudyStorage, check_sampler, default_sampler, make_sampler, open_study,
                                     sampler_seed)
from headsearch.search.trial_life import SearchCallback, TrialLife, TrialRun, with_storage_retries
from headsearch.search.trial_pruning import TrialPruning, resumable
from headsearch.tasks import DataSource, Task, apply_overrides, flag_overrides, get_task, resolve_config, task_reference
from headsearch.training import check_fits, preflight

__all__ = ["DUPLICATE_ASKS", "WAIT", "Search", "SearchCallback", "SearchSettings", "TrialPruning", "TrialRun",
           "arch_summary", "config_key", "holds_architecture", "record_result", "with_storage_retries"]


def resolve_device(device: str | None):
    """`headsearch.training.runtime.resolve_device`, imported when a search resolves its own device: a worker
    handed its seat (a light worker's, trials looked up in a table) never loads torch."""
    from headsearch.training.runtime import resolve_device as resolve

    return resolve(device)


@dataclass
class Search:
    """A search: its frozen definition (`definition`: settings, task, space, objectives, base config, device,
    pruning) and its parts, each built with what it uses: the space's architectures (`archs`), the scheduler,
    a trial's life (`life`), this worker's context (`context`: device seat, data, current trial) and the
    study handle (`handle`). No study exists until `open`; `run_worker` runs the one loop."""

    settings: SearchSettings
    # The base config a parent process resolved and checked (a worker gets it instead of resolving again).
    resolved_base: RunConfig | None = None
    # A worker process's seat on its device (`machine.plan.worker_seat`); else one on `settings.device` is made.
    seat: InitVar[Seat | None] = None
    definition: SearchDefinition = field(init=False)

    def __post_init__(self, seat: Seat | None) -> None:
        s = self.settings
        check_settings(s)
        task = get_task(s.task)
        # A space's name or path, or a space object (a comparison's `ConfigGrid`: fixed configs x seeds).
        space = load_space(s.space) if isinstance(s.space, str) else s.space
        if space.tasks and task.name not in space.tasks:
            raise ConfigError(f"space {space.name} is for {', '.join(space.tasks)}, not {task.name}")
        objectives = resolve_objectives(task, s.objectives)
        self.optuna_callbacks = [load_callback(spec) for spec in s.callbacks]  # a bad one fails before any study
        # Every architecture's epoch seconds, known before training (`cost_sampler.Candidate`s): the cost-aware
        # sampler proposes from them. Measured before the first trial (`use_costs`); the simulator's table gives them.
        self.cost_candidates: list | None = None
        check_sampler(default_sampler(s.sampler, len(objectives)), len(objectives))
        study_name = s.study or "-".join([task.name, space.name] + ([s.preset] if s.preset else []))
        source = DataSource(Path(s.data_dir) if s.data_dir else None, Path(s.data_file) if s.data_file else None)
        base = self.resolved_base if self.resolved_base is not None else self._resolve_base(task, space, source)
        seat = seat if seat is not None else Seat(resolve_device(s.device))
        self.definition = SearchDefinition(s, task, space, tuple(objectives), study_name, source, base, seat.device)
        self.make_pruner()  # bad pruner options fail here, before any storage is touched
        self.handle = StudyHandle()  # the study `open` (or `adopt`) gives this process, passed down to the units
        self.context = WorkerContext(seat, DataCache(task, source))
        self._build_units()
        if self.resolved_base is None:
            self.archs.check_feasible(self.device)
        if self.sampler_name() == COST_AWARE:
            check_cost_search(self.archs)
        self._plan: Plan | None = None
        self._opened: tuple[int, Any] | None = None  # (the process, its study): `open`

    def _build_units(self) -> None:
        """The parts, each given only what it uses (one of each per worker)."""
        d = self.definition
        self.archs = SpaceArchitectures(d)
        self.scheduler = Scheduler(d, self.archs, self.handle, self.make_sampler)
        if d.settings.pruner_pause:
            optuna_pruner, curve_pruner = d.make_pruner()
            self.scheduler.resumable = lambda study, trials, spent: resumable(study, trials, curve_pruner, optuna_pruner,
                                                                              spent=spent)
        self.life = TrialLife(d, self.scheduler, self.handle, self.context.seat, self.optuna_callbacks)

    def _resolve_base(self, task: Task, space: SearchSpace, source: DataSource) -> RunConfig:
        """The base config, resolved once per search and checked before any study exists: the preset's search
        budget < --set < the flags < the space's fixed values."""
        s = self.settings
        flags = flag_overrides(seed=s.seed, epochs=s.epochs, compile=s.compile, diversity_samples=s.track_diversity or None,
                               sets=s.sets)
        cfg = resolve_config(task, preset=s.preset, search=True, overrides=flags)
        base = space.base_config(cfg, lambda c, o: apply_overrides(task, c, o))
        preflight(task, base, source)  # e.g. CUDA graphs for a task whose shapes vary
        check_fits(task, base, resolve_device(s.device))  # a device that is not there; the size guard
        return base

    # -- the definition's parts, as callers know them -----------------------------------------------
    task = property(lambda self: self.definition.task)
    space = property(lambda self: self.definition.space)
    objectives = property(lambda self: list(self.definition.objectives))
    base = property(lambda self: self.definition.base)
    study_name = property(lambda self: self.definition.study_name)
    source = property(lambda self: self.definition.source)
    device = property(lambda self: self.definition.device)
    directions = property(lambda self: self.definition.directions)
    multi_objective = property(lambda self: self.definition.multi_objective)
    data = property(lambda self: self.context.data)
    store = property(lambda self: self.handle.store)  # the storage of the study `open` (or `adopt`) gave this search
    current_trial = property(lambda self: self.context.current_trial)  # the trial this worker trains alone, if any

    # -- the study --------------------------------------------------------------------------
    def sampler_name(self) -> str:
        if self.cost_candidates is not None:
            return COST_AWARE
        return default_sampler(self.settings.sampler, len(self.objectives))

    def make_sampler(self, trial_index: int = 0):
        """Seeded by the index of the trial about to start (see `headsearch.search.study.make_sampler`)."""
        if self.sampler_name() == COST_AWARE:
            if self.cost_candidates is None:
                raise RuntimeError("the cost-aware sampler has no costs yet: Search.use_costs first")
            return cost_aware_sampler(self.definition, self.cost_candidates, seed=sampler_seed(self.settings.seed, trial_index))
        return make_sampler(self.sampler_name(), seed=self.settings.seed, trials=self.settings.trials, trial_index=trial_index,
                            curve_direction=self.task.primary.direction if self.multi_objective else None)

    def make_pruner(self):
        return self.definition.make_pruner()

    def pruner_options(self) -> dict[str, Any]:
        return self.definition.pruner_options()

    def study_attrs(self) -> dict[str, Any]:
        described = self.source.describe()
        return {
            "headsearch": {"task": task_reference(self.task), "space": self.space.summary(),
                           "objectives": [o.stored() for o in self.objectives],
                           "primary_metric": self.task.primary.name, "base_config": self.base.to_dict(),
                           "sampler": self.sampler_name(), "pruner": self.definition.pruner_name(),
                           "pruner_options": self.pruner_options(), "pruner_pause": self.settings.pruner_pause,
                           "seed": self.settings.seed,
                           "trials": self.settings.trials, "epochs": self.base.train.epochs,
                           "run_root": str(Path(self.settings.run_root).resolve() / self.study_name),
                           "data": str(Path(described).resolve()) if described != "download" else "download"},
        }

    def open(self):
        """Create the study, or load it and check it is the same search. The storage it was opened on is
        kept (`store`) for what Optuna's `Trial` has no public method for (`StudyStorage`). Opened once a
        process: the worker that runs in the process that opened the study first (`open_search`, one worker)
        gets that study again, so it holds one storage's connections, not two (docs/searching.md counts them)."""
        if self._opened is not None and self._opened[0] == os.getpid():
            return self._opened[1]
        optuna_pruner, _ = self.make_pruner()
        study, store = open_study(
            self.settings.storage, self.settings.heartbeat, self.study_name,
            metric_names=[o.name for o in self.objectives], directions=self.directions,
            attrs=self.study_attrs()["headsearch"], sampler=self._first_sampler(), pruner=optuna_pruner)
        self.handle.store = store
        self._opened = (os.getpid(), study)
        return study

    def _first_sampler(self):
        """The sampler a study opens with; None (Optuna's default, never asked) while the cost-aware sampler
        waits for its costs: the scheduler sets the sampler before every ask."""
        if self.sampler_name() == COST_AWARE and self.cost_candidates is None:
            return None
        return self.make_sampler(0)

    def use_costs(self, study, on_cost=None) -> CostSummary:
        """Every architecture's epoch seconds alone on this worker's device (`headsearch.search.costs`),
        measuring those `study` lacks, for the cost-aware sampler to propose from."""
        summary = measure_costs(self.archs, self.context.seat, self.context.data, study, on_cost)
        self.use_cost_candidates(candidates(self.archs, cost_seconds(self.archs, self.context.seat, study)))
        return summary

    def use_cost_candidates(self, known: list) -> None:
        """The cost-aware sampler proposes from `known` (`cost_sampler.Candidate`s) from now on."""
        self.cost_candidates = known

    def adopt(self, study, storage) -> None:
        """Run this search's trials in `study`, which the caller created on `storage` (an Optuna storage
        object: the simulator's in-memory study), instead of the one `open` would open."""
        self.handle.store = StudyStorage(storage, study.study_name)  # no storage URL: no budget lock to share

    # -- running ------------------------------------------------------------------------------
    def run_worker(self, worker_index: int = 0, callbacks: Sequence[SearchCallback] = (), argv: list[str] | None = None) -> None:
        """Run trials until the study holds `trials` finished ones or `timeout` passes, one at a time or in
        cohorts as the machine's plan says."""
        study = self.open()
        if self.sampler_name() == COST_AWARE and self.cost_candidates is None:
            self.use_costs(study)  # measured before this worker started, unless it is on another machine
        cohort = self.machine_plan().cohort  # planned first: a plan may rebuild the definition
        self.run(study, machine_backend(self.definition, self.context.seat, cohort), callbacks, argv)

    def run(self, study, backend, callbacks: Sequence[SearchCallback] = (), argv: list[str] | None = None) -> None:
        """The one loop (`headsearch.search.loop`) over `backend`: a solo slot, a cohort, or the simulator's table."""
        TrialLoop(self.settings, self.scheduler, self.life, self.context, self.handle, study, backend, callbacks,
                  argv).run()

    # -- the machine ----------------------------------------------------------------------------
    def machine_plan(self) -> Plan:
        """How this machine runs the search (workers, trials per GPU, step mode, MPS): headsearch.machine.plan."""
        if self._plan is None:
            self.use_plan(plan_search(self.plan_inputs()))
        return self._plan

    def plan_inputs(self) -> PlanInputs:
        """What the plan and `headsearch bench` read of this search (headsearch.machine.plan.PlanInputs)."""
        return PlanInputs(self.settings, self.task, self.base, self.definition.stacks(), self.source,
                          self.step_footprint)

    def use_plan(self, plan: Plan) -> None:
        """Run as `plan` says; a step mode it chose (a measurement's) becomes the trials' `train.compile`
        unless --compile gave one: the definition is made again with that base, and its units with it (before
        any trial: every config they sample is on the planned base)."""
        self._plan = plan
        if plan.compile is not None and self.settings.compile is None:
            base = apply_overrides(self.task, self.base, {"train": {"compile": plan.compile}})
            if base != self.base:
                self.definition = dataclasses.replace(self.definition, base=base)
                self._build_units()

    def step_footprint(self):
        """The base config's training footprint (headsearch.models.size), with the FLOPs of an average step on
        the data for a task whose step cost depends on it (`Task.data_footprint`: translation's lengths)."""
        if self.task.data_footprint is not None:
            return self.task.data_footprint(self.base, self.data.cpu_data(self.base))
        return self.task.footprint(self.base) if self.task.footprint else None

    def check_data(self) -> None:
        self.data.check(self.base)

    def prepare_data(self) -> None:
        self.data.prepare(self.base, self.device)
