"""The settings of `headsearch run`, declared once: each field of `SearchSettings` carries its `Option` (help,
part, check), from which `headsearch run`'s options, `headsearch.api.search`'s keyword parameters, the
simulator's pruning settings and the one-line checks all come. A field's option is `--` and its name with
dashes; a repeatable option (`repeat`) is its field's name in the singular, one value each (`--set` fills
`sets`). Checks here need nothing loaded."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from headsearch.environment import check_environment
from headsearch.errors import ConfigError
from headsearch.io import folder_problem
from headsearch.search.storage import DEFAULT_STORAGE
from headsearch.search.study import SAMPLERS

MAX_COHORT = 64

# The parts of the settings (the panels of `run --help`).
SEARCH, PRUNING, WORKERS, TRAINING, TRACKING = "Search", "Pruning", "Storage and workers", "Training", "Tracking"
STORAGE_ENV = "OPTUNA_STORAGE"
SET_HELP = ("SECTION.KEY=VALUE (SECTION arch, train or data; VALUE as YAML), e.g. train.lr=3e-4 data.train_limit=5000;"
            " repeatable; over the preset and --config, under --epochs/--seed/--compile.")  # Optuna's own CLI reads the storage URL from this variable; headsearch's commands do too


@dataclass(frozen=True)
class Option:
    """How a setting is given and checked. `check(value)`: False for a bad value, refused as "--flag VALUE:
    `problem`" (or it raises its own ConfigError); `read(text)`: the setting from what the command line gives
    (a string, or a list for a `repeat`able option); `cli_type`: what the command line parses, when not the
    field's type. `short`, `alias`: more flags for it (an alias is a name it had before)."""

    help: str
    part: str
    check: Callable[[Any], bool] | None = None
    problem: str = ""
    short: str | None = None
    alias: str | None = None
    metavar: str | None = None
    envvar: str | None = None
    repeat: bool = False
    read: Callable[[Any], Any] | None = None
    cli_type: Any = None


def setting(default: Any = dataclasses.MISSING, **option: Any) -> Any:
    """A field of `SearchSettings` with its `Option`."""
    return field(default=default, metadata={"option": Option(**option)})


def _integer(minimum: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _number(low: float, high: float = math.inf, above: bool = False) -> Callable[[Any], bool]:
    return lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and low <= v <= high
                      and not (above and v == low))


def _known_sampler(name: Any) -> bool:
    if name not in SAMPLERS:
        raise ConfigError(f"unknown sampler {name!r}: use one of {', '.join(SAMPLERS)}")
    return True


def _known_pruner(name: Any) -> bool:
    from headsearch.search.pruning import pruning_rule

    pruning_rule(name)  # a name without a row: its one line
    return True


def _study_name(name: Any) -> bool:
    if problem := study_name_problem(name):
        raise ConfigError(f"--study {name!r} {problem}")
    return True


def _tensorboard_folder(folder: Any) -> bool:
    from headsearch.training.tensorboard import check_tensorboard

    check_tensorboard(folder)
    return True


