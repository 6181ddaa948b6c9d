"""headsearch from Python: the CLI's commands as functions that return data.

    from headsearch import api

    run = api.train("vit-cifar10", "examples/ham-b.yaml", preset="tiny", data_dir="../shared/data/cifar10")
    rep = api.search("vit-cifar10", space="ham", preset="tiny", trials=9, data_dir="../shared/data/cifar10")
    rep.front[0].values, api.trials("sqlite:///headsearch.db").head()
    model, cfg = api.load_model(run.run_dir)

The CLI's commands call these functions (parse, call, print), so a run from here and one from the CLI are
the same run: what the CLI adds is passed in as hooks (`callbacks`, `watch`, `on_written`, `argv`).
Errors are `headsearch.errors.HeadsearchError` (bad input: `ConfigError`), with the CLI's one-line messages.

A `watch` is the CLI's live view of a search: `watch(study, trials, grid)` is called once the study is open
(`grid`: the `ConfigGrid` of a comparison or a table, else None) and returns a context manager held while the
trials run; what it yields is a `SearchCallback` with `refresh()` (called while worker processes run) and
`announce(line)` (the plan, once, before any trial) and `on_cost(done, total, cost)` (each architecture's cost
measured before the first trial, with `--sampler cost`).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from headsearch.config import RunConfig
from headsearch.errors import HeadsearchError
from headsearch.search.storage import DEFAULT_STORAGE

__all__ = ["SearchFailed", "TrainedRun", "compare", "load_model", "report", "robust", "search", "search_study", "table",
           "train", "trials"]


@dataclass(frozen=True)
class TrainedRun:
    """What `train` returns: the run directory (config.yaml, metrics.jsonl, final.json, the checkpoint), the
    resolved config, and the trainer's result (`headsearch.training.trainer.TrainResult`)."""

    run_dir: Path
    config: RunConfig
    result: Any


class SearchFailed(HeadsearchError):
    """A search that ended without what was asked (worker processes failed, or no run finished). `exit_code`
    is the CLI's: 2 when every failure was bad input, else 1 (a crash is not the user's input)."""

    def __init__(self, message: str, exit_code: int = 1, failures: Sequence = ()):
        super().__init__(message)
        self.exit_code, self.failures = exit_code, list(failures)


def train(task: str, config: str | Path | Mapping[str, Any] | None = None, *, preset: str | None = None,
          data_dir: str | Path | None = None, data_file: str | Path | None = None, out: str | Path | None = None,
          device: str = "auto", epochs: int | None = None, seed: int | None = None, compile: str | None = None,
          track_diversity: int | None = None, sets: Mapping[str, Mapping[str, Any]] | None = None,
          callbacks: Sequence = (), tensorboard: str | Path | None = None,
          argv: Sequence[str] | None = None) -> TrainedRun:
    """`headsearch train`: one architecture (`config`: a YAML path or a mapping of architecture fields or a
    run config) on `task`; `sets` is `{section: {key: value}}` as `--set`; `compile` and `track_diversity`
    as `--compile` and `--track-diversity` (a config's `train.diversity_samples` is tracked too); `callbacks`
    trainer callbacks, called before the diversity tracker; `tensorboard` a folder for per-epoch TensorBoard
    scalars (`--tensorboard`, the `tensorboard` extra); `argv` the command recorded in command.txt."""
    from headsearch.analysis.tracking import diversity_callbacks
    from headsearch.environment import check_environment
    from headsearch.tasks import flag_overrides, resolve_config
    from headsearch.training import train_run

    check_environment()  # a bad HEADSEARCH_* value: one line before the run directory exists
    flags = flag_overrides(epochs=epochs, seed=seed, compile=compile, diversity_samples=track_diversity,
                           sets=dict(sets) if sets else sets)
    cfg = resolve_config(task, preset=preset, config=Path(config) if isinstance(config, str) else config, overrides=flags)
    run_dir, result = train_run(cfg, _source(data_dir, data_file), Path(out) if out else None, device=device,
                                argv=list(argv) if argv is not None else None,
                                callbacks=[*callbacks, *diversity_callbacks(cfg)], tensorboard=tensorboard)
    return TrainedRun(Path(run_dir), cfg, result)


