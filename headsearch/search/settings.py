"""The settings of `headsearch run`, and their checks that need nothing loaded (one-line errors)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from headsearch.environment import check_environment
from headsearch.errors import ConfigError
from headsearch.search.pruning import pruning_rule
from headsearch.search.storage import DEFAULT_STORAGE
from headsearch.search.study import SAMPLERS

MAX_COHORT = 64


@dataclass(frozen=True)
class SearchSettings:
    task: str
    space: Any = "deep-head"  # a space's name or YAML path, or a space object (compare's ConfigGrid)
    trials: int = 50
    timeout: float | None = None
    objectives: tuple[str, ...] | None = None
    sampler: str | None = None  # default: nsga2 for several objectives, tpe for one
    pruner: str | None = None  # default: pareto for several objectives, median for one
    pruner_startup_trials: int | None = None
    pruner_warmup_epochs: int | None = None
    pruner_min_epochs: int | str | None = None  # the first rung of the rung rules (pareto, asha; pareto: "auto")
    pruner_reduction_factor: int | None = None  # rungs min_epochs * r**k; the top 1/r go on
    pruner_noise_margin: float | None = None  # pareto: a trial's quality gets this many sigmas of noise (None: 0.9)
    pruner_noise: float | None = None  # pareto: the metric's noise sigma, e.g. from `compare` (None: from the curves)
    pruner_percentile: float | None = None  # percentile: prune below this percentile of the others (None: 25)
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
    cohort: int | None = None  # trials each worker trains as one stacked model (None: the plan decides; 1: off)
    run_root: str = "runs"
    device: str = "auto"
    heartbeat: int = 30
    diversity_samples: int = 0  # track the head-diversity scalars each epoch on this many validation samples
    sets: Any = None  # {section: {key: value}} from --set SECTION.KEY=VALUE (tasks.parse_sets), for every trial
    callbacks: tuple[str, ...] = ()  # "module:attr" Optuna callbacks (study, FrozenTrial), called after each trained trial
    tensorboard: str | None = None  # a folder for per-epoch TensorBoard records, one run per trial (DIR/trial-NNNNN)


def _integer(minimum: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _number(low: float, high: float = math.inf) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and low <= v <= high


# The pruning settings (the fields named pruner_*, every one of which the simulator replays), each with its
# check: the rules' own bounds, applied once here whichever rule the search uses.
PRUNING_VALUES: dict[str, tuple[str, Callable[[Any], bool], str]] = {  # field: (its option, its check, what to give)
    "pruner_startup_trials": ("--pruner-startup", _integer(0), "a number of trials >= 0"),
    "pruner_warmup_epochs": ("--pruner-warmup", _integer(0), "a number of epochs >= 0"),
    "pruner_min_epochs": ("--pruner-min-epochs", lambda v: v == "auto" or _integer(1)(v), "an epoch >= 1, or auto"),
    "pruner_reduction_factor": ("--pruner-reduction-factor", _integer(2), "an integer >= 2"),
    "pruner_noise_margin": ("--pruner-noise-margin", _number(0), "a number of sigmas >= 0"),
    "pruner_noise": ("--pruner-noise", _number(0), "the metric's noise sigma, a number >= 0"),
    "pruner_percentile": ("--pruner-percentile", _number(0, 100), "a percentile in [0, 100]"),
}


def check_settings(s: SearchSettings) -> None:
    """The sampler and pruner names, the pruning values, the process counts, the environment's settings."""
    check_environment()
    if s.sampler is not None and s.sampler not in SAMPLERS:
        raise ConfigError(f"unknown sampler {s.sampler!r}: use one of {', '.join(SAMPLERS)}")
    if s.pruner is not None:
        pruning_rule(s.pruner)
    for name, (option, ok, give) in PRUNING_VALUES.items():  # whatever rule reads it, or none: a bad value is refused
        if (value := getattr(s, name)) is not None and not ok(value):
            raise ConfigError(f"{option} {value}: give {give}")
    check_process_counts(s)
    if s.timeout is not None and not (s.timeout > 0 and math.isfinite(s.timeout)):
        raise ConfigError(f"--timeout {s.timeout:g}: give a positive number of seconds (or leave it out for no limit)")
    if s.diversity_samples < 0:
        raise ConfigError(f"--track-diversity {s.diversity_samples} must be 0 (off) or a number of samples")
    if s.heartbeat < 0:
        raise ConfigError(f"--heartbeat {s.heartbeat}: give seconds between heartbeats (0 turns them off)")
    if s.study is not None:
        if problem := study_name_problem(s.study):
            raise ConfigError(f"--study {s.study!r} {problem}")
    check_run_root(Path(s.run_root), s.study)
    if s.tensorboard is not None:
        from headsearch.training.tensorboard import check_tensorboard

        check_tensorboard(s.tensorboard)