def _epoch_or_auto(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def _comma_list(text: str | None) -> tuple[str, ...] | None:
    names = tuple(name.strip() for name in text.split(",") if name.strip()) if text else ()
    return names or None


def _sections(pairs: list[str]) -> Any:
    from headsearch.tasks import parse_sets

    return parse_sets(pairs) or None


@dataclass(frozen=True)
class SearchSettings:
    """Everything `headsearch run` takes, in parts (`Option.part`). Paths are kept as strings."""

    # -- the search
    task: str = setting(part=SEARCH, short="-t", help="Task name (see `headsearch tasks`), or a plugin as"
                        " package.module:attr (docs/plugins.md).")
    # a space's name or YAML path, or a space object (compare's ConfigGrid)
    space: Any = setting("deep-head", part=SEARCH, short="-s", cli_type=str,
                         help="Search space: a built-in name (see `headsearch spaces`) or a YAML path.")
    trials: int = setting(50, part=SEARCH, short="-n", check=_integer(1), problem="give a number of trials >= 1",
                          help="Finished trials the study should hold (resumes up to this).")
    timeout: float | None = setting(None, part=SEARCH, check=_number(0, above=True),
                                    problem="give a positive number of seconds (or leave it out for no limit)",
                                    help="Stop starting trials after this many seconds.")
    objectives: tuple[str, ...] | None = setting(None, part=SEARCH, cli_type=str, read=_comma_list,
                                                 help="Comma list: a task metric, time, epochs, params."
                                                      " Default: <quality>,time.")
    sampler: str | None = setting(None, part=SEARCH, check=_known_sampler,
                                  help="{samplers} (default nsga2; tpe for one objective). cost: every architecture's"
                                       " epoch seconds measured before training, then expected hypervolume"
                                       " improvement (docs/searching.md).")
    seed: int = setting(0, part=SEARCH, check=_integer(0), problem="give a seed >= 0",
                        help="Seed of the sampler and of every trial's training.")
    # -- pruning (every pruner_* field is replayed by the simulator, `simulate.simulation_search`)
    pruner: str | None = setting(None, part=PRUNING, check=_known_pruner,
                                 help="{pruners} (default: pareto for several objectives, median for one).")
    pruner_startup_trials: int | None = setting(None, part=PRUNING, alias="--pruner-startup", check=_integer(0),
                                                problem="give a number of trials >= 0",
                                                help="Finished trials needed before pruning starts.")
    pruner_warmup_epochs: int | None = setting(None, part=PRUNING, alias="--pruner-warmup", check=_integer(0),
                                               problem="give a number of epochs >= 0",
                                               help="Epochs a trial always runs before it can be pruned.")
    # the first rung of the rung rules (pareto, asha; pareto: "auto")
    pruner_min_epochs: int | str | None = setting(
        None, part=PRUNING, cli_type=str, read=_epoch_or_auto, check=lambda v: v == "auto" or _integer(1)(v),
        problem="give an epoch >= 1, or auto", help="pareto and asha: the first rung (default 3 for pareto, 1 for"
        " asha); pareto: auto, the earliest epoch whose ranks predict the finished trials' final ones.")
    pruner_reduction_factor: int | None = setting(
        None, part=PRUNING, check=_integer(2), problem="give an integer >= 2",
        help="pareto and asha: rungs at min-epochs x factor^k, where the top 1/factor go on (default 3).")
    pruner_noise_margin: float | None = setting(
        None, part=PRUNING, check=_number(0), problem="give a number of sigmas >= 0",
        help="pareto: prune only what is dominated by more than this many sigmas of the metric's noise (default"
             " 0.9, or 0 with --pruner-pause; 0: plain dominance).")
    pruner_noise: float | None = setting(
        None, part=PRUNING, check=_number(0), problem="give the metric's noise sigma, a number >= 0",
        help="pareto: the metric's noise sigma, e.g. the spread between seeds `compare` measured (default:"
             " estimated from the curves).")
    pruner_percentile: float | None = setting(
        None, part=PRUNING, check=_number(0, 100), problem="give a percentile in [0, 100]",
        help="percentile: prune a trial whose best so far is in the bottom this-many percent of the others' values"
             " at its epoch (0-100, default 25).")
    pruner_pause: bool = setting(
        False, part=PRUNING, check=lambda v: isinstance(v, bool), problem="give true or false",
        help="Pause rather than kill: a trial the rule stops keeps its state (pause.pt in its run directory) and is"
             " resumed, exactly where it stopped, when the rule asked again later lets it go on or, once the budget"
             " is spent, when its curve projected to the end could still reach the front (docs/searching.md)."
             " Solo workers; a cohort's trials are pruned.")
    # -- storage and workers
    storage: str = setting(DEFAULT_STORAGE, part=WORKERS, envvar=STORAGE_ENV,
                           help="Optuna storage URL (sqlite, postgresql, mysql, journal:FILE, redis, grpc).")
    study: str | None = setting(None, part=WORKERS, check=_study_name,
                                help="Study name (default <task>-<space>[-<preset>]).")
    workers: int | None = setting(None, part=WORKERS, check=_integer(1), problem="give a number of processes >= 1",
                                  help="Worker processes on this machine, spread round-robin over the GPUs"
                                       " (default 1).")
    trials_per_gpu: int | None = setting(
        None, part=WORKERS, check=_integer(1), problem="run at least 1 trial per GPU",
        help="Instead of --workers: K concurrent trials on each visible GPU (K processes without GPUs). Default on"
             " GPUs: chosen from the model's size and the GPU, with NVIDIA MPS started when available.")
    cohort: int | None = setting(
        None, part=WORKERS, check=lambda v: _integer(1)(v) and v <= MAX_COHORT,
        problem=f"give the number of trials a worker trains together, 1 (off) to {MAX_COHORT}",
        help="Train K trials together as one stacked model in each worker (ViT). Default: none, unless"
             " `headsearch bench` measured a cohort fastest on this machine; 1 turns cohorts off.")
    run_root: str = setting("runs", part=WORKERS, help="Trial run directories go in RUN_ROOT/<study>/.")
    device: str = setting("auto", part=WORKERS, help="auto, cpu, cuda, cuda:1 ...")
    heartbeat: int = setting(30, part=WORKERS, check=_integer(0),
                             problem="give seconds between heartbeats (0 turns them off)",
                             help="Seconds between heartbeats (RDB storages); a silent trial is retried after 3x.")
    # -- training overrides, for every trial
    epochs: int | None = setting(None, part=TRAINING, check=_integer(1), problem="give a number of epochs >= 1",
                                 help="Epochs per trial (default: the task's or preset's).")
    preset: str | None = setting(None, part=TRAINING, short="-p", help="Task preset for every trial, e.g. tiny.")
    data_dir: str | None = setting(None, part=TRAINING, help="Local dataset folder (vit-cifar10).")
    data_file: str | None = setting(None, part=TRAINING, help="Local data file (translation-en-es: tab-separated"
                                    " parallel text; plugins that read one file).")
    compile: str | None = setting(None, part=TRAINING, help=(
        "How training steps run: auto (default: on CUDA compiled blocks + the whole step in a CUDA graph, on the CPU"
        " eager) | off | graphs | default | reduce-overhead | max-autotune; overrides train.compile. The warm-up is"
        " timed apart (compile_seconds in final.json)."))
    # {section: {key: value}} from --set SECTION.KEY=VALUE (tasks.parse_sets), for every trial
    sets: Any = setting(None, part=TRAINING, repeat=True, read=_sections, cli_type=str, metavar="<section.key=value>",
                        help=SET_HELP + " For every trial; the space's fixed values win.")
    # -- tracking
    track_diversity: int = setting(0, part=TRACKING, check=_integer(0), problem="give 0 (off) or a number of samples",
                                   help="Measure head diversity each epoch on N validation samples; `report` relates"
                                        " it to quality.")
    # "module:attr" Optuna callbacks (study, FrozenTrial), called after each trained trial
    callbacks: tuple[str, ...] = setting((), part=TRACKING, repeat=True, read=tuple, cli_type=str,
                                         metavar="<module:attr>", help=(
        "module:attr: an Optuna callback (study, FrozenTrial) called after each finished trial, in every worker, as"
        " study.optimize(callbacks=...) calls it (e.g. optuna-integration's W&B or MLflow callback; repeatable)."))
    tensorboard: str | None = setting(None, part=TRACKING, check=_tensorboard_folder, help=(
        "Write each epoch's train loss, learning rate, epoch seconds and validation metrics as TensorBoard scalars"
        " into DIR (`run`: one run per trial, DIR/trial-NNNNN). Needs the tensorboard package (headsearch's extra"
        " of that name)."))

    def __post_init__(self) -> None:
        # What Python callers may give in another form: paths as Paths, lists for tuples.
        for name in ("run_root", "data_dir", "data_file", "tensorboard"):
            if isinstance(value := getattr(self, name), Path):
                object.__setattr__(self, name, str(value))
        for name in ("objectives", "callbacks"):
            if isinstance(value := getattr(self, name), list):
                object.__setattr__(self, name, tuple(value))


def option_of(name: str) -> Option:
    """The `Option` of the setting `name`."""
    return SETTINGS[name].metadata["option"]


def flag_of(name: str) -> str:
    """The command-line flag of the setting `name`: `--` and its name with dashes, in the singular when it repeats."""
    flag = "--" + name.replace("_", "-")
    return flag.removesuffix("s") if option_of(name).repeat else flag


SETTINGS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(SearchSettings)}
PRUNING_FIELDS = tuple(name for name in SETTINGS if name.startswith("pruner_"))


