"""`headsearch run`: a multi-objective Optuna search over head architectures, with pruning.

Each trial samples an architecture from a search space, trains it with the task's trainer in its
own run directory, and reports the objectives: the task's quality metric on the validation split
and convergence figures (seconds or epochs to the best validation metric, parameter count).

Pruning: Optuna's `report`/`should_prune` refuse multi-objective studies, so there each epoch's
primary metric is written into the trial's intermediate values through the storage and judged
against the other trials' curves by `headsearch.search.pruning`; single-objective studies use
Optuna's own pruners with the same rules. A pruned trial is stored PRUNED with its reason.

Workers: `run_worker` loops "take the budget lock, count, ask; train; tell", so any number of
processes on any number of machines sharing one storage run exactly `trials` trials between them.
`run_workers` starts such processes on one machine: `--workers N`, or `--trials-per-gpu K` (K per
visible GPU, for models too small to fill one), each pinned to a GPU round-robin (`worker_devices`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from headsearch.config import RunConfig
from headsearch.errors import ConfigError, Diverged, HeadsearchError
from headsearch.search.space import SearchSpace, load_space
from headsearch.search.storage import DEFAULT_STORAGE, Heartbeat, absolute_url, budget_lock, open_storage
from headsearch.tasks import DataSource, Task, apply_overrides, get_task

SAMPLERS = ("nsga2", "tpe", "random", "gp")
WAIT = object()  # _next_trial: the budget is held by running trials; ask again later
PRUNERS = ("median", "percentile", "hyperband", "none")
CONVERGENCE_OBJECTIVES = {
    "time": "training seconds to the best validation metric",
    "epochs": "epochs to the best validation metric",
    "params": "parameter count",
}


@dataclass(frozen=True)
class Objective:
    name: str
    direction: str

    def value(self, result) -> float:
        if self.name == "time":
            return float(result.best_train_seconds)
        if self.name == "epochs":
            return float(result.best_epoch)
        if self.name == "params":
            return float(result.params)
        return float(result.best_metrics[self.name])


def resolve_objectives(task: Task, names: Sequence[str] | None) -> list[Objective]:
    """Default: the task's quality metric and convergence time."""
    names = list(names) if names else [task.primary.name, "time"]
    known = [m.name for m in task.metrics] + list(CONVERGENCE_OBJECTIVES)
    out = []
    for n in names:
        if n not in known:
            raise ConfigError(f"unknown objective {n!r} for task {task.name}: use {', '.join(known)}")
        direction = "minimize" if n in CONVERGENCE_OBJECTIVES else task.metric(n).direction
        out.append(Objective(n, direction))
    if len({o.name for o in out}) != len(out):
        raise ConfigError(f"objectives {names} name one twice")
    return out


