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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
