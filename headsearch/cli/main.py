"""The `headsearch` command. Each command is a few lines over a library function; Rich lives here only.

Imports of torch and the tasks' data libraries happen inside the commands, so `--help` is instant.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Optional

import typer

from headsearch.cli.common import (SET_HELP, Command, Group, check_format, compile_option, data_dir_option,
                                   data_file_option, device_option, epochs_option, exits, fail, format_option,
                                   preset_option, run_root_option, sets_option, space_option, storage_option,
                                   study_option, task_option, tensorboard_option)

app = typer.Typer(
    help="Search attention-head architectures (head schedules, skips, heterogeneous attention) and look inside the heads.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, PowerShell
    pretty_exceptions_enable=False,
    cls=Group,
)
command = functools.partial(app.command, cls=Command)

# `run --help`'s panels, and `train --help`'s
SEARCH, PRUNING, STORAGE, TRAINING, TRACKING = "Search", "Pruning", "Storage and workers", "Training", "Tracking"
DATA = "Data and output"


def _print_version(value: bool) -> None:
    if value:
        from headsearch import __version__

        typer.echo(f"headsearch {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print headsearch's version and exit.")) -> None:
    pass


@command()
def tasks(fmt: str = format_option()) -> None:
    """List the tasks, their metrics (with directions) and presets."""
    from headsearch.tasks import all_tasks

    check_format(fmt, ("table", "json"))
    if fmt == "json":
        import json

        typer.echo(json.dumps([{"name": t.name, "description": t.description, "presets": list(t.presets),
                                "metrics": [{"name": m.name, "direction": m.direction} for m in t.metrics]}
                               for t in all_tasks()], indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("task", "metrics (first = selected on)", "presets", "description")
    for t in all_tasks():
        metrics = ", ".join(f"{m.name} {'↑' if m.direction == 'maximize' else '↓'}" for m in t.metrics)
        table.add_row(t.name, metrics, ", ".join(t.presets), t.description)
    Console().print(table)


@command()
@exits(kept="the run directory keeps the epochs finished before it and their best checkpoint;"
            " free space (or fix the disk) and train again",
       interrupted="finished epochs and the best checkpoint are kept in the run directory")
def train(
    task: str = task_option(),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML: architecture fields, or a full run config (task/seed/arch/train/data)."),
    preset: Optional[str] = preset_option(),
    epochs: Optional[int] = epochs_option("Override the number of epochs.", panel=TRAINING),
    seed: Optional[int] = typer.Option(None, "--seed", help="Override the seed.", rich_help_panel=TRAINING),
    data_dir: Optional[Path] = data_dir_option(panel=DATA),
    data_file: Optional[Path] = data_file_option(panel=DATA),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run directory (default runs/<task>-<time>).", rich_help_panel=DATA),
    device: str = device_option(panel=TRAINING),
    track_diversity: Optional[int] = typer.Option(None, "--track-diversity", help="Measure head diversity each epoch on N validation samples (metrics.jsonl).", rich_help_panel=TRACKING),
    compile_mode: Optional[str] = compile_option(panel=TRAINING),
    sets: list[str] = sets_option(panel=TRAINING),
    tensorboard: Optional[Path] = tensorboard_option(panel=TRACKING),
) -> None:
    """Train one architecture on a task and write a run directory."""
    from headsearch import api
    from headsearch.cli.progress import TrainProgress, print_result
    from headsearch.errors import Diverged
    from headsearch.tasks import parse_sets

    try:
        overrides = parse_sets(sets)
        with TrainProgress() as progress:
            run = api.train(task, config, preset=preset, data_dir=data_dir, data_file=data_file, out=out, device=device,
                            epochs=epochs, seed=seed, compile=compile_mode, track_diversity=track_diversity,
                            sets=overrides, callbacks=[progress], tensorboard=tensorboard, argv=sys.argv)
    except Diverged as e:
        fail(f"{e} (the run directory keeps the epochs finished before it; try a lower lr or grad_clip)", code=1)
    print_result(run.run_dir, run.result)


@command()
def spaces(fmt: str = format_option()) -> None:
    """List the built-in search spaces."""
    from headsearch.search.space import all_spaces

    check_format(fmt, ("table", "json"))
    if fmt == "json":
        import json

        typer.echo(json.dumps([{"name": s.name, "description": s.description, "tasks": list(s.tasks) if s.tasks else None,
                                "schedule": {"families": list(s.families), "heads": list(s.heads), "min_heads": s.min_heads},
                                "skip": list(s.skips), "fusion": list(s.fusions),
                                "ranges": [r.describe() for r in s.ranges], "fixed": s.fixed} for s in all_spaces()],
                              indent=1, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("space", "schedules (heads)", "skip", "fusion", "ranges", "description")
    for s in all_spaces():
        table.add_row(s.name, f"{', '.join(s.families)} ({', '.join(map(str, s.heads))})", ", ".join(s.skips),
                      ", ".join(s.fusions), "; ".join(r.describe() for r in s.ranges) or "-", s.description)
    Console().print(table)


def _pruning(flag: str, help: str) -> typer.Option:
    return typer.Option(None, flag, help=help, rich_help_panel=PRUNING)


@command()
@exits(kept="finished trials are kept in the study; free space (or fix the disk) and run the same command to resume",
       interrupted="finished trials are kept in the study; run the same command to resume")
def run(
    task: str = task_option(panel=SEARCH),
    space: str = space_option("Search space: a built-in name (see `headsearch spaces`) or a YAML path.", panel=SEARCH),
    trials: int = typer.Option(50, "--trials", "-n", help="Finished trials the study should hold (resumes up to this).", rich_help_panel=SEARCH),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Stop starting trials after this many seconds.", rich_help_panel=SEARCH),
    objectives: Optional[str] = typer.Option(None, "--objectives", help="Comma list: a task metric, time, epochs, params. Default: <quality>,time.", rich_help_panel=SEARCH),
    sampler: Optional[str] = typer.Option(None, "--sampler", help="nsga2 | tpe | random | gp | cost (default nsga2; tpe for one objective). cost: every architecture's epoch seconds measured before training, then expected hypervolume improvement (docs/searching.md).", rich_help_panel=SEARCH),
    pruner: Optional[str] = _pruning("--pruner", "pareto (several objectives) | median | percentile | asha (successive halving, one bracket) | hyperband (Optuna's, one objective) | multi-metric (OptunaHub's multi_metric_pruner rule, several objectives) | none (default: pareto for several objectives, median for one)."),
    pruner_startup: Optional[int] = _pruning("--pruner-startup", "Finished trials needed before pruning starts."),
    pruner_warmup: Optional[int] = _pruning("--pruner-warmup", "Epochs a trial always runs before it can be pruned."),
    pruner_min_epochs: Optional[str] = _pruning("--pruner-min-epochs", "pareto and asha: the first rung (default 3 for pareto, 1 for asha); pareto: auto, the earliest epoch whose ranks predict the finished trials' final ones."),
    pruner_reduction_factor: Optional[int] = _pruning("--pruner-reduction-factor", "pareto and asha: rungs at min-epochs x factor^k, where the top 1/factor go on (default 3)."),
    pruner_noise_margin: Optional[float] = _pruning("--pruner-noise-margin", "pareto: prune only what is dominated by more than this many sigmas of the metric's noise (default 0.9; 0: plain dominance)."),
    pruner_noise: Optional[float] = _pruning("--pruner-noise", "pareto: the metric's noise sigma, e.g. the spread between seeds `compare` measured (default: estimated from the curves)."),
    pruner_percentile: Optional[float] = _pruning("--pruner-percentile", "percentile: prune a trial whose best so far is in the bottom this-many percent of the others' values at its epoch (0-100, default 25)."),
    storage: str = storage_option(panel=STORAGE),
    study: Optional[str] = study_option("Study name (default <task>-<space>[-<preset>]).", panel=STORAGE),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampler and of every trial's training.", rich_help_panel=SEARCH),
    epochs: Optional[int] = epochs_option("Epochs per trial (default: the task's or preset's).", panel=TRAINING),
    preset: Optional[str] = preset_option("Task preset for every trial, e.g. tiny.", panel=TRAINING),
    data_dir: Optional[Path] = data_dir_option(panel=TRAINING),
    data_file: Optional[Path] = data_file_option(panel=TRAINING),
    workers: Optional[int] = typer.Option(None, "--workers", help="Worker processes on this machine, spread round-robin over the GPUs (default 1).", rich_help_panel=STORAGE),
    trials_per_gpu: Optional[int] = typer.Option(None, "--trials-per-gpu", help="Instead of --workers: K concurrent trials on each visible GPU (K processes without GPUs). Default on GPUs: chosen from the model's size and the GPU, with NVIDIA MPS started when available.", rich_help_panel=STORAGE),
    cohort: Optional[int] = typer.Option(None, "--cohort", help="Train K trials together as one stacked model in each worker (ViT). Default: none, unless `headsearch bench` measured a cohort fastest on this machine; 1 turns cohorts off.", rich_help_panel=STORAGE),
    run_root: Path = run_root_option("Trial run directories go in RUN_ROOT/<study>/.", panel=STORAGE),
    device: str = device_option(panel=STORAGE),
    heartbeat: int = typer.Option(30, "--heartbeat", help="Seconds between heartbeats (RDB storages); a silent trial is retried after 3x.", rich_help_panel=STORAGE),
    track_diversity: int = typer.Option(0, "--track-diversity", help="Measure head diversity each epoch on N validation samples; `report` relates it to quality.", rich_help_panel=TRACKING),
    compile_mode: Optional[str] = compile_option(panel=TRAINING),
    sets: list[str] = sets_option(SET_HELP + " For every trial; the space's fixed values win.", panel=TRAINING),
    callback: list[str] = typer.Option([], "--callback", metavar="<module:attr>", help="module:attr: an Optuna callback (study, FrozenTrial) called after each finished trial, in every worker, as study.optimize(callbacks=...) calls it (e.g. optuna-integration's W&B or MLflow callback; repeatable).", rich_help_panel=TRACKING),
    tensorboard: Optional[Path] = tensorboard_option(panel=TRACKING),
    enqueue: list[Path] = typer.Option([], "--enqueue", metavar="<path>", help="A config (architecture fields, as in examples/) to train first: a warm start from known architectures (repeatable).", rich_help_panel=SEARCH),
) -> None:
    """Search head schedules, skip kinds and fusion types with Optuna; prune poor trials."""
    from headsearch import api
    from headsearch.cli.checks import check_new_storage, check_new_study_name
    from headsearch.cli.progress import SearchWatch
    from headsearch.tasks import parse_sets

    check_new_study_name(study)  # names and where the study goes: before any data loads or a study exists
    check_new_storage(storage)
    overrides = parse_sets(sets) or None
    if pruner_min_epochs is not None and pruner_min_epochs != "auto":
        if not pruner_min_epochs.isdigit():
            fail(f"--pruner-min-epochs {pruner_min_epochs}: give a number of epochs (1 or more) or auto")
        pruner_min_epochs = int(pruner_min_epochs)
    watch = SearchWatch(storage)
    with watch.summary_on_interrupt():
        api.search_study(
            task, space=space, trials=trials, timeout=timeout,
            objectives=tuple(o.strip() for o in objectives.split(",") if o.strip()) if objectives else None,
            sampler=sampler, pruner=pruner, pruner_startup_trials=pruner_startup, pruner_warmup_epochs=pruner_warmup,
            pruner_min_epochs=pruner_min_epochs, pruner_reduction_factor=pruner_reduction_factor,
            pruner_noise_margin=pruner_noise_margin, pruner_noise=pruner_noise, pruner_percentile=pruner_percentile,
            storage=storage, study=study, seed=seed, epochs=epochs, preset=preset, data_dir=data_dir, data_file=data_file,
            workers=workers, trials_per_gpu=trials_per_gpu, compile=compile_mode, run_root=run_root, device=device,
            heartbeat=heartbeat, diversity_samples=track_diversity, cohort=cohort, sets=overrides,
            callbacks=tuple(callback), tensorboard=tensorboard, enqueue=enqueue, watch=watch, argv=sys.argv)
    watch.print_summary()


from headsearch.cli.bench_command import register as _register_bench  # noqa: E402
from headsearch.cli.compare_command import register as _register_compare  # noqa: E402
from headsearch.cli.study_commands import register as _register_study_commands  # noqa: E402
from headsearch.cli.table_command import register as _register_table  # noqa: E402
_register_study_commands(app)
_register_compare(app)
_register_bench(app)
_register_table(app)


@command()
@exits(kept="files already written are whole; free space (or fix the disk) and analyze again")
def analyze(
    run_dir: Path = typer.Argument(..., help="A run directory (headsearch train, or a search trial's)."),
    data_dir: Optional[Path] = data_dir_option(),
    data_file: Optional[Path] = data_file_option(),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Where analysis.json and the figures go (default RUN_DIR/analysis)."),
    samples: int = typer.Option(256, "--samples", help="Validation samples used for every measurement."),
    ablate: bool = typer.Option(True, "--ablation/--no-ablation", help="Evaluate the model once per head with that head masked."),
    fmt: str = format_option("table | json", short=False),
    device: str = device_option(),
) -> None:
    """Head diversity, importance, ablation, the pruning curve and attention maps of a trained model."""
    import json as _json

    from rich.console import Console

    from headsearch.analysis.run import analyze_run
    from headsearch.cli.checks import check_output_folder
    from headsearch.cli.progress import print_analysis
    from headsearch.search.artifacts import upload_to_trial
    from headsearch.tasks import DataSource

    if fmt not in ("table", "json"):
        fail(f"--format {fmt!r} is not known: use table or json")
    if samples < 1:
        fail("--samples must be at least 1")
    check_output_folder(out, "--out", "analysis.json and the figures")
    err = Console(stderr=True)
    with err.status("analysing") as status:
        result = analyze_run(run_dir, DataSource(data_dir, data_file), out, samples=samples, ablate=ablate,
                             device=device, progress=lambda m: status.update(f"analysing: {m}"))
        # A search trial's run: its figures and analysis.json go to the study as artifacts.
        files = [*result["figures"], result.pop("analysis_json")]
        result["uploaded"] = upload_to_trial(run_dir, files)
    if fmt == "json":
        typer.echo(_json.dumps(result, indent=1))
        return
    print_analysis(result)


def main() -> None:
    """The console script: the app, with third-party warnings held back while a command runs. A command
    that fails shows its one error line alone; one that succeeds shows the warnings after its output
    (each once), except Optuna's ExperimentalWarnings for features headsearch uses knowingly."""
    import warnings

    from headsearch.cli.checks import empty_output_flag

    if (flag := empty_output_flag(sys.argv[1:])) is not None:  # before Typer reads it as the current folder
        typer.echo(f"error: {flag} is empty: give the path to write to (. for the current folder)", err=True)
        sys.exit(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            app()
            code = 0
        except SystemExit as e:
            code = e.code
    if code in (0, None):
        for line in held_warnings(caught):
            typer.echo(line, err=True)
    sys.exit(code)


def held_warnings(caught) -> list[str]:
    """The warnings worth showing after a successful command, once each."""
    shown: dict[str, None] = {}
    for w in caught:
        if w.category.__name__ == "ExperimentalWarning":
            continue
        shown.setdefault(f"warning: {w.message} ({Path(w.filename).name}:{w.lineno})", None)
    return list(shown)


if __name__ == "__main__":
    main()
