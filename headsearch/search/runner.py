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

import json
import os
import socket
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
from headsearch.search.pruning import comparison_curves, make_curve_pruner, make_optuna_pruner
from headsearch.search.settings import SearchSettings, check_settings
from headsearch.search.space import SearchSpace, load_space
from headsearch.search.storage import Heartbeat, budget_lock
from headsearch.search.study import check_sampler, default_sampler, make_sampler, open_study
from headsearch.tasks import DataSource, Task, apply_overrides, flag_overrides, get_task, resolve_config
from headsearch.training import check_fits, preflight
from headsearch.training.trainer import AloneClock, Callback, EpochRecord, resolve_device

__all__ = ["Search", "SearchCallback", "SearchSettings", "TrialPruning", "arch_summary", "record_result"]

FEASIBILITY_SAMPLES = 200  # random architectures tried before a space is declared to have no valid one
WAIT = object()  # _next_trial: the budget is held by running trials; ask again later


@dataclass
class TrialRun:
    """A trial being trained: its config, run directory, pruning callback and fair clock."""

    trial: Any
    cfg: RunConfig
    run_dir: Path
    pruning: "TrialPruning"
    clock: AloneClock


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
        check_settings(s)
        check_sampler(self.sampler_name(), len(self.objectives))
        # The preset's search budget < the flags < the space's fixed values.
        flags = flag_overrides(seed=s.seed, epochs=s.epochs, compile=s.compile, diversity_samples=s.diversity_samples or None)
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
        self.current_trial: int | None = None  # the number of the trial this worker is running, if any
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
        return make_sampler(self.sampler_name(), seed=self.settings.seed, trials=self.settings.trials, trial_index=trial_index)

    def make_pruner(self):
        """(Optuna's pruner, None) for one objective; (None, the curve pruner or None) for several."""
        s = self.settings
        # Pruning starts once a quarter of the budget has finished (2 to 5 trials) unless told otherwise.
        startup = s.pruner_startup_trials if s.pruner_startup_trials is not None else max(2, min(5, s.trials // 4))
        opts = dict(n_startup_trials=startup, n_warmup_epochs=s.pruner_warmup_epochs)
        if self.multi_objective:
            return None, make_curve_pruner(s.pruner, self.task.primary.direction, **opts)
        return make_optuna_pruner(s.pruner, epochs=self.base.train.epochs, **opts), None

    def study_attrs(self) -> dict[str, Any]:
        described = self.source.describe()
        return {
            "headsearch": {"task": self.task.name, "space": self.space.summary(),
                           "objectives": [o.stored() for o in self.objectives],
                           "primary_metric": self.task.primary.name, "base_config": self.base.to_dict(),
                           "sampler": self.sampler_name(), "pruner": self.settings.pruner, "seed": self.settings.seed,
                           "trials": self.settings.trials, "epochs": self.base.train.epochs,
                           "run_root": str(Path(self.settings.run_root).resolve() / self.study_name),
                           "data": str(Path(described).resolve()) if described != "download" else "download"},
        }

    def open(self):
        """Create the study, or load it and check it is the same search."""
        optuna_pruner, _ = self.make_pruner()
        return open_study(self.settings.storage, self.settings.heartbeat, self.study_name,
                          metric_names=[o.name for o in self.objectives], directions=self.directions,
                          attrs=self.study_attrs()["headsearch"], sampler=self.make_sampler(0), pruner=optuna_pruner)

    # -- the worker loop --------------------------------------------------------------------
    def _next_trial(self, study):
        from optuna.storages import fail_stale_trials
        from optuna.trial import TrialState

        with budget_lock(self.settings.storage, self.study_name):
            with warnings.catch_warnings():
                # Optuna warns that heartbeats go with Study.optimize; ask/tell workers beat themselves (Heartbeat).
                warnings.filterwarnings("ignore", message="Heartbeat of storage")
                warnings.filterwarnings("ignore", message=".*fail_stale_trials is experimental")
                if hasattr(study._storage, "record_heartbeat"):
                    fail_stale_trials(study)  # a dead worker's trial -> FAIL, re-enqueued as WAITING
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
                # Nothing left to ask: running trials hold the rest. With heartbeats, wait for them: one may
                # belong to a dead worker and come back as a retry (or fail and free its place).
                done = WAIT if running and hasattr(study._storage, "record_heartbeat") else None
                if waiting == 0 and counted >= self.settings.trials:
                    return done
                study.sampler = self.make_sampler(len(trials))
                next_point = getattr(self.space, "next_point", None)  # a grid that says which point comes next
                if next_point is not None and waiting == 0:
                    point = next_point(trials)
                    if point is None:  # every point is held, by finished runs or running ones
                        return done
                    study.enqueue_trial(point)
                return study.ask()

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
                time.sleep(min(self.settings.heartbeat, 10))
                continue
            self.current_trial = trial.number
            self.run_trial(study, trial, worker_index, callbacks, argv)
            self.current_trial = None

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
            with Heartbeat(study._storage, run.trial._trial_id, self.settings.heartbeat):
                bound = self._bound_for(run.cfg, device)
                result = train_bound(run.cfg, bound, run.run_dir, device=device, argv=argv, clock=run.clock,
                                     callbacks=[run.pruning, *diversity_callbacks(run.cfg), *callbacks])
        except BaseException as e:
            error = e
        try:
            return self._end_trial(study, run, result, error, callbacks)
        finally:
            # This frame -> `error` -> its traceback -> this frame (and fit's, holding the model, its graphs and
            # its optimizer state): a cycle that only the cyclic collector would break. Break it now, so a pruned
            # or failed trial's GPU memory is free before the next trial starts.
            error = None

    def _begin_trial(self, study, trial, device, callbacks: Sequence[SearchCallback]) -> "TrialRun | str":
        """A trial's config, run directory, pruning and fair clock, or the name of the state it ended in
        already ("REJECTED": an invalid config; "COMPLETE": a finished twin's results reused)."""
        from optuna.trial import TrialState

        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        try:
            cfg = self.sample_config(trial, device)
        except ConfigError as e:
            # An invalid combination (e.g. a head count that does not divide a searched d_model, or a
            # model too big for the device): recorded as such, and never trained.
            trial.set_user_attr("rejected", str(e))
            study.tell(trial, state=TrialState.PRUNED)
            return "REJECTED"
        trial.set_user_attr("config", cfg.to_dict())
        trial.set_user_attr("arch", arch_summary(cfg))
        if (same := self._completed_twin(study, cfg)) is not None:
            return self._reuse(study, trial, same, callbacks)
        run_dir = Path(self.settings.run_root) / self.study_name / f"trial-{trial.number:05d}"
        trial.set_user_attr("run_dir", str(run_dir.resolve()))
        for cb in callbacks:
            cb.on_trial_start(trial.number, cfg)
        _, curve_pruner = self.make_pruner()
        pruning = TrialPruning(study, trial, self.task.primary.name, curve_pruner, self.settings.pruner, not self.multi_objective,
                               epochs=cfg.train.epochs)
        return TrialRun(trial, cfg, run_dir, pruning, self.alone_clock(study, trial, cfg, device))

    def _end_trial(self, study, run: "TrialRun", result, error: BaseException | None,
                   callbacks: Sequence[SearchCallback], reraise: bool = True) -> str:
        """Tell the study how a trial ended: COMPLETE with its objectives (`result`), PRUNED, or FAIL with
        its reason. An interruption or an unexpected error is re-raised after the trial is told (unless
        `reraise` is False: a cohort telling its other trials first)."""
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
        return state.name

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
                        time.sleep(min(self.settings.heartbeat, 10))
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
        beat = Heartbeat(study._storage, trial._trial_id, self.settings.heartbeat).__enter__()
        try:
            bound = self._bound_for(run.cfg, device)
            slot = cohort.add(run.cfg, bound, run.run_dir, argv=argv, clock=run.clock, tag=run,
                              callbacks=[run.pruning, *diversity_callbacks(run.cfg), *callbacks])
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

    def sample_config(self, trial, device) -> RunConfig:
        """The trial's config: the space's sample on the base config, checked as `headsearch train` checks
        one (the task's own checks and the size guard). Raises ConfigError for an invalid one."""
        cfg = apply_overrides(self.task, self.base, self.space.sample(trial, self.base))
        self.task.check_config(cfg)
        check_fits(self.task, cfg, device)
        return cfg

    def _completed_twin(self, study, cfg: RunConfig):
        """A complete trial with exactly this config (seed included): training it again would repeat it."""
        from optuna.trial import TrialState

        mine = json.dumps(cfg.to_dict(), sort_keys=True)
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if json.dumps(t.user_attrs.get("config"), sort_keys=True) == mine:
                return t
        return None

    def _reuse(self, study, trial, twin, callbacks: Sequence[SearchCallback]) -> str:
        """Small categorical spaces make samplers propose a finished point again: reuse its results."""
        for k, v in twin.user_attrs.items():
            if k not in ("worker",):
                trial.set_user_attr(k, v)
        trial.set_user_attr("duplicate_of", twin.number)
        for epoch, value in twin.intermediate_values.items():
            study._storage.set_trial_intermediate_value(trial._trial_id, epoch, value)
        study.tell(trial, values=twin.values)
        for cb in callbacks:
            cb.on_trial_end(trial.number, "COMPLETE")
        return "COMPLETE"


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
    and `curve_pruner` judges the curve against `comparison_curves` (see headsearch.search.pruning).
    A trial's last epoch is recorded but not judged: it is trained already, so pruning it saves nothing
    and would only throw its objectives away.
    """

    def __init__(self, study, trial, metric: str, curve_pruner, pruner_name: str, single_objective: bool,
                 epochs: int | None = None):
        self.study, self.trial, self.metric = study, trial, metric
        self.curve_pruner, self.pruner_name, self.single = curve_pruner, pruner_name, single_objective
        self.epochs = epochs  # the trial's last epoch: nothing is left to save there, so it is never pruned
        self.curve: dict[int, float] = {}

    def on_epoch_end(self, record: EpochRecord) -> None:
        epoch, value = record.epoch, float(record.metrics[self.metric])
        self.curve[epoch] = value
        if epoch == 1 and record.epoch_seconds_alone is not None:  # a pruned trial's measurement serves later ones too
            self.trial.set_user_attr("epoch_seconds_alone", record.epoch_seconds_alone)
        last = self.epochs is not None and epoch >= self.epochs
        if self.single:
            self.trial.report(value, epoch)
            if not last and self.trial.should_prune():
                self._prune({"prune": True, "rule": self.pruner_name, "epoch": epoch, "value": value, "threshold": None,
                             "n_compared": None, "note": "Optuna's pruner (single objective): it does not expose its threshold"})
            return
        # Multi-objective: Trial.report refuses, the storage API does not (docs/design.md §7).
        self.study._storage.set_trial_intermediate_value(self.trial._trial_id, epoch, value)
        if self.curve_pruner is None or last:
            return
        others = comparison_curves(self.study.get_trials(deepcopy=False), self.curve_pruner.rule, self.trial.number)
        decision = self.curve_pruner.decide(epoch, self.curve, others)
        if decision.prune:
            self._prune(decision.reason())

    def _prune(self, reason: dict) -> None:
        import optuna

        self.trial.set_user_attr("pruned", reason)
        raise optuna.TrialPruned(f"pruned at epoch {reason['epoch']} by the {reason['rule']} rule")
