"""`headsearch run`: the trial loop of a multi-objective Optuna search over head architectures.

Each trial samples an architecture from a search space, trains it with the task's trainer in its
own run directory, and reports the objectives (`headsearch.search.objectives`): the task's quality
metric on the validation split and convergence figures (seconds or epochs to the best validation
metric, parameter count).

Pruning: Optuna's `report`/`should_prune` refuse multi-objective studies, so there each epoch's
primary metric is written into the trial's intermediate values through the storage and judged
against the other trials' curves by `headsearch.search.pruning` (`TrialPruning`); single-objective
studies use Optuna's own pruners with the same rules. A pruned trial is stored PRUNED with its reason.

Workers: `run_worker` loops "take the budget lock, count, ask; train; tell", so any number of
processes on any number of machines sharing one storage run exactly `trials` trials between them
(`headsearch.search.workers` starts several on one machine).

The rest lives beside this module: the settings and their checks (`settings`), the sampler and
opening or resuming the study (`study`), the objectives (`objectives`), the pruning rules (`pruning`).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from headsearch.analysis.tracking import diversity_callbacks
from headsearch.config import RunConfig
from headsearch.errors import ConfigError, Diverged, HeadsearchError
from headsearch.search.artifacts import write_trial_link
from headsearch.search.fairtime import alone_key, device_share, known_epoch_seconds
from headsearch.search.objectives import CONVERGENCE, Objective, resolve_objectives
from headsearch.search.plan import Plan, plan_search
from headsearch.search.pruning import (Progress, RulePruner, comparison_trials, judges_progress, make_curve_pruner,
                                      make_optuna_pruner, progress_of)
from headsearch.search.settings import SearchSettings, check_settings, load_callback
from headsearch.search.space import SearchSpace, load_space
from headsearch.search.liveness import (Heartbeat, SilenceWatch, StorageUnavailable, finished_trial_error, never_beaten,
                                        retry_callback)
from headsearch.search.storage import LockHold, budget_lock
from headsearch.search.study import StudyStorage, check_sampler, default_sampler, make_sampler, open_study
from headsearch.tasks import DataSource, Task, apply_overrides, flag_overrides, get_task, resolve_config, task_reference
from headsearch.training import check_fits, preflight
from headsearch.training.clock import AloneClock
from headsearch.training.runtime import resolve_device
from headsearch.training.trainer import Callback, EpochRecord

__all__ = ["Search", "SearchCallback", "SearchSettings", "TrialPruning", "arch_summary", "record_result"]

FEASIBILITY_SAMPLES = 200  # random architectures tried before a space is declared to have no valid one
WAIT = object()  # _next_trial: the budget is held by running trials; ask again later
# Proposals of an architecture some trial holds that the sampler may make in a row before the search takes
# an architecture no trial holds itself (at random, seeded): each is a FAIL trial marked duplicate_of.
DUPLICATE_ASKS = 5
# The states of the trials that fill the budget (a rejected architecture is PRUNED: counted too).
COUNTED_STATES = ("COMPLETE", "PRUNED", "RUNNING", "WAITING")


class _OverBudget(Exception):
    """The trial just asked found the budget full in the storage's own order (`Search._fence`)."""


@dataclass
class TrialRun:
    """A trial being trained: its config, run directory, pruning callback and fair clock, and its TensorBoard
    writer (--tensorboard) if any."""

    trial: Any
    cfg: RunConfig
    run_dir: Path
    pruning: "TrialPruning"
    clock: AloneClock
    tensorboard: Callback | None = None

    def trainer_callbacks(self, callbacks: Sequence[Callback] = ()) -> list[Callback]:
        """What its trainer (or cohort slot) is given: the TensorBoard writer first (so that it records the epoch
        a pruner stops at), the pruner, the diversity tracker, then `callbacks`."""
        return [*([self.tensorboard] if self.tensorboard else []), self.pruning, *diversity_callbacks(self.cfg),
                *callbacks]


class SearchCallback(Callback):
    """A trainer callback that also hears when each trial starts and ends (the CLI's live display)."""

    def on_trial_start(self, number: int, cfg: RunConfig) -> None: ...
    def on_trial_end(self, number: int, state: str) -> None: ...


