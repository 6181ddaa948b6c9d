"""The `headsearch` command. Each command is a few lines over a library function; Rich lives here only.

Imports of torch and the tasks' data libraries happen inside the commands, so `--help` is instant.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(
    help="Search attention-head architectures (head schedules, skips, heterogeneous attention) and look inside the heads.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def fail(message: str, code: int = 2) -> None:
    """One clear line on stderr, no traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command()
def tasks() -> None:
    """List the tasks, their metrics (with directions) and presets."""
    from rich.console import Console
    from rich.table import Table

    from headsearch.tasks import all_tasks

    table = Table("task", "metrics (first = selected on)", "presets", "description")
    for t in all_tasks():
        metrics = ", ".join(f"{m.name} {'↑' if m.direction == 'maximize' else '↓'}" for m in t.metrics)
        table.add_row(t.name, metrics, ", ".join(t.presets), t.description)
    Console().print(table)


@app.command()
def train(
    task: str = typer.Option(..., "--task", "-t", help="Task name (see `headsearch tasks`)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML: architecture fields, or a full run config (task/seed/arch/train/data)."),
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="Task preset, e.g. tiny for a CPU smoke run."),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="Override the number of epochs."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Override the seed."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Local dataset folder (vit-cifar10)."),
    data_file: Optional[Path] = typer.Option(None, "--data-file", help="Local tab-separated parallel file (translation-en-es)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run directory (default runs/<task>-<time>)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:1 ..."),
) -> None:
    """Train one architecture on a task and write a run directory."""
    from headsearch.cli.progress import TrainProgress, print_result
    from headsearch.errors import Diverged, HeadsearchError
    from headsearch.tasks import DataSource
    from headsearch.training import train_run
    from headsearch.training.resolve import resolve_config

    try:
        cfg = resolve_config(task, config, preset, epochs=epochs, seed=seed)
        with TrainProgress() as progress:
            run_dir, result = train_run(cfg, DataSource(data_dir, data_file), out, device=device, argv=sys.argv,
                                        callbacks=[progress])
    except HeadsearchError as e:
        fail(str(e))
    except Diverged as e:
        fail(f"{e} (the run directory keeps the epochs finished before it; try a lower lr or grad_clip)", code=1)
    except KeyboardInterrupt:
        fail("interrupted: finished epochs and the best checkpoint are kept in the run directory", code=130)
    print_result(run_dir, result)


@app.command()
def spaces() -> None:
    """List the built-in search spaces."""
    from rich.console import Console
    from rich.table import Table

    from headsearch.search.space import all_spaces

    table = Table("space", "schedules (heads)", "skip", "fusion", "ranges", "description")
    for s in all_spaces():
        table.add_row(s.name, f"{', '.join(s.families)} ({', '.join(map(str, s.heads))})", ", ".join(s.skips),
                      ", ".join(s.fusions), "; ".join(r.describe() for r in s.ranges) or "-", s.description)
    Console().print(table)


@app.command()
def run(
    task: str = typer.Option(..., "--task", "-t", help="Task name (see `headsearch tasks`)."),
    space: str = typer.Option("deep-head", "--space", "-s", help="Search space: a built-in name (see `headsearch spaces`) or a YAML path."),
    trials: int = typer.Option(50, "--trials", "-n", help="Finished trials the study should hold (resumes up to this)."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Stop starting trials after this many seconds."),
    objectives: Optional[str] = typer.Option(None, "--objectives", help="Comma list: a task metric, time, epochs, params. Default: <quality>,time."),
    sampler: Optional[str] = typer.Option(None, "--sampler", help="nsga2 | tpe | random | gp (default nsga2; tpe for one objective)."),
    pruner: str = typer.Option("median", "--pruner", help="median | percentile | hyperband | none."),
    pruner_startup: Optional[int] = typer.Option(None, "--pruner-startup", help="Finished trials needed before pruning starts."),
    pruner_warmup: Optional[int] = typer.Option(None, "--pruner-warmup", help="Epochs a trial always runs before it can be pruned."),
    storage: str = typer.Option("sqlite:///headsearch.db", "--storage", help="Optuna storage URL (sqlite, postgresql, journal:FILE, redis)."),
    study: Optional[str] = typer.Option(None, "--study", help="Study name (default <task>-<space>[-<preset>])."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampler and of every trial's training."),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="Epochs per trial (default: the task's or preset's)."),
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="Task preset for every trial, e.g. tiny."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Local dataset folder (vit-cifar10)."),
    data_file: Optional[Path] = typer.Option(None, "--data-file", help="Local tab-separated parallel file (translation-en-es)."),
    workers: int = typer.Option(1, "--workers", help="Worker processes on this machine (one per GPU when there are GPUs)."),
    run_root: Path = typer.Option(Path("runs"), "--run-root", help="Trial run directories go in RUN_ROOT/<study>/."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda ..."),
    heartbeat: int = typer.Option(30, "--heartbeat", help="Seconds between heartbeats (RDB storages); a silent trial is retried after 3x."),
) -> None:
    """Search head schedules, skip kinds and fusion types with Optuna; prune poor trials."""
    import time

    from headsearch.cli.progress import SearchProgress, print_search_summary
    from headsearch.errors import HeadsearchError
    from headsearch.search.runner import Search, SearchSettings, run_workers

    settings = SearchSettings(
        task=task, space=space, trials=trials, timeout=timeout,
        objectives=tuple(o.strip() for o in objectives.split(",") if o.strip()) if objectives else None,
        sampler=sampler, pruner=pruner, pruner_startup_trials=pruner_startup, pruner_warmup_epochs=pruner_warmup,
        storage=storage, study=study, seed=seed, epochs=epochs, preset=preset,
        data_dir=str(data_dir) if data_dir else None, data_file=str(data_file) if data_file else None,
        workers=workers, run_root=str(run_root), device=device, heartbeat=heartbeat,
    )
    study_obj = None
    try:
        search = Search(settings)
        if workers == 1:
            search.prepare_data()  # malformed data fails here, before a study exists
        study_obj = search.open()
        with SearchProgress(study_obj, trials) as display:
            if workers == 1:
                search.run_worker(0, callbacks=[display], argv=sys.argv)
            else:
                procs = run_workers(search, argv=sys.argv)
                while any(p.is_alive() for p in procs):
                    time.sleep(2)
                    display.refresh()
                if any(p.exitcode for p in procs):
                    fail(f"a worker failed: see {run_root / search.study_name / 'workers'}", code=1)
    except HeadsearchError as e:
        fail(str(e))
    except KeyboardInterrupt:
        if study_obj is not None:
            print_search_summary(study_obj, settings.storage)
        fail("interrupted: finished trials are kept in the study; run the same command to resume", code=130)
    print_search_summary(study_obj, settings.storage)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