def search_study(task: str, *, space: str = "deep-head", trials: int = 50, storage: str = DEFAULT_STORAGE,
                 data_dir: str | Path | None = None, data_file: str | Path | None = None,
                 run_root: str | Path = "runs", enqueue: Sequence = (), tensorboard: str | Path | None = None,
                 watch: Callable | None = None, argv: Sequence[str] | None = None, **settings: Any):
    """`search` without the report: trains the trials and returns the Optuna study (what `headsearch run`
    prints its summary from). Worker processes that failed raise `SearchFailed`."""
    from headsearch.search.runner import Search, SearchSettings

    s = Search(SearchSettings(task=task, space=space, trials=trials, storage=storage,
                              data_dir=str(data_dir) if data_dir else None,
                              data_file=str(data_file) if data_file else None, run_root=str(run_root),
                              tensorboard=str(tensorboard) if tensorboard is not None else None, **settings))
    first = [s.archs.params_of(c) for c in enqueue]  # a config the space does not hold: before any study exists
    return _train_trials(s, s.archs.trial_target(), watch, argv, first=first)


def search(task: str, *, space: str = "deep-head", trials: int = 50, storage: str = DEFAULT_STORAGE,
           data_dir: str | Path | None = None, data_file: str | Path | None = None, enqueue: Sequence = (),
           tensorboard: str | Path | None = None, **settings: Any):
    """`headsearch run`: search `space` on `task` up to `trials` finished trials (resuming a study of the
    same name in `storage`), with the plan's workers; `settings` are `SearchSettings` fields (objectives,
    sampler, pruner, preset, epochs, seed, workers, cohort, device, sets, callbacks, ...) and `search_study`'s
    hooks (watch, argv). `enqueue`: configs to train first; `tensorboard`: a folder for each trial's per-epoch
    TensorBoard scalars (DIR/trial-NNNNN, as `--tensorboard`). Returns the study's `StudyReport` (`report`)."""
    study = search_study(task, space=space, trials=trials, storage=storage, data_dir=data_dir, data_file=data_file,
                         enqueue=enqueue, tensorboard=tensorboard, **settings)
    return report(storage, study.study_name)


def report(storage: str = DEFAULT_STORAGE, study: str | None = None, *, loaded=None):
    """`headsearch report --format json` as data: the Pareto front, counts, importances, what pruning saved
    (`headsearch.search.report.StudyReport`; `.to_dict()` for JSON). `loaded`: the study, when the caller has
    already loaded it (not loaded again)."""
    from headsearch.search.report import summarize

    return summarize(storage, study, study=loaded)


def trials(storage: str = DEFAULT_STORAGE, study: str | None = None):
    """Every trial of a study as a pandas DataFrame (Optuna's `trials_dataframe`: params, values, states,
    user attributes such as arch, epochs_run, duplicate_of)."""
    from headsearch.search.report import load_study

    return load_study(storage, study).trials_dataframe(multi_index=False)


def compare(configs: Sequence[str | Path], task: str, *, seeds: int = 3, storage: str = DEFAULT_STORAGE,
            run_root: str | Path = "runs", out: str | Path | None = None, preset: str | None = None,
            epochs: int | None = None, sets: Mapping[str, Mapping[str, Any]] | None = None,
            data_dir: str | Path | None = None, data_file: str | Path | None = None, study: str | None = None,
            workers: int | None = None, cohort: int | None = None, device: str = "auto", watch: Callable | None = None,
            argv: Sequence[str] | None = None, on_written: Callable[[list[Path]], None] | None = None) -> dict[str, Any]:
    """`headsearch compare`: every config with seeds 0..N-1, means, spreads and paired differences with 95%
    intervals (`headsearch.search.compare.comparison`'s dict; its files written to `out`, default
    RUN_ROOT/<study>/compare, and handed to `on_written`)."""
    from headsearch.search.compare import comparison_search

    s, grid = comparison_search([str(c) for c in configs], task, seeds=seeds, storage=storage, run_root=str(run_root),
                                preset=preset, epochs=epochs, sets=dict(sets or {}), study=study,
                                data_dir=str(data_dir) if data_dir else None,
                                data_file=str(data_file) if data_file else None, workers=workers, cohort=cohort,
                                device=device)
    return _compared(s, grid, Path(out) if out else Path(run_root) / s.study_name / "compare", watch, argv, on_written)


