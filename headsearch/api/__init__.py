"""headsearch from Python: the CLI's commands as functions that return data.

    from headsearch import api

    run = api.train("vit-cifar10", "examples/ham-b.yaml", preset="tiny", data_dir="../shared/data/cifar10")
    rep = api.search("vit-cifar10", space="ham", preset="tiny", trials=9, data_dir="../shared/data/cifar10")
    rep.front[0].values, api.trials("sqlite:///headsearch.db").head()
    model, cfg = api.load_model(run.run_dir)

Each function is a few lines over the library the CLI uses (`resolve_config` + `train_run`, `Search` +
`run_search`, `summarize`, the comparison's grid), so a run from here and one from the CLI are the same run.
Errors are `headsearch.errors.HeadsearchError` (bad input: `ConfigError`), with the CLI's one-line messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from headsearch.config import RunConfig
from headsearch.errors import HeadsearchError
from headsearch.search.storage import DEFAULT_STORAGE

__all__ = ["TrainedRun", "compare", "load_model", "report", "search", "train", "trials"]


@dataclass(frozen=True)
class TrainedRun:
    """What `train` returns: the run directory (config.yaml, metrics.jsonl, final.json, the checkpoint), the
    resolved config, and the trainer's result (`headsearch.training.trainer.TrainResult`)."""

    run_dir: Path
    config: RunConfig
    result: Any


def train(task: str, config: str | Path | Mapping[str, Any] | None = None, *, preset: str | None = None,
          data_dir: str | Path | None = None, data_file: str | Path | None = None, out: str | Path | None = None,
          device: str = "auto", epochs: int | None = None, seed: int | None = None,
          sets: Mapping[str, Mapping[str, Any]] | None = None, callbacks: Sequence = (),
          tensorboard: str | Path | None = None) -> TrainedRun:
    """`headsearch train`: one architecture (`config`: a YAML path or a mapping of architecture fields or a
    run config) on `task`; `sets` is `{section: {key: value}}` as `--set`; `callbacks` trainer callbacks;
    `tensorboard` a folder for per-epoch TensorBoard scalars (`--tensorboard`, the `tensorboard` extra)."""
    from headsearch.tasks import flag_overrides, resolve_config
    from headsearch.training import train_run

    cfg = resolve_config(task, preset=preset, config=Path(config) if isinstance(config, str) else config,
                         overrides=flag_overrides(epochs=epochs, seed=seed, sets=sets))
    run_dir, result = train_run(cfg, _source(data_dir, data_file), Path(out) if out else None, device=device,
                                callbacks=list(callbacks), tensorboard=tensorboard)
    return TrainedRun(Path(run_dir), cfg, result)


def search(task: str, *, space: str = "deep-head", trials: int = 50, storage: str = DEFAULT_STORAGE,
           data_dir: str | Path | None = None, data_file: str | Path | None = None, enqueue: Sequence = (),
           tensorboard: str | Path | None = None, **settings: Any):
    """`headsearch run`: search `space` on `task` up to `trials` finished trials (resuming a study of the
    same name in `storage`), with the plan's workers; `settings` are `SearchSettings` fields (objectives,
    sampler, pruner, preset, epochs, seed, workers, cohort, device, sets, callbacks, ...). `enqueue`: configs
    to train first; `tensorboard`: a folder for each trial's per-epoch TensorBoard scalars (DIR/trial-NNNNN, as
    `--tensorboard`). Returns the study's `StudyReport` (`report`)."""
    from headsearch.search.runner import Search, SearchSettings
    from headsearch.search.workers import failure_line, open_search, run_search

    s = Search(SearchSettings(task=task, space=space, trials=trials, storage=storage,
                              data_dir=str(data_dir) if data_dir else None,
                              data_file=str(data_file) if data_file else None,
                              tensorboard=str(tensorboard) if tensorboard is not None else None, **settings))
    first = [s.params_of(c) for c in enqueue]
    study = open_search(s)
    s.enqueue(study, first)
    failures = run_search(s)
    if failures:
        raise HeadsearchError(failure_line(failures))
    return report(storage, s.study_name)


def report(storage: str = DEFAULT_STORAGE, study: str | None = None):
    """`headsearch report --format json` as data: the Pareto front, counts, importances, what pruning saved
    (`headsearch.search.report.StudyReport`; `.to_dict()` for JSON)."""
    from headsearch.search.report import summarize

    return summarize(storage, study)


def trials(storage: str = DEFAULT_STORAGE, study: str | None = None):
    """Every trial of a study as a pandas DataFrame (Optuna's `trials_dataframe`: params, values, states,
    user attributes such as arch, epochs_run, duplicate_of)."""
    from headsearch.search.report import load_study

    return load_study(storage, study).trials_dataframe(multi_index=False)


def compare(configs: Sequence[str | Path], task: str, *, seeds: int = 3, storage: str = DEFAULT_STORAGE,
            run_root: str | Path = "runs", out: str | Path | None = None, preset: str | None = None,
            epochs: int | None = None, sets: Mapping[str, Mapping[str, Any]] | None = None,
            data_dir: str | Path | None = None, data_file: str | Path | None = None, study: str | None = None,
            workers: int | None = None, cohort: int | None = None, device: str = "auto") -> dict[str, Any]:
    """`headsearch compare`: every config with seeds 0..N-1, means, spreads and paired differences with 95%
    intervals (`headsearch.search.compare.comparison`'s dict; its files written to `out`, default
    RUN_ROOT/<study>/compare)."""
    from headsearch.search.compare import comparison, comparison_search, write_comparison
    from headsearch.search.workers import failure_line, open_search, run_search

    s, grid = comparison_search([str(c) for c in configs], task, seeds=seeds, storage=storage, run_root=str(run_root),
                                preset=preset, epochs=epochs, sets=dict(sets or {}), study=study,
                                data_dir=str(data_dir) if data_dir else None,
                                data_file=str(data_file) if data_file else None, workers=workers, cohort=cohort,
                                device=device)
    study_obj = open_search(s)
    failures = run_search(s)
    if failures:
        raise HeadsearchError(failure_line(failures))
    result = comparison(study_obj, grid, s.task, s.objectives)
    write_comparison(result, Path(out) if out else Path(run_root) / s.study_name / "compare")
    return result


def load_model(run_dir: str | Path, *, device: str = "cpu", data_dir: str | Path | None = None,
               data_file: str | Path | None = None):
    """A trained run's model (eval mode, its best checkpoint) and config: `(model, RunConfig)`. The data
    options say where its task's data is (the model is built by the task, on that data's vocabulary)."""
    import torch

    from headsearch.analysis.run import load_run

    _, cfg, _, model = load_run(Path(run_dir), _source(data_dir, data_file), torch.device(device))
    return model, cfg


def _source(data_dir, data_file):
    from headsearch.tasks import DataSource

    return DataSource(Path(data_dir) if data_dir else None, Path(data_file) if data_file else None)