@dataclass
class Search:
    """Validated settings with everything derived from them. No study exists until `open`."""

    settings: SearchSettings
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
        check_settings(s)
        check_sampler(self.sampler_name(), len(self.objectives))
        # The preset's search budget < --set < the flags < the space's fixed values.
        flags = flag_overrides(seed=s.seed, epochs=s.epochs, compile=s.compile, diversity_samples=s.diversity_samples or None,
                               sets=s.sets)
        cfg = resolve_config(self.task, preset=s.preset, search=True, overrides=flags)
        self.base = self.space.base_config(cfg, lambda c, o: apply_overrides(self.task, c, o))
        self.study_name = s.study or "-".join([self.task.name, self.space.name] + ([s.preset] if s.preset else []))
        self.source = DataSource(Path(s.data_dir) if s.data_dir else None, Path(s.data_file) if s.data_file else None)
        preflight(self.task, self.base, self.source)  # e.g. CUDA graphs for a task whose shapes vary: before any study exists
        device = resolve_device(self.settings.device)  # a device that is not there: also before any study exists
        check_fits(self.task, self.base, device)  # the size guard, on the base config
        self.make_pruner()  # bad pruner options fail here, before any storage is touched
        self.check_space_feasible(device)
        self._bound_key: str | None = None
        self._bound = None
        self._cpu_bound = None
        self._share = None
        self._plan = None
        self._listed, self._architectures = False, None  # architectures(), listed once
        self._sampled: dict[int, RunConfig] = {}  # configs sampled under the budget lock, by trial number
        self.current_trial: int | None = None  # the number of the trial this worker is running, if any
        self._silence: SilenceWatch | None = None  # running trials without a sign of life, as this worker saw them
        self.store: StudyStorage | None = None  # the storage of the study `open` (or `adopt`) gave this search
        self.adopted = False  # the study was made in this process (`adopt`): no storage URL, no budget lock to share
        # Threads a process alone on this machine uses: what the fair time measures with on a CPU
        # (a worker among several runs with fewer; `headsearch.search.workers` sets it from the parent's).
        self.alone_threads: int | None = None

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
        return default_sampler(self.settings.sampler, len(self.objectives))

    def make_sampler(self, trial_index: int = 0):
        """Seeded by the index of the trial about to start (see `headsearch.search.study.make_sampler`)."""
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
            attrs=self.study_attrs()["headsearch"], sampler=self.make_sampler(0), pruner=optuna_pruner)
        return study

    def adopt(self, study, storage) -> None:
        """Run this search's trials in `study`, which the caller created on `storage` (an Optuna storage
        object: the simulator's in-memory study), instead of the one `open` would open."""
        self.store = StudyStorage(storage, study.study_name)
        self.adopted = True

    def _store(self, study) -> StudyStorage:
        if self.store is None or self.store.study_name != study.study_name:
            raise RuntimeError(f"study {study.study_name} was not opened by this search: use Search.open(),"
                               " or Search.adopt(study, storage) for a study made elsewhere")
        return self.store

    # -- the worker loop --------------------------------------------------------------------
    def _next_trial(self, study):
        """The next trial to run under the budget lock, or None (the budget is spent, the space exhausted),
        or WAIT (running trials hold the rest)."""
        # A study adopted in this process (the simulator's, in memory) has no other worker to exclude: only a
        # storage URL's lock is taken, and a URL no storage scheme knows is refused there, never left unlocked.
        lock = contextlib.nullcontext(LockHold("in memory")) if self.adopted else budget_lock(self.settings.storage,
                                                                                               self.study_name)
        with lock:
            with warnings.catch_warnings():
                # Optuna warns that heartbeats go with Study.optimize; ask/tell workers beat themselves (Heartbeat).
                warnings.filterwarnings("ignore", message="Heartbeat of storage")
                warnings.filterwarnings("ignore", message=".*fail_stale_trials is experimental")
                return self._next_trial_locked(study)

    def _next_trial_locked(self, study):
        while True:
            try:
                return self._next_trial_once(study)
            except _OverBudget:
                continue  # another worker took the last place meanwhile: count again

    def _next_trial_once(self, study):
        from optuna.trial import TrialState

        while True:
            self._fail_dead_trials(study)  # a dead worker's trial -> FAIL, re-enqueued as WAITING
            trials = study.get_trials(deepcopy=False)
            states = [t.state for t in trials]
            waiting = states.count(TrialState.WAITING)
            # Failed trials do not count toward the budget; stop if they pile up (every config diverging).
            failed = sum(1 for t in trials if t.state == TrialState.FAIL and "fail_reason" in t.user_attrs
                         and not t.user_attrs["fail_reason"].startswith("interrupted"))
            if failed >= max(5, 2 * self.settings.trials):
                raise HeadsearchError(
                    f"{failed} trials failed in study {self.study_name} (see their fail_reason with `headsearch report`):"
                    " fix the cause (e.g. a lower lr) before running more"
                )
            running = states.count(TrialState.RUNNING)
            counted = sum(states.count(s) for s in (TrialState.COMPLETE, TrialState.PRUNED)) + running + waiting
            # Nothing left to ask: running trials hold the rest. With heartbeats (leases on a journal), wait for
            # them: one may belong to a dead worker and come back as a retry (or fail and free its place).
            done = WAIT if running and self._store(study).tells_dead_workers else None
            if waiting == 0 and counted >= self.settings.trials:
                return done
            next_point = getattr(self.space, "next_point", None)  # a grid that says which point comes next
            if next_point is not None and waiting == 0:
                point = next_point(trials)
                if point is None:  # every point is held, by finished runs or running ones
                    return done
                study.enqueue_trial(point)
            if next_point is not None or waiting:  # a grid's point, or an enqueued one (a retry, a warm start)
                study.sampler = self.make_sampler(len(trials))
                trial = self._ask(study)
                if next_point is not None or self._unless_held(study, trial, trials) is not None:
                    return trial
                continue  # an enqueued architecture that a trial holds already: told FAIL, not trained
            return self._ask_unheld(study, trials, done)

    def _ask_unheld(self, study, trials: list, done):
        """A new trial whose architecture no trial holds (`holds_architecture`), its config sampled and kept
        (under the budget lock, so two workers never start the same one). A proposal of a held architecture
        is told FAIL with user_attr duplicate_of (neither trained nor counted) and the sampler is asked again,
        reseeded; after DUPLICATE_ASKS such proposals in a row the search takes an architecture no trial holds.
        `done` (None, or WAIT while trials run) when every architecture of the space is held."""
        archs = self.architectures()
        trials = list(trials)
        if archs is not None and len({config_key(t.user_attrs.get("config")) for t in trials if holds_architecture(t)}) >= len(archs):
            return done  # the space is exhausted
        for attempt in range(DUPLICATE_ASKS + 1):
            if attempt == DUPLICATE_ASKS:
                point = self._untried_point(trials, len(trials))
                if point is None:  # a space too big to list kept giving held points: stop this worker
                    return done
                study.enqueue_trial(point)
            study.sampler = self.make_sampler(len(trials))
            trial = self._ask(study)
            if self._unless_held(study, trial, trials) is not None:
                return trial
            trials.append(self._store(study).frozen_trial(trial.number))
        return done  # not reached: the last attempt takes an unheld point or returns

    def _ask(self, study):
        """`study.ask()`, its first heartbeat (or lease) recorded at once, under the budget lock, then fenced."""
        trial = study.ask()
        self._store(study).beat(trial.number)
        self._fence(study, trial)
        return trial

    def _fence(self, study, trial) -> None:
        """Make the budget exact whatever happened to the lock: if the trials created before `trial`, in the
        storage's own order, already fill the budget, `trial` is told FAIL as over-budget (never trained, not
        counted, holds no architecture) and `_OverBudget` raised. Every worker sees the same order, so whoever
        asked last backs off: a worker paused past its lock's silence limit, a broken lock, a symlinked path
        that got a second lock, an NFS client caching a lock file's time, enqueued trials beyond --trials."""
        from optuna.trial import TrialState

        counted = tuple(TrialState[name] for name in COUNTED_STATES)
        # Trial ids, not numbers: an id is the storage's order of creation (a database's key, a journal's
        # record), where two trials created at once on a database without the lock could share a number.
        mine = trial._trial_id
        before = sum(1 for t in study.get_trials(deepcopy=False) if t._trial_id < mine and t.state in counted)
        if before < self.settings.trials:
            return
        trial.set_user_attr("over_budget", before)
        study.tell(trial, state=TrialState.FAIL)
        self._store(study).ended(trial.number)
        raise _OverBudget

    def _fail_dead_trials(self, study) -> None:
        """Fail the RUNNING trials of dead workers, each re-enqueued as WAITING (Optuna's retry callback, up to
        twice): on a database, Optuna's stale heartbeats, and trials that never recorded one (a worker killed
        between `ask` and its first heartbeat); on a journal file or a Redis journal, trials whose lease was
        not renewed. Silence is judged over 3 heartbeats of this worker's own clock."""
        from optuna.trial import TrialState

        store = self._store(study)
        if not store.tells_dead_workers:
            return
        if self._silence is None:
            self._silence = SilenceWatch(3 * store.heartbeat)
        if store.heartbeats:
            # Optuna's own test (`fail_stale_trials`), with a reason recorded: a heartbeat older than the grace
            # period by the database's clock.
            for trial_id in store.storage._get_stale_trial_ids(store.study_id):
                self._give_up(study, trial_id, "interrupted (its heartbeat stopped: its worker died or lost the storage)")
            ids = never_beaten(store.storage, store.study_id)
            reason = "interrupted (its worker stopped before its first heartbeat)"
            silent = self._silence.silent({("id", i): None for i in ids})
            dead = [i for _, i in silent]
        else:
            running = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]
            reason = "interrupted (its worker stopped renewing its lease)"
            silent = self._silence.silent({("lease", t.number): store.leases.read(t.number) for t in running})
            dead = [store.trial_id(n) for _, n in silent]
        for key, trial_id in zip(silent, dead):
            self._silence.forget(key)
            self._give_up(study, trial_id, reason)

    def _give_up(self, study, trial_id: int, reason: str) -> None:
        """Tell a dead worker's trial FAIL with `reason` (not counted, holds no architecture) and retry it."""
        from optuna.trial import TrialState

        storage = self._store(study).storage
        try:
            storage.set_trial_user_attr(trial_id, "fail_reason", reason)
            if not storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
                return
        except finished_trial_error():  # it ended meanwhile (its worker was alive after all)
            return
        frozen = storage.get_trial(trial_id)
        self._store(study).ended(frozen.number)
        retry_callback()(study, frozen)

    def _unless_held(self, study, trial, trials: list):
        """`trial`, its config sampled and kept for `_begin_trial`; or None when a trial in `trials` holds its
        architecture already: then it is told FAIL with user_attr duplicate_of (neither trained nor counted).
        A config that cannot be built is returned as is (`_begin_trial` rejects it and says why)."""
        from optuna.trial import TrialState

        try:
            cfg = self.sample_config(trial, resolve_device(self.settings.device))
        except ConfigError:
            return trial
        trial.set_user_attr("config", cfg.to_dict())
        holder = self._holder(trials, config_key(cfg.to_dict()), trial.number)
        if holder is None:
            self._sampled[trial.number] = cfg
            return trial
        trial.set_user_attr("duplicate_of", holder.number)
        trial.set_user_attr("arch", arch_summary(cfg))
        study.tell(trial, state=TrialState.FAIL)
        return None

    def run_worker(self, worker_index: int = 0, callbacks: Sequence[SearchCallback] = (), argv: list[str] | None = None) -> None:
        """Run trials until the study holds `trials` finished ones or `timeout` passes."""
        if self.machine_plan().cohort > 1:
            return self.run_cohort_worker(self.machine_plan().cohort, worker_index, callbacks, argv)
        study = self.open()
        start = time.monotonic()
        while self.settings.timeout is None or time.monotonic() - start < self.settings.timeout:
            trial = self._next_trial(study)
            if trial is None:
                break
            if trial is WAIT:
                time.sleep(self.wait_seconds())
                continue
            self.current_trial = trial.number
            self.run_trial(study, trial, worker_index, callbacks, argv)
            self.current_trial = None

    def wait_seconds(self) -> float:
        """How long a worker waits before counting again while running trials hold the rest of the budget:
        a tenth of the silence after which a dead worker's trial is failed, between 1 and 10 seconds."""
        return min(10.0, max(1.0, 0.3 * (self.settings.heartbeat or 10)))

    def check_data(self) -> None:
        """Load the data once on the CPU and let it go: missing or malformed data fails here (worker processes
        load their own)."""
        self._cpu_data()
        self._cpu_bound = None

    def _cpu_data(self):
        """The data loaded on the CPU: the plan's `step_footprint` loads it, and the data check that follows
        (`check_data`, `prepare_data`) reuses it and lets it go."""
        import torch

        if self._cpu_bound is None:
            self._cpu_bound = self.task.setup(self.base, self.source, torch.device("cpu"))
        return self._cpu_bound

    def step_footprint(self):
        """The base config's training footprint (headsearch.models.size), with the FLOPs of an average step on
        the data for a task whose step cost depends on it (`Task.data_footprint`: translation's lengths)."""
        if self.task.data_footprint is not None:
            return self.task.data_footprint(self.base, self._cpu_data())
        return self.task.footprint(self.base) if self.task.footprint else None

    def prepare_data(self) -> None:
        """Load the data now, so that missing or malformed data fails before a study is created."""
        self._bound_for(self.base, resolve_device(self.settings.device))
        self._cpu_bound = None  # a copy the plan loaded on the CPU is not needed any more

    def _bound_for(self, cfg: RunConfig, device):
        """Load data once per worker; later trials rebind it to their config."""
        key = json.dumps([cfg.data.to_dict(), cfg.seed], sort_keys=True, default=str)
        if key != self._bound_key:
            self._bound = self.task.setup(cfg, self.source, device)
            self._bound_key = key
            return self._bound
        return self._bound.rebind(cfg)

    def run_trial(self, study, trial, worker_index: int = 0, callbacks: Sequence[SearchCallback] = (),
                  argv: list[str] | None = None) -> str:
        """Sample, train and tell one trial. Returns its final state's name."""
        device = resolve_device(self.settings.device)
        run = self._begin_trial(study, trial, device, callbacks)
        if isinstance(run, str):
            return run
        return self._train_alone(study, run, device, callbacks, argv)

    def _train_alone(self, study, run: "TrialRun", device, callbacks: Sequence[SearchCallback], argv) -> str:
        from headsearch.training import train_bound

        result, error = None, None
        try:
            with self._heartbeat(study, run.trial.number):
                bound = self._bound_for(run.cfg, device)
                result = train_bound(run.cfg, bound, run.run_dir, device=device, argv=argv, clock=run.clock,
                                     callbacks=run.trainer_callbacks(callbacks))
        except BaseException as e:
            error = e
        try:
            return self._end_trial(study, run, result, error, callbacks)
        finally:
            # This frame -> `error` -> its traceback -> this frame (and fit's, holding the model, its graphs and
            # its optimizer state): a cycle that only the cyclic collector would break. Break it now, so a pruned
            # or failed trial's GPU memory is free before the next trial starts.
            error = None

    def _heartbeat(self, study, number: int) -> Heartbeat:
        """The running trial's heartbeats (a database) or lease renewals (a journal), after the first one `_ask`
        recorded."""
        store = self._store(study)
        return Heartbeat(lambda: store.beat(number), self.settings.heartbeat)

    def _begin_trial(self, study, trial, device, callbacks: Sequence[SearchCallback]) -> "TrialRun | str":
        """A trial's config, run directory, pruning and fair clock, or the name of the state it ended in
        already ("REJECTED": an invalid config)."""
        from optuna.trial import TrialState

        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        try:
            cfg = self._sampled.pop(trial.number, None) or self.sample_config(trial, device)
        except ConfigError as e:
            # An invalid combination (e.g. a head count that does not divide a searched d_model, or a
            # model too big for the device): recorded as such, and never trained.
            trial.set_user_attr("rejected", str(e))
            study.tell(trial, state=TrialState.PRUNED)
            return "REJECTED"
        trial.set_user_attr("config", cfg.to_dict())
        trial.set_user_attr("arch", arch_summary(cfg))
        run_dir = Path(self.settings.run_root) / self.study_name / f"trial-{trial.number:05d}"
        trial.set_user_attr("run_dir", str(run_dir.resolve()))
        for cb in callbacks:
            cb.on_trial_start(trial.number, cfg)
        _, curve_pruner = self.make_pruner()
        pruning = TrialPruning(study, trial, self.task.primary.name, curve_pruner, self.pruner_name(), not self.multi_objective,
                               epochs=cfg.train.epochs, store=self._store(study))
        writer = None
        if self.settings.tensorboard is not None:
            from headsearch.training.tensorboard import TensorBoardWriter, trial_dir

            writer = TensorBoardWriter(trial_dir(self.settings.tensorboard, trial.number), hparams=trial.params)
        return TrialRun(trial, cfg, run_dir, pruning, self.alone_clock(study, trial, cfg, device), writer)

    def _end_trial(self, study, run: "TrialRun", result, error: BaseException | None,
                   callbacks: Sequence[SearchCallback], reraise: bool = True) -> str:
        """Tell the study how a trial ended: COMPLETE with its objectives (`result`), PRUNED, or FAIL with
        its reason. An interruption or an unexpected error is re-raised after the trial is told (unless
        `reraise` is False: a cohort telling its other trials first). Two endings are not told: the storage
        gone (`StorageUnavailable`, re-raised: the trial's heartbeat or lease stops and a resumed search
        retries it, so it is never recorded failed for good), and a trial another worker already gave up
        (this worker was paused past 3 heartbeats: its retry trains it again): "LOST"."""
        if run.tensorboard is not None:
            run.tensorboard.close()
        if isinstance(error, StorageUnavailable):
            raise error
        try:
            if not self._store(study).frozen_trial(run.trial.number).state.is_finished():
                return self._tell_end(study, run, result, error, callbacks, reraise)
        except finished_trial_error():  # given up between the check and the tell
            pass
        finally:
            self._store(study).ended(run.trial.number)
        print(f"trial {run.trial.number} was failed by another worker while this one was paused (past 3 heartbeats):"
              " its result is dropped and its retry trains it again", file=sys.stderr, flush=True)
        for cb in callbacks:
            cb.on_trial_end(run.trial.number, "LOST")
        if reraise and error is not None and not isinstance(error, Exception):  # Ctrl-C still stops the worker
            raise error
        return "LOST"

    def _tell_end(self, study, run: "TrialRun", result, error: BaseException | None,
                  callbacks: Sequence[SearchCallback], reraise: bool) -> str:
        import optuna
        import torch
        from optuna.trial import TrialState

        trial, pruning = run.trial, run.pruning
        state, values = TrialState.FAIL, None
        if error is None:
            values = [o.value(result) for o in self.objectives]
            record_result(trial, result)
            state = TrialState.COMPLETE
        elif isinstance(error, optuna.TrialPruned):
            trial.set_user_attr("epochs_run", len(pruning.curve))
            state = TrialState.PRUNED
        elif isinstance(error, Diverged):
            trial.set_user_attr("fail_reason", str(error))
            trial.set_user_attr("epochs_run", len(pruning.curve))
        elif isinstance(error, torch.cuda.OutOfMemoryError):
            trial.set_user_attr("fail_reason", "out of GPU memory")
            trial.set_user_attr("epochs_run", len(pruning.curve))
            torch.cuda.empty_cache()
        else:
            reason = "interrupted (Ctrl-C)" if isinstance(error, KeyboardInterrupt) else f"{type(error).__name__}: {error}"
            # Retried: after Ctrl-C another process (a dashboard, a poller) may hold SQLite's lock for a moment,
            # and the interruption must not turn into a storage error that leaves the trial RUNNING.
            with_storage_retries(lambda: trial.set_user_attr("fail_reason", reason))
            with_storage_retries(lambda: study.tell(trial, state=TrialState.FAIL))
            if reraise:
                raise error
            return "FAIL"
        if run.run_dir.is_dir():  # lets `headsearch analyze` upload its figures to this trial
            write_trial_link(run.run_dir, self.settings.storage, self.study_name, trial.number)
        if state == TrialState.COMPLETE:
            study.tell(trial, values=values)
        else:
            study.tell(trial, state=state)
        for cb in callbacks:
            cb.on_trial_end(trial.number, state.name)
        self._call_optuna_callbacks(study, trial.number)
        return state.name

    def _call_optuna_callbacks(self, study, number: int) -> None:
        """The user's Optuna callbacks on the trial just told, as `study.optimize` calls them (an exception
        in one stops this worker, as it stops `optimize`)."""
        if not self.optuna_callbacks:
            return
        frozen = next(t for t in study.get_trials(deepcopy=True) if t.number == number)
        for callback in self.optuna_callbacks:
            callback(study, frozen)

    # -- cohorts ------------------------------------------------------------------------------
    def run_cohort_worker(self, size: int, worker_index: int = 0, callbacks: Sequence[SearchCallback] = (),
                          argv: list[str] | None = None) -> None:
        """`run_worker` with `size` trials trained together as one stacked model (headsearch.training.cohort).

        Free slots are filled with newly asked trials (each at its own epoch 1) until the budget is spent;
        after every epoch each trial is judged by the pruner on its own, and a trial that ends (complete,
        pruned, diverged) is told and its slot refilled. A trial that cannot join (another stack signature)
        trains alone at once. Ctrl-C or a crash tells every trial in the cohort FAIL before it propagates.
        """
        from headsearch.training.cohort import Cohort

        study = self.open()
        device = resolve_device(self.settings.device)
        cohort = Cohort(self.task, size, device, soft_columns=self.soft_columns(), share=self._device_share(device))
        self.run_interleaved(study, cohort, device, callbacks, argv)

    def run_interleaved(self, study, cohort, device, callbacks: Sequence[SearchCallback] = (), argv: list[str] | None = None) -> None:
        """The loop of `run_cohort_worker` over any `cohort`: an object with free slots that trains its
        trials an epoch at a time and hands back the ones that ended (headsearch.training.cohort.Cohort;
        headsearch.search.simulate's table, which looks each epoch up instead). The trials are asked,
        sampled, deduplicated, judged by the pruner and told by this search's own code either way."""
        start, exhausted = time.monotonic(), False
        beats: dict[int, Heartbeat] = {}
        try:
            while True:
                timed_out = self.settings.timeout is not None and time.monotonic() - start >= self.settings.timeout
                while cohort.free and not exhausted and not timed_out:
                    trial = self._next_trial(study)
                    if trial is None:
                        exhausted = True
                    elif trial is WAIT:
                        if cohort.occupied:
                            break  # train the trials at hand; ask again after their epoch
                        time.sleep(self.wait_seconds())
                    else:
                        self._join(study, trial, cohort, device, callbacks, argv, beats)
                if not cohort.occupied:
                    if exhausted or timed_out:
                        return
                    continue
                for end in cohort.train_epoch():
                    beats.pop(end.slot).__exit__(None, None, None)
                    self._end_trial(study, end.tag, end.result if end.error is None else None, end.error, callbacks)
        except BaseException as e:
            stopped = e if isinstance(e, KeyboardInterrupt) else RuntimeError(
                f"the cohort's worker stopped: {type(e).__name__}: {e}")
            for end in cohort.interrupt():
                beats.pop(end.slot).__exit__(None, None, None)
                # A run that ended before the interruption is told as it ended; the others as interrupted.
                error = stopped if end.result.status == "interrupted" else end.error
                self._end_trial(study, end.tag, end.result if error is None else None, error, callbacks, reraise=False)
            raise

    def _join(self, study, trial, cohort, device, callbacks: Sequence[SearchCallback], argv, beats: dict) -> None:
        """Begin `trial` and put it in a free slot of `cohort`, or train it alone now if it cannot join."""
        run = self._begin_trial(study, trial, device, callbacks)
        if isinstance(run, str):
            return
        if (why := cohort.refusal(run.cfg)) is not None:
            trial.set_user_attr("cohort", {"size": 1, "why": why})
            self._train_alone(study, run, device, callbacks, argv)
            return
        beat = self._heartbeat(study, trial.number).__enter__()
        try:
            bound = self._bound_for(run.cfg, device) if getattr(cohort, "needs_data", True) else None
            slot = cohort.add(run.cfg, bound, run.run_dir, argv=argv, clock=run.clock, tag=run,
                              callbacks=run.trainer_callbacks(callbacks))
        except BaseException as e:
            beat.__exit__(None, None, None)
            self._end_trial(study, run, None, e, callbacks)
            return
        beats[slot] = beat
        trial.set_user_attr("cohort", {"size": cohort.size, "slot": slot, "worker": f"{socket.gethostname()}:{os.getpid()}"})

    def soft_columns(self) -> int | None:
        """The soft-branch width a cohort keeps (None: the space never fuses): enough for the fewest heads it may sample."""
        from headsearch.models.cohort import soft_width

        space = self.space
        if all(f == "none" for f in space.fusions) and self.base.arch.fusion == "none":
            return None
        fewest = min(space.heads)
        if {"halving", "doubling"} & set(space.families):
            fewest = min(fewest, space.min_heads)
        return soft_width(self.base.arch, max(1, fewest))

    def alone_clock(self, study, trial, cfg: RunConfig, device) -> AloneClock:
        """The trial's fair clock (headsearch.search.fairtime): this device's lock, and the architecture's
        epoch seconds alone if an earlier trial measured them in the step mode this one runs (then nobody
        is paused again). The trial's `alone_key` names that mode once its steps are prepared (a fallback
        changes it)."""
        import torch

        from headsearch.training.fastpath import resolve_mode

        if self.alone_threads is None:
            self.alone_threads = torch.get_num_threads()
        self._device_share(device)
        threads = self.alone_threads if device.type == "cpu" else None

        def recall(step_mode: str) -> float | None:
            key = alone_key(cfg, device, threads, step_mode)
            trial.set_user_attr("alone_key", key)
            return known_epoch_seconds(study, key)

        intended = resolve_mode(cfg.train, self.task, device).describe()
        return AloneClock(self._share, known=recall(intended), alone_threads=self.alone_threads, recall=recall)

    def _device_share(self, device):
        """This worker's hold on the device's lock (one per process)."""
        if self._share is None:
            self._share = device_share(device)
        return self._share

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

    def check_space_feasible(self, device, samples: int = FEASIBILITY_SAMPLES) -> None:
        """Sample the space at random (in memory, no study is touched) until one architecture passes
        `sample_config`; if none of `samples` does, no study should be created: say why, with the
        commonest reason."""
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        scratch = optuna.create_study(directions=self.directions, sampler=optuna.samplers.RandomSampler(seed=self.settings.seed))
        reasons: dict[str, int] = {}
        for _ in range(samples):
            try:
                self.sample_config(scratch.ask(), device)
                return
            except ConfigError as e:
                reasons[str(e)] = reasons.get(str(e), 0) + 1
        commonest = max(reasons, key=reasons.get)
        raise ConfigError(f"no architecture of space {self.space.name} is valid for {self.task.name}"
                          f" ({samples} random samples, all rejected), e.g. {commonest}")

    def architectures(self) -> "dict[str, dict[str, Any]] | None":
        """Every distinct valid config of the space, as {config key: the first parameters that give it}
        (`config_key`; e.g. halving from 1 head and uniform 1 head are one architecture). None when the
        space cannot be listed (a continuous range) or is a grid (a comparison's: each point is its own)."""
        from optuna.trial import FixedTrial

        from headsearch.search.space import enumerate_params

        if self._listed:
            return self._architectures
        self._listed = True
        if getattr(self.space, "next_point", None) is None:
            params = enumerate_params(lambda t: self.space.sample(t, self.base))
            if params is not None:
                device = resolve_device(self.settings.device)
                found: dict[str, dict[str, Any]] = {}
                for p in params:
                    try:
                        cfg = self.sample_config(FixedTrial(p), device)
                    except ConfigError:
                        continue
                    found.setdefault(config_key(cfg.to_dict()), p)
                self._architectures = found
        return self._architectures

    def params_of(self, config: "Path | dict[str, Any]") -> dict[str, Any]:
        """The space's parameters that give `config` (a YAML path or mapping: architecture fields, or a run
        config whose `arch` is taken) on this search's base config: what `enqueue` puts first. ConfigError,
        naming the config, when the space cannot be listed or does not hold that architecture."""
        from headsearch.config import is_run_config, load_yaml

        name = str(config) if isinstance(config, (str, Path)) else "the config"
        d = load_yaml(Path(config)) if isinstance(config, (str, Path)) else config
        if not isinstance(d, dict):
            raise ConfigError(f"{name}: give architecture fields (as in examples/) or a run config")
        cfg = apply_overrides(self.task, self.base, {"arch": d["arch"] if is_run_config(d) else d})
        archs = self.architectures()
        if archs is None:
            raise ConfigError(f"{name}: space {self.space.name} cannot be listed (a continuous range), so an architecture"
                              " cannot be put first; search without --enqueue")
        params = archs.get(config_key(cfg.to_dict()))
        if params is None:
            base, mine = self.base.arch, cfg.arch
            raise ConfigError(f"{name}: {arch_summary(cfg)} (d_model {mine.d_model}, {mine.enc_layers} layers) is not an"
                              f" architecture of space {self.space.name} on this search's base (d_model {base.d_model},"
                              f" {base.enc_layers} layers); `headsearch spaces` lists what the space holds")
        return params

    def enqueue(self, study, params: Sequence[dict[str, Any]]) -> list[int]:
        """Put architectures first (Optuna's `enqueue_trial`: a warm start from known ones, e.g. the papers'),
        each unless a trial of the study already has its parameters (a resumed search enqueues nothing twice).
        Returns the indices in `params` that were enqueued."""
        have = [t.params for t in study.get_trials(deepcopy=False)]
        out = []
        for i, p in enumerate(params):
            if p not in have:
                study.enqueue_trial(p)
                have.append(p)
                out.append(i)
        return out

    def trial_target(self) -> int:
        """The trials the search will train: --trials, or fewer when the space holds fewer architectures."""
        archs = self.architectures()
        return min(self.settings.trials, len(archs)) if archs else self.settings.trials

    def space_line(self) -> str | None:
        """Said with the plan when the space is smaller than --trials; None otherwise."""
        archs = self.architectures()
        if archs is None or len(archs) >= self.settings.trials:
            return None
        return (f"space {self.space.name} holds {len(archs)} distinct architectures, fewer than --trials"
                f" {self.settings.trials}: each is trained once and the search ends")

    def sample_config(self, trial, device) -> RunConfig:
        """The trial's config: the space's sample on the base config, checked as `headsearch train` checks
        one (the task's own checks and the size guard). Raises ConfigError for an invalid one."""
        cfg = apply_overrides(self.task, self.base, self.space.sample(trial, self.base))
        self.task.check_config(cfg)
        check_fits(self.task, cfg, device)
        return cfg

    def _holder(self, trials, key: str, number: int):
        """A trial other than `number` that holds the architecture `key`: finished (complete, pruned, failed
        for good) or running. Training it again would repeat it."""
        for t in trials:
            if t.number != number and holds_architecture(t) and config_key(t.user_attrs.get("config")) == key:
                return t
        return None

    def _untried_point(self, trials, seed_index: int) -> dict[str, Any] | None:
        """The parameters of an architecture of the space that no trial holds, drawn at random (seeded by the
        trial index); None when every one is held, or the space cannot be listed."""
        import random

        archs = self.architectures()
        if archs is None:
            return None
        held = {config_key(t.user_attrs.get("config")) for t in trials if holds_architecture(t)}
        free = [p for k, p in archs.items() if k not in held]
        if not free:
            return None
        return random.Random(self.settings.seed * 100_003 + seed_index).choice(free)