@dataclass(frozen=True)
class SearchSettings:
    task: str
    space: str = "deep-head"
    trials: int = 50
    timeout: float | None = None
    objectives: tuple[str, ...] | None = None
    sampler: str | None = None  # default: nsga2 for several objectives, tpe for one
    pruner: str = "median"
    pruner_startup_trials: int | None = None
    pruner_warmup_epochs: int | None = None
    storage: str = DEFAULT_STORAGE
    study: str | None = None  # default: <task>-<space>[-<preset>]
    seed: int = 0
    epochs: int | None = None
    preset: str | None = None
    data_dir: str | None = None
    data_file: str | None = None
    workers: int | None = None  # worker processes on this machine (None: one, unless trials_per_gpu is set)
    trials_per_gpu: int | None = None  # or: this many processes per visible GPU (this many on a machine without one)
    compile: str | None = None  # overrides train.compile for every trial
    run_root: str = "runs"
    device: str = "auto"
    heartbeat: int = 30
    diversity_samples: int = 0  # track the head-diversity scalars each epoch on this many validation samples


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
        self.space = load_space(s.space)
        if self.space.tasks and self.task.name not in self.space.tasks:
            raise ConfigError(f"space {self.space.name} is for {', '.join(self.space.tasks)}, not {self.task.name}")
        self.objectives = resolve_objectives(self.task, s.objectives)
        if s.sampler is not None and s.sampler not in SAMPLERS:
            raise ConfigError(f"unknown sampler {s.sampler!r}: use one of {', '.join(SAMPLERS)}")
        if s.pruner not in PRUNERS:
            raise ConfigError(f"unknown pruner {s.pruner!r}: use one of {', '.join(PRUNERS)}")
        check_process_counts(s)
        base = self.task.config(s.preset, search=True)
        flags: dict[str, Any] = {"seed": s.seed}
        flags["train"] = {"epochs": s.epochs} if s.epochs is not None else {}
        if s.diversity_samples:
            flags["train"]["diversity_samples"] = s.diversity_samples
        if s.compile is not None:
            flags["train"]["compile"] = s.compile
        self.base = self.space.base_config(apply_overrides(self.task, base, flags), lambda c, o: apply_overrides(self.task, c, o))
        self.task.check_config(self.base)  # e.g. CUDA graphs for a task whose shapes vary: before any study exists
        self.study_name = s.study or "-".join([self.task.name, self.space.name] + ([s.preset] if s.preset else []))
        self.source = DataSource(Path(s.data_dir) if s.data_dir else None, Path(s.data_file) if s.data_file else None)
        self.task.check_source(self.source)
        self.make_pruner()  # bad pruner options fail here, before any storage is touched
        self._bound_key: str | None = None
        self._bound = None

    def worker_devices(self) -> list[str | None]:
        """CUDA_VISIBLE_DEVICES of each worker process this machine starts (None: CPU); its length is the count."""
        visible = [] if self.settings.device == "cpu" else visible_gpus()
        return worker_devices(process_count(self.settings, len(visible)), visible)

    # -- the study --------------------------------------------------------------------------
    @property
    def directions(self) -> list[str]:
        return [o.direction for o in self.objectives]

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    def sampler_name(self) -> str:
        return self.settings.sampler or ("nsga2" if self.multi_objective else "tpe")

    def make_sampler(self, trial_index: int = 0):
        """Seeded by the index of the trial about to start (counted under the budget lock), so workers
        started anywhere propose different points and a search replays the same way."""
        import optuna

        seed = self.settings.seed * 100_003 + trial_index
        name = self.sampler_name()
        if name == "nsga2":
            # A population of 50 would spend a 50-trial budget on one random generation.
            pop = max(4, min(50, self.settings.trials // 4))
            return optuna.samplers.NSGAIISampler(population_size=pop, seed=seed)
        if name == "tpe":
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True)
        if name == "gp":
            return optuna.samplers.GPSampler(seed=seed)
        return optuna.samplers.RandomSampler(seed=seed)

    def make_pruner(self):
        from headsearch.search.pruning import make_curve_pruner, make_optuna_pruner

        s = self.settings
        # Pruning starts once a quarter of the budget has finished (2 to 5 trials) unless told otherwise.
        startup = s.pruner_startup_trials if s.pruner_startup_trials is not None else max(2, min(5, s.trials // 4))
        opts = dict(n_startup_trials=startup, n_warmup_epochs=s.pruner_warmup_epochs)
        if self.multi_objective:
            return None, make_curve_pruner(s.pruner, self.task.primary.direction, **opts)
        return make_optuna_pruner(s.pruner, epochs=self.base.train.epochs, **opts), None

    def study_attrs(self) -> dict[str, Any]:
        return {
            "headsearch": {"task": self.task.name, "space": self.space.summary(),
                           "objectives": [dataclasses.asdict(o) for o in self.objectives],
                           "primary_metric": self.task.primary.name, "base_config": self.base.to_dict(),
                           "sampler": self.sampler_name(), "pruner": self.settings.pruner, "seed": self.settings.seed,
                           "trials": self.settings.trials, "epochs": self.base.train.epochs,
                           "run_root": str(Path(self.settings.run_root).resolve() / self.study_name),
                           "data": str(Path(self.source.describe()).resolve()) if self.source.describe() != "download" else "download"},
        }

    def open(self):
        """Create the study, or load it and check it is the same search."""
        import optuna

        storage = open_storage(self.settings.storage, self.settings.heartbeat)
        optuna_pruner, _ = self.make_pruner()
        study = optuna.create_study(storage=storage, study_name=self.study_name, directions=self.directions,
                                    sampler=self.make_sampler(0), pruner=optuna_pruner, load_if_exists=True)
        mine = self.study_attrs()["headsearch"]
        stored = study.user_attrs.get("headsearch")
        if stored is None:
            study.set_user_attr("headsearch", mine)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*set_metric_names")
                study.set_metric_names([o.name for o in self.objectives])
        else:
            for key in ("task", "objectives", "base_config", "space"):
                if _comparable(key, stored[key]) != _comparable(key, mine[key]):
                    raise HeadsearchError(
                        f"study {self.study_name} exists in {self.settings.storage} with a different {key}:"
                        f" pass another --study to start a new search (or the original settings to resume)"
                    )
        return study

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
                if waiting == 0 and counted >= self.settings.trials:
                    # Running trials fill the rest of the budget. With heartbeats, wait for them: one may
                    # belong to a dead worker and come back as a retry (or fail and free its place).
                    return WAIT if running and hasattr(study._storage, "record_heartbeat") else None
                study.sampler = self.make_sampler(len(trials))
                return study.ask()

    def run_worker(self, worker_index: int = 0, callbacks: Sequence = (), argv: list[str] | None = None) -> None:
        """Run trials until the study holds `trials` finished ones or `timeout` passes."""
        study = self.open()
        start = time.monotonic()
        while self.settings.timeout is None or time.monotonic() - start < self.settings.timeout:
            trial = self._next_trial(study)
            if trial is None:
                break
            if trial is WAIT:
                time.sleep(min(self.settings.heartbeat, 10))
                continue
            self.run_trial(study, trial, worker_index, callbacks, argv)

    def prepare_data(self) -> None:
        """Load the data now, so that missing or malformed data fails before a study is created."""
        from headsearch.training.trainer import resolve_device

        self._bound_for(self.base, resolve_device(self.settings.device))

    def _bound_for(self, cfg: RunConfig, device):
        """Load data once per worker; later trials rebind it to their config."""
        key = json.dumps([cfg.data, cfg.seed], sort_keys=True, default=str)
        if key != self._bound_key:
            self._bound = self.task.setup(cfg, self.source, device)
            self._bound_key = key
            return self._bound
        return self._bound.rebind(cfg)

    def run_trial(self, study, trial, worker_index: int = 0, callbacks: Sequence = (), argv: list[str] | None = None) -> str:
        """Sample, train and tell one trial. Returns its final state's name."""
        import optuna
        import torch
        from optuna.trial import TrialState

        from headsearch.training import train_bound
        from headsearch.training.trainer import resolve_device

        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        try:
            cfg = apply_overrides(self.task, self.base, self.space.sample(trial, self.base))
        except ConfigError as e:
            # An invalid combination (e.g. a head count that does not divide a searched d_model):
            # recorded as such, and never trained.
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
            getattr(cb, "on_trial_start", lambda *a: None)(trial.number, cfg)
        device = resolve_device(self.settings.device)
        optuna_pruner, curve_pruner = self.make_pruner()
        pruning = TrialPruning(study, trial, self.task.primary.name, curve_pruner, self.settings.pruner, not self.multi_objective)
        state, values = TrialState.FAIL, None
        try:
            with Heartbeat(study._storage, trial._trial_id, self.settings.heartbeat):
                bound = self._bound_for(cfg, device)
                result = train_bound(cfg, bound, run_dir, device=device, argv=argv, callbacks=[pruning, *callbacks])
            values = [o.value(result) for o in self.objectives]
            record_result(trial, result)
            state = TrialState.COMPLETE
        except optuna.TrialPruned:
            trial.set_user_attr("epochs_run", len(pruning.curve))
            state = TrialState.PRUNED
        except Diverged as e:
            trial.set_user_attr("fail_reason", str(e))
            trial.set_user_attr("epochs_run", len(pruning.curve))
        except torch.cuda.OutOfMemoryError:
            trial.set_user_attr("fail_reason", "out of GPU memory")
            trial.set_user_attr("epochs_run", len(pruning.curve))
            torch.cuda.empty_cache()
        except KeyboardInterrupt:
            trial.set_user_attr("fail_reason", "interrupted (Ctrl-C)")
            study.tell(trial, state=TrialState.FAIL)
            raise
        except BaseException as e:
            trial.set_user_attr("fail_reason", f"{type(e).__name__}: {e}")
            study.tell(trial, state=TrialState.FAIL)
            raise
        if run_dir.is_dir():  # lets `headsearch analyze` upload its figures to this trial
            (run_dir / "study.json").write_text(json.dumps(
                {"storage": absolute_url(self.settings.storage), "study": self.study_name, "trial": trial.number}) + "\n")
        if state == TrialState.COMPLETE:
            study.tell(trial, values=values)
        else:
            study.tell(trial, state=state)
        for cb in callbacks:
            getattr(cb, "on_trial_end", lambda *a: None)(trial.number, state.name)
        return state.name


    def _completed_twin(self, study, cfg: RunConfig):
        """A complete trial with exactly this config (seed included): training it again would repeat it."""
        from optuna.trial import TrialState

        mine = json.dumps(cfg.to_dict(), sort_keys=True)
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if json.dumps(t.user_attrs.get("config"), sort_keys=True) == mine:
                return t
        return None

    def _reuse(self, study, trial, twin, callbacks) -> str:
        """Small categorical spaces make samplers propose a finished point again: reuse its results."""
        for k, v in twin.user_attrs.items():
            if k not in ("worker",):
                trial.set_user_attr(k, v)
        trial.set_user_attr("duplicate_of", twin.number)
        for epoch, value in twin.intermediate_values.items():
            study._storage.set_trial_intermediate_value(trial._trial_id, epoch, value)
        study.tell(trial, values=twin.values)
        for cb in callbacks:
            getattr(cb, "on_trial_end", lambda *a: None)(trial.number, "COMPLETE")
        return "COMPLETE"


# How a trial runs, not what it computes: a study may be resumed with --compile on or off.
EXECUTION_ONLY = {"train": ("compile", "channels_last")}


def _comparable(key: str, value: Any) -> str:
    if key == "base_config" and isinstance(value, dict):
        value = {section: ({k: v for k, v in fields.items() if k not in EXECUTION_ONLY.get(section, ())}
                           if isinstance(fields, dict) else fields) for section, fields in value.items()}
    return json.dumps(value, sort_keys=True)


def arch_summary(cfg: RunConfig) -> str:
    a = cfg.arch
    heads = "-".join(map(str, a.enc_heads))
    return f"{heads} skip={a.skip} fusion={a.fusion}"


def record_result(trial, result) -> None:
    trial.set_user_attr("epochs_run", result.epochs_run)
    trial.set_user_attr("best_epoch", result.best_epoch)
    trial.set_user_attr("best_train_seconds", result.best_train_seconds)
    trial.set_user_attr("train_seconds", result.train_seconds)
    trial.set_user_attr("compile_seconds", result.compile_seconds)
    trial.set_user_attr("seconds_to_target", result.seconds_to_target)
    trial.set_user_attr("params", result.params)
    trial.set_user_attr("samples_per_s", result.samples_per_s)
    trial.set_user_attr("val_metrics", result.best_metrics)
    if result.best_diversity:
        trial.set_user_attr("diversity", result.best_diversity)
    trial.set_user_attr("test_metrics", result.test_metrics)


class TrialPruning:
    """Trainer callback: record each epoch's primary metric as an intermediate value and prune."""

    def __init__(self, study, trial, metric: str, curve_pruner, pruner_name: str, single_objective: bool):
        self.study, self.trial, self.metric = study, trial, metric
        self.curve_pruner, self.pruner_name, self.single = curve_pruner, pruner_name, single_objective
        self.curve: dict[int, float] = {}

    def on_start(self, *a) -> None: ...
    def on_step(self, *a) -> None: ...

    def on_epoch_end(self, record) -> None:
        from optuna.trial import TrialState

        epoch, value = record.epoch, float(record.metrics[self.metric])
        self.curve[epoch] = value
        if self.single:
            self.trial.report(value, epoch)
            if self.trial.should_prune():
                self._prune({"prune": True, "rule": self.pruner_name, "epoch": epoch, "value": value, "threshold": None,
                             "n_compared": None, "note": "Optuna's pruner (single objective): it does not expose its threshold"})
            return
        # Multi-objective: Trial.report refuses, the storage API does not (DESIGN.md §7).
        self.study._storage.set_trial_intermediate_value(self.trial._trial_id, epoch, value)
        if self.curve_pruner is None:
            return
        # Median/percentile compare with complete trials (Optuna's semantics, so single- and
        # multi-objective studies prune alike); the rung rule with every trial that reached the rung (ASHA).
        states = (TrialState.COMPLETE, TrialState.PRUNED) if self.pruner_name == "hyperband" else (TrialState.COMPLETE,)
        others = [t.intermediate_values for t in self.study.get_trials(deepcopy=False, states=states)
                  if "rejected" not in t.user_attrs and t.number != self.trial.number]
        decision = self.curve_pruner.decide(epoch, self.curve, others)
        if decision.prune:
            self._prune(decision.reason())

    def _prune(self, reason: dict) -> None:
        import optuna

        self.trial.set_user_attr("pruned", reason)
        raise optuna.TrialPruned(f"pruned at epoch {reason['epoch']} by the {reason['rule']} rule")


def check_process_counts(s: SearchSettings) -> None:
    """--trials, and --workers or --trials-per-gpu (not both): one-line errors."""
    if s.workers is not None and s.trials_per_gpu is not None:
        raise ConfigError("--workers and --trials-per-gpu both set the number of worker processes: pass one of them")
    if s.trials < 1 or (s.workers is not None and s.workers < 1):
        raise ConfigError("--trials and --workers must be at least 1")
    if s.trials_per_gpu is not None and s.trials_per_gpu < 1:
        raise ConfigError(f"--trials-per-gpu {s.trials_per_gpu}: run at least 1 trial per GPU")


def process_count(s: SearchSettings, n_gpus: int) -> int:
    """Worker processes on this machine: --workers, or --trials-per-gpu times the GPUs (times one without GPUs)."""
    if s.trials_per_gpu is not None:
        return s.trials_per_gpu * max(1, n_gpus)
    return s.workers or 1


def visible_gpus() -> list[str]:
    """The GPUs this process may use, named as CUDA_VISIBLE_DEVICES names them (an index, a UUID or a MIG ID)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        try:
            import torch

            return [str(i) for i in range(torch.cuda.device_count())]
        except Exception:
            return []
    ids = []
    for name in (v.strip() for v in listed.split(",")):
        if name.startswith("-"):  # CUDA ignores an invalid ID and all after it ("-1" hides every GPU)
            break
        if name:
            ids.append(name)
    return ids


def worker_devices(n_workers: int, visible: Sequence[str]) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each of `n_workers` processes: round-robin over the `visible` GPU names
    (worker i gets visible[i % len(visible)]), so K x len(visible) workers put K on each GPU and the first
    len(visible) workers start on different GPUs. No GPUs: None for every worker (they share the CPU)."""
    if not visible:
        return [None] * n_workers
    return [visible[i % len(visible)] for i in range(n_workers)]


def run_workers(search: Search, argv: list[str] | None = None) -> list:
    """Start the worker processes (`Search.worker_devices`), each pinned to its GPU; return the processes."""
    import multiprocessing as mp

    devices = search.worker_devices()
    ctx = mp.get_context("spawn")
    procs = []
    for i, gpu in enumerate(devices):
        p = ctx.Process(target=_worker_main, args=(search.settings, i, gpu, len(devices), argv), name=f"headsearch-worker-{i}")
        p.start()
        procs.append(p)
    return procs


def _worker_main(settings: SearchSettings, index: int, gpu: str | None, n_processes: int, argv) -> None:
    if gpu is not None:
        # The parent's own name for the GPU (CUDA_VISIBLE_DEVICES "2,3" gives "2" and "3"), set before
        # torch initialises CUDA in this process, which then sees it as cuda:0.
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    else:  # CPU workers share the cores instead of each starting one thread per core
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n_processes))
    log_dir = Path(settings.run_root) / (Search(settings).study_name) / "workers"
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"worker-{index}.log", "a") as log:
        sys.stdout = sys.stderr = log
        try:
            Search(settings).run_worker(index, argv=argv)
        except KeyboardInterrupt:
            pass
        except BaseException:
            traceback.print_exc()
            raise SystemExit(1)
