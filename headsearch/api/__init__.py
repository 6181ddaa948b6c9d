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

import dataclasses
import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from headsearch.config import RunConfig
from headsearch.errors import ConfigError, HeadsearchError
from headsearch.search.storage import DEFAULT_STORAGE

__all__ = ["SearchFailed", "StudyReportFiles", "TrainedRun", "analyze", "bench", "compare", "export", "load_model",
           "report", "robust", "search", "search_study", "storage_server", "study_report", "table", "train", "trials"]


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


def search_study(task: str, *, enqueue: Sequence = (), watch: Callable | None = None,
                 argv: Sequence[str] | None = None, **settings: Any):
    """`search` without the report: trains the trials and returns the Optuna study (what `headsearch run`
    prints its summary from). Worker processes that failed raise `SearchFailed`. Without a `watch` (which shows
    it), a first rung that ranks the finished trials poorly is a `rungcheck.RungWarning`."""
    from headsearch.search.rungcheck import FIRST_RUNG_CHECK
    from headsearch.search.runner import Search, SearchSettings

    if watch is None:
        settings["callbacks"] = (*settings.get("callbacks", ()), FIRST_RUNG_CHECK)
    s = Search(SearchSettings(task=task, **settings))
    first = [s.archs.params_of(c) for c in enqueue]  # a config the space does not hold: before any study exists
    return _train_trials(s, s.archs.trial_target(), watch, argv, first=first)


def search(task: str, *, enqueue: Sequence = (), watch: Callable | None = None, argv: Sequence[str] | None = None,
           **settings: Any):
    """`headsearch run`: search `space` on `task` up to `trials` finished trials (resuming a study of the
    same name in `storage`), with the plan's workers. The keyword parameters are the settings of
    `headsearch.search.settings.SearchSettings`, one per option of `headsearch run`, of the same name
    (objectives, sampler, pruner, preset, epochs, seed, workers, cohort, device, sets, callbacks, tensorboard...);
    `enqueue`: configs to train first; `watch` and `argv` as `search_study`. Returns the study's `StudyReport`."""
    study = search_study(task, enqueue=enqueue, watch=watch, argv=argv, **settings)
    return report(settings.get("storage", DEFAULT_STORAGE), study.study_name)


def _settings_signature(function: Callable) -> inspect.Signature:
    """`function`'s signature with the settings' keyword parameters in place of `**settings` (what `help()` and
    editors show): the settings tree declares them, once."""
    from headsearch.search.settings import settings_parameters

    own = [p for p in inspect.signature(function).parameters.values() if p.kind is not p.VAR_KEYWORD]
    return inspect.Signature(own + [p for p in settings_parameters() if p.name != "task"])


search_study.__signature__ = _settings_signature(search_study)
search.__signature__ = _settings_signature(search)


def report(storage: str = DEFAULT_STORAGE, study: str | None = None, *, loaded=None):
    """`headsearch report --format json` as data: the Pareto front, counts, importances, what pruning saved
    (`headsearch.search.report.StudyReport`; `.to_dict()` for JSON). `loaded`: the study, when the caller has
    already loaded it (not loaded again)."""
    from headsearch.search.report import summarize

    return summarize(storage, study, study=loaded)


@dataclass(frozen=True)
class StudyReportFiles:
    """What `study_report` gives: the report, the pruning audit (`headsearch.search.audit.Audit`, or None), the
    plots written and uploaded (`headsearch.search.plots.PublishedPlots`, or None), where the uploads went, and
    the notes saved for optuna-dashboard (None without plots or without optuna-dashboard)."""

    report: Any
    audit: Any = None
    plots: Any = None
    artifact_dir: Path | None = None
    notes: Any = None


def study_report(storage: str = DEFAULT_STORAGE, study: str | None = None, *, plots: str | Path | None = None,
                 pruning_audit: bool = False) -> StudyReportFiles:
    """`headsearch report`: `report`, and with `pruning_audit` the replay of the study's curves under other
    pruning rules; with `plots` a folder, PNG and HTML plots written there, the PNGs uploaded to the study as
    artifacts, and the figures and notes saved in the study for optuna-dashboard. The study is loaded once."""
    import importlib.util

    from headsearch.search.report import load_study_stored

    if plots is not None:
        from headsearch.search.plots import check_plot_libraries

        check_plot_libraries()
        if Path(plots).exists() and not Path(plots).is_dir():
            raise ConfigError(f"--plots {plots} is a file: pass a folder")
    loaded, stored = load_study_stored(storage, study)
    files = StudyReportFiles(report(storage, study, loaded=loaded))
    if pruning_audit:
        from headsearch.search.audit import pruning_audit as replay_pruning

        files = dataclasses.replace(files, audit=replay_pruning(loaded))
    if plots is not None:
        from headsearch.search.artifacts import default_artifact_dir
        from headsearch.search.notes import write_dashboard_notes
        from headsearch.search.plots import publish_plots

        artifact_dir = default_artifact_dir(storage)
        published = publish_plots(loaded, files.report, Path(plots), artifact_dir, stored)
        notes = write_dashboard_notes(loaded) if importlib.util.find_spec("optuna_dashboard") is not None else None
        files = dataclasses.replace(files, artifact_dir=artifact_dir, notes=notes, plots=published)
    return files