def robust(storage: str = DEFAULT_STORAGE, study: str | None = None, *, seeds: int = 3, run_root: str | Path = "runs",
           device: str = "auto", out: str | Path | None = None, watch: Callable | None = None,
           argv: Sequence[str] | None = None, on_written: Callable[[list[Path]], None] | None = None) -> dict[str, Any]:
    """`headsearch report --robust N`: the study's Pareto front retrained with seeds 0..N-1 (study
    <study>-robust, on the search's task and data) and compared as `compare` does; `front_on_means` says
    which configs stay on the front of the means."""
    from headsearch.search.compare import robust_search

    s, grid = robust_search(storage, study, seeds, run_root=str(run_root), device=device)
    return _compared(s, grid, Path(out) if out else Path(run_root) / s.study_name / "compare", watch, argv, on_written)


def table(task: str, space: str = "deep-head", *, out: str | Path, seeds: int = 3, sample: int | None = None,
          sample_seed: int = 0, preset: str | None = None, epochs: int | None = None,
          data_dir: str | Path | None = None, data_file: str | Path | None = None, storage: str = DEFAULT_STORAGE,
          study: str | None = None, run_root: str | Path = "runs", workers: int | None = None,
          cohort: int | None = None, device: str = "auto", sets: Mapping[str, Mapping[str, Any]] | None = None,
          watch: Callable | None = None, argv: Sequence[str] | None = None) -> tuple[dict[str, Any], Path]:
    """`headsearch table`: every architecture of `space` (or a seeded `sample` of them) with seeds 0..N-1, no
    pruning, written as the benchmark table (headsearch.search.table) to `out`. Returns (table, path). A
    study in which no run finished raises `SearchFailed`."""
    import shlex

    from headsearch.machine.fairtime import device_model
    from headsearch.search.table import read_table, table_search, write_table

    s, grid, space_search = table_search(
        task, space, seeds=seeds, preset=preset, epochs=epochs, data_dir=str(data_dir) if data_dir else None,
        data_file=str(data_file) if data_file else None, storage=storage, study=study, run_root=str(run_root),
        device=device, workers=workers, cohort=cohort, sample=sample, sample_seed=sample_seed,
        sets=dict(sets) if sets else sets)
    study_obj = _train_trials(s, grid.points, watch, argv, grid=grid)
    command = shlex.join(["headsearch", *argv[1:]]) if argv else "headsearch.api.table"
    built = read_table(study_obj, grid, space_search, command=command, device=device_model(s.device))  # where it was timed
    if not built["architectures"]:
        raise SearchFailed(f"no run of study {s.study_name} finished: see `headsearch report --study {s.study_name}`")
    return built, write_table(built, Path(out))


def load_model(run_dir: str | Path, *, device: str = "cpu", data_dir: str | Path | None = None,
               data_file: str | Path | None = None):
    """A trained run's model (eval mode, its best checkpoint) and config: `(model, RunConfig)`. The data
    options say where its task's data is (the model is built by the task, on that data's vocabulary)."""
    import torch

    from headsearch.analysis.run import load_run

    _, cfg, _, model = load_run(Path(run_dir), _source(data_dir, data_file), torch.device(device))
    return model, cfg


def _train_trials(s, trials: int, watch: Callable | None, argv: Sequence[str] | None, first: Sequence | None = None,
                  grid=None):
    """Open (or resume) the study of Search `s`, enqueue `first`, run its trials under `watch` (module
    docstring); the study. Failed worker processes raise `SearchFailed` once the watch has stopped."""
    from headsearch.search.scheduler import enqueue_first
    from headsearch.search.workers import failure_line, open_search, run_search

    study = open_search(s)  # malformed data fails here, before a study exists
    if first is not None:
        enqueue_first(study, first)
    with (watch(study, trials, grid) if watch is not None else nullcontext()) as display:
        hooks = dict(poll=display.refresh, announce=display.announce, on_cost=display.on_cost) if display is not None else {}
        failures = run_search(s, [display] if display is not None else [], argv=list(argv) if argv else None, **hooks)
    if failures:
        raise SearchFailed(failure_line(failures), 2 if all(f.bad_input for f in failures) else 1, failures)
    return study


def _compared(s, grid, out: Path, watch, argv, on_written) -> dict[str, Any]:
    """Train what the comparison's study lacks, read it back and write its files."""
    from headsearch.search.compare import comparison, write_comparison

    study = _train_trials(s, grid.points, watch, argv, grid=grid)
    result = comparison(study, grid, s.task, s.objectives)
    paths = write_comparison(result, out)
    if on_written is not None:
        on_written(paths)
    return result


def _source(data_dir, data_file):
    from headsearch.tasks import DataSource

    return DataSource(Path(data_dir) if data_dir else None, Path(data_file) if data_file else None)