def check_run_root(root: Path, study: str | None = None) -> None:
    """The trials' run directories go under `root`/`study`: it must be (or become) a writable folder."""
    from headsearch.io import folder_problem

    if problem := folder_problem(root, "the trials' run directories"):
        raise ConfigError(f"--run-root {root}{problem}")
    if study and (Path(root) / study).exists() and not (Path(root) / study).is_dir():
        raise ConfigError(f"--run-root {root}: {Path(root) / study} is a file, where study {study}'s run directories"
                          " go: move it away or give another --run-root")


# The longest study name that is still a folder name (its run directories go in RUN_ROOT/<study>/).
MAX_STUDY_NAME_BYTES = 255


def study_name_problem(name: str) -> str | None:
    """What makes `name` unusable as the name of a study a command creates, whose run directories go in
    RUN_ROOT/<name>/: the rest of a sentence that starts with the option and the name, advice included;
    None if nothing."""
    if not name.strip():
        return "is empty: give the study a name, or leave --study out for the default name"
    if name != name.strip():
        return "begins or ends with a space: give the name without it"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "holds a control character (a newline, a tab): give a name of printable characters"
    if "/" in name or "\\" in name:
        return "holds a slash: the study's run directories go in RUN_ROOT/<study>/, so give a name without / or \\"
    if name in (".", ".."):
        return "is not a folder name: the study's run directories go in RUN_ROOT/<study>/, so give another name"
    if len(name.encode("utf-8", "surrogateescape")) > MAX_STUDY_NAME_BYTES:
        return (f"is longer than {MAX_STUDY_NAME_BYTES} bytes, too long for a folder name (its run directories go in"
                " RUN_ROOT/<study>/): give a shorter name")
    return None


def check_process_counts(s: SearchSettings) -> None:
    """--trials, and --workers or --trials-per-gpu (not both): one-line errors."""
    if s.workers is not None and s.trials_per_gpu is not None:
        raise ConfigError("--workers and --trials-per-gpu both set the number of worker processes: pass one of them")
    if s.trials < 1 or (s.workers is not None and s.workers < 1):
        raise ConfigError("--trials and --workers must be at least 1")
    if s.trials_per_gpu is not None and s.trials_per_gpu < 1:
        raise ConfigError(f"--trials-per-gpu {s.trials_per_gpu}: run at least 1 trial per GPU")
    if s.cohort is not None and not 1 <= s.cohort <= MAX_COHORT:
        raise ConfigError(f"--cohort {s.cohort}: give the number of trials a worker trains together, 1 (off) to {MAX_COHORT}")


def load_callback(spec: str):
    """`module:attr` (attr may be dotted) imported: an Optuna callback `(study, FrozenTrial) -> None`, as
    `study.optimize(callbacks=...)` takes (optuna-integration's W&B and MLflow callbacks are such objects).
    A spec, so that spawned workers import it too. One-line ConfigError when it cannot be loaded."""
    import importlib

    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise ConfigError(f"--callback {spec}: write module:attr, e.g. my_trackers:wandb_callback")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"--callback {spec}: cannot import {module_name} ({e}); is it on PYTHONPATH?") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"--callback {spec}: {module_name} has no {attr}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"--callback {spec}: {attr} is not callable; give a callback(study, trial) object")
    return obj