def settings_parameters() -> list[inspect.Parameter]:
    """The settings as keyword parameters (their types and defaults), as `headsearch.api.search` takes them."""
    hints = typing.get_type_hints(SearchSettings)
    return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[name],
                              default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default)
            for name, f in SETTINGS.items()]


def _shown(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def check_settings(s: SearchSettings) -> None:
    """Each setting's own check (whatever rule or command reads it), then the checks across settings and the
    environment's settings: one ConfigError line."""
    check_environment()
    for name in SETTINGS:
        check = option_of(name).check
        if check is not None and (value := getattr(s, name)) is not None and not check(value):
            raise ConfigError(f"{flag_of(name)} {_shown(value)}: {option_of(name).problem}")
    if s.workers is not None and s.trials_per_gpu is not None:
        raise ConfigError("--workers and --trials-per-gpu both set the number of worker processes: pass one of them")
    check_run_root(Path(s.run_root), s.study)


def check_run_root(root: Path, study: str | None = None) -> None:
    """The trials' run directories go under `root`/`study`: it must be (or become) a writable folder."""
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


def load_callback(spec: str):
    """`module:attr` (attr may be dotted) imported: an Optuna callback `(study, FrozenTrial) -> None`, as
    `study.optimize(callbacks=...)` takes (optuna-integration's W&B and MLflow callbacks are such objects).
    A spec, so that spawned workers import it too. One-line ConfigError when it cannot be loaded."""
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