def config_key(config: Any) -> str:
    """A config dict as one string: two trials with equal keys train the same thing (seed included)."""
    return json.dumps(config, sort_keys=True, default=str)


def holds_architecture(t) -> bool:
    """Whether trial `t` holds its architecture: it ran or runs it (complete, pruned, running) or failed for
    good (diverged, out of memory). Not: a rejected config, a duplicate proposal, an interrupted run (retried)."""
    from optuna.trial import TrialState

    a = t.user_attrs
    if "config" not in a or "rejected" in a or "duplicate_of" in a:
        return False
    if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING):
        return True
    return t.state == TrialState.FAIL and "fail_reason" in a and not str(a["fail_reason"]).startswith("interrupted")


def with_storage_retries(write, attempts: int = 5, wait: float = 0.2):
    """`write()`, tried again (after `wait`, doubling) when the storage fails transiently (Optuna's
    StorageInternalError: e.g. SQLite locked by another reader); the last failure is raised."""
    from optuna.exceptions import StorageInternalError

    for attempt in range(attempts):
        try:
            return write()
        except StorageInternalError:
            if attempt == attempts - 1:
                raise
            time.sleep(wait * 2**attempt)


def arch_summary(cfg: RunConfig) -> str:
    a = cfg.arch
    heads = "-".join(map(str, a.enc_heads))
    return f"{heads} skip={a.skip} fusion={a.fusion}"


# TrainResult fields a complete trial keeps under the same names (with every convergence objective's).
RECORDED = ("epochs_run", "best_epoch", "best_train_seconds", "train_seconds", "compile_seconds", "seconds_to_target",
            "params", "samples_per_s", "epoch_seconds_alone", "step_mode", "step_note")


def record_result(trial, result) -> None:
    """What a complete trial keeps of its training (`Objective.trial_value` reads the objectives back)."""
    for name in dict.fromkeys([*RECORDED, *(c.attr for c in CONVERGENCE.values())]):
        trial.set_user_attr(name, getattr(result, name))
    trial.set_user_attr("val_metrics", result.best_metrics)
    if result.best_diversity:
        trial.set_user_attr("diversity", result.best_diversity)
    trial.set_user_attr("test_metrics", result.test_metrics)


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