def export(storage: str = DEFAULT_STORAGE, study: str | None = None, *, out: str | Path, trial: int | None = None,
           pareto: bool = False, best: str | None = None) -> list[Path]:
    """`headsearch export`: the chosen trials' full run configs as YAML files in `out` (for `train --config`):
    exactly one of `trial` (a number), `pareto` (the front) or `best` (an objective or metric name)."""
    from headsearch.search.export import export_configs

    if sum([trial is not None, pareto, best is not None]) != 1:
        raise ConfigError("pass exactly one of --trial N, --pareto, --best METRIC")
    return export_configs(storage, study, trial=trial, pareto=pareto, best=best, out_dir=Path(out))


def storage_server(storage: str, *, host: str = "127.0.0.1", port: int = 13000,
                   on_ready: Callable[[str], None] | None = None) -> None:
    """`headsearch storage-server`: serve the database `storage` (sqlite, postgresql, mysql) through Optuna's gRPC
    proxy on host:port until interrupted; workers anywhere pass `--storage grpc://HOST:PORT` (`on_ready` gets that
    URL once the database is open). See `headsearch.search.storage_server`."""
    from headsearch.search.storage_server import serve_storage

    serve_storage(storage, host, port, on_ready=on_ready)


def analyze(run_dir: str | Path, *, out: str | Path | None = None, samples: int = 256, ablate: bool = True,
            device: str = "auto", data_dir: str | Path | None = None, data_file: str | Path | None = None,
            storage: str | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`headsearch analyze`: head diversity, importance, ablation, the pruning curve and attention maps of a
    trained run, written to `out` (default RUN_DIR/analysis); a search trial's files are uploaded to its study
    (`uploaded`; `storage`: its URL with the password that the trial's study.json hides, else $OPTUNA_STORAGE
    or the driver's own password file, `artifacts.trial_storage_url`). `progress(message)` hears each step."""
    from headsearch.analysis.run import analyze_run
    from headsearch.search.artifacts import upload_to_trial

    if samples < 1:
        raise ConfigError("--samples must be at least 1")
    result = analyze_run(Path(run_dir), _source(data_dir, data_file), Path(out) if out else None, samples=samples,
                         ablate=ablate, device=device, progress=progress or (lambda message: None))
    result["uploaded"] = upload_to_trial(Path(run_dir), [*result["figures"], result.pop("analysis_json")], storage)
    return result


def bench(task: str, *, space: str = "deep-head", preset: str | None = None, data_dir: str | Path | None = None,
          data_file: str | Path | None = None, device: str = "auto", seconds: float | None = None,
          ks: Sequence[int] | None = None, modes: Sequence[str] | None = None, cohorts: bool = True,
          report: Callable | None = None, announce: Callable[[str], None] | None = None):
    """`headsearch bench`: measure the ways a search can run its trials on this machine (each verified first;
    `report(result)` hears each) and save the fastest for `run`'s plan. Returns (the `Measurement`, the `Plan`
    `run` makes from it); `announce(line)` hears what is measured, once the data is checked."""
    from headsearch.machine.bench import bench as measure
    from headsearch.search.runner import Search, SearchSettings

    if seconds is not None and not seconds > 0:
        raise ConfigError(f"--seconds {seconds}: give a positive number of seconds")
    search = Search(SearchSettings(task=task, space=space, preset=preset, device=device, data_dir=data_dir,
                                   data_file=data_file))
    search.check_data()  # missing or malformed data: one line, before any process starts
    if announce is not None:
        announce(f"bench: {task}, base architecture of space {search.space.name}"
                 + (f", preset {preset}" if preset else "") + "; each way verified, then timed")
    measured = measure(search.plan_inputs(), seconds=seconds, ks=ks, modes=modes, cohorts=cohorts, report=report)
    return measured, search.machine_plan()  # planned now: from the measurement just saved


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
    from headsearch.search.scheduler import enqueue_first, enqueued_beyond_budget
    from headsearch.search.workers import failure_line, open_search, run_search

    study = open_search(s)  # malformed data fails here, before a study exists
    beyond = None
    if first is not None:
        enqueue_first(study, first)
        beyond = enqueued_beyond_budget(study, s.settings.trials) if first else None
    with (watch(study, trials, grid) if watch is not None else nullcontext()) as display:
        hooks = dict(poll=display.refresh, announce=_beside(display.announce, beyond), on_cost=display.on_cost) \
            if display is not None else {}
        failures = run_search(s, [display] if display is not None else [], argv=list(argv) if argv else None, **hooks)
    if failures:
        raise SearchFailed(failure_line(failures), 2 if all(f.bad_input for f in failures) else 1, failures)
    return study


def _beside(announce: Callable[[str], None], note: str | None) -> Callable[[str], None]:
    """`announce`, saying `note` (if any) on the plan's line."""
    return announce if note is None else (lambda line: announce(f"{line}; {note}"))


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
