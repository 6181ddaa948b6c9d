"""The `headsearch` command. Each command is a few lines over a library function; Rich lives here only.

Imports of torch and the tasks' data libraries happen inside the commands, so `--help` is instant.
"""
from __future__ import annotations

import functools
import inspect
import sys
from pathlib import Path
from typing import Optional

import typer

from headsearch.cli.common import (Command, Group, check_format, echo_json, exits, fail, format_option,
                                   setting_option, settings_command)
from headsearch.search.settings import SEARCH, SET_HELP, TRACKING, TRAINING

app = typer.Typer(
    help="Search attention-head architectures (head schedules, skips, heterogeneous attention) and look inside the heads.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, PowerShell
    pretty_exceptions_enable=False,
    cls=Group,
)
command = functools.partial(app.command, cls=Command)

DATA = "Data and output"  # a panel of `train --help`; the others are the settings' parts


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
        return echo_json([{"name": t.name, "description": t.description, "presets": list(t.presets),
                           "metrics": [{"name": m.name, "direction": m.direction} for m in t.metrics]}
                          for t in all_tasks()])
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
    task: str = setting_option("task"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML: architecture fields, or a full run config (task/seed/arch/train/data)."),
    preset: Optional[str] = setting_option("preset", "Task preset, e.g. tiny for a CPU smoke run."),
    epochs: Optional[int] = setting_option("epochs", "Override the number of epochs.", panel=TRAINING),
    seed: Optional[int] = typer.Option(None, "--seed", help="Override the seed.", rich_help_panel=TRAINING),
    data_dir: Optional[Path] = setting_option("data_dir", panel=DATA),
    data_file: Optional[Path] = setting_option("data_file", panel=DATA),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run directory (default runs/<task>-<time>).", rich_help_panel=DATA),
    device: str = setting_option("device", panel=TRAINING),
    track_diversity: Optional[int] = typer.Option(None, "--track-diversity", help="Measure head diversity each epoch on N validation samples (metrics.jsonl).", rich_help_panel=TRACKING),
    compile_mode: Optional[str] = setting_option("compile", panel=TRAINING),
    sets: list[str] = setting_option("sets", SET_HELP, panel=TRAINING),
    tensorboard: Optional[Path] = setting_option("tensorboard", panel=TRACKING),
) -> None:
    """Train one architecture on a task and write a run directory."""
    from headsearch import api
    from headsearch.cli.progress import TrainProgress, print_result
    from headsearch.errors import Diverged, sigterm_raises
    from headsearch.tasks import parse_sets

    try:
        overrides = parse_sets(sets)
        with sigterm_raises(), TrainProgress() as progress:  # a cluster's SIGTERM ends it as Ctrl-C does (143)
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
        return echo_json([{"name": s.name, "description": s.description, "tasks": list(s.tasks) if s.tasks else None,
                           "schedule": {"families": list(s.families), "heads": list(s.heads), "min_heads": s.min_heads},
                           "skip": list(s.skips), "fusion": list(s.fusions),
                           "ranges": [r.describe() for r in s.ranges], "fixed": s.fixed} for s in all_spaces()],
                         default=str)
    from rich.console import Console
    from rich.table import Table

    table = Table("space", "schedules (heads)", "skip", "fusion", "ranges", "description")
    for s in all_spaces():
        table.add_row(s.name, f"{', '.join(s.families)} ({', '.join(map(str, s.heads))})", ", ".join(s.skips),
                      ", ".join(s.fusions), "; ".join(r.describe() for r in s.ranges) or "-", s.description)
    Console().print(table)


_ENQUEUE = inspect.Parameter("enqueue", inspect.Parameter.KEYWORD_ONLY, annotation=list[Path], default=typer.Option(
    [], "--enqueue", metavar="<path>", rich_help_panel=SEARCH, help="A config (architecture fields, as in"
    " examples/) to train first: a warm start from known architectures (repeatable)."))


@command()
@exits(kept="finished trials are kept in the study; free space (or fix the disk) and run the same command to resume",
       interrupted="finished trials are kept in the study; run the same command to resume")
@settings_command(extra=[_ENQUEUE])
def run(settings: dict, enqueue: list[Path]) -> None:
    """Search head schedules, skip kinds and fusion types with Optuna; prune poor trials."""
    from headsearch import api
    from headsearch.cli.checks import check_new_storage
    from headsearch.cli.progress import SearchWatch

    check_new_storage(settings["storage"])  # where the study goes: before any data loads or a study exists
    watch = SearchWatch(settings["storage"])
    with watch.summary_on_interrupt():
        api.search_study(**settings, enqueue=enqueue, watch=watch, argv=sys.argv)
    watch.print_summary()


from headsearch.cli.bench_command import bench  # noqa: E402
from headsearch.cli.compare_command import compare  # noqa: E402
from headsearch.cli.study_commands import dashboard, export, report  # noqa: E402
from headsearch.cli.table_command import table  # noqa: E402
for registered in (report, export, dashboard, compare, bench, table):
    command()(registered)


@command("storage-server")
@exits()
def storage_server(
    storage: str = setting_option("storage", "The database to serve: sqlite:///FILE.db, postgresql://USER@HOST/DB or mysql://USER@HOST/DB."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 to be reachable from other machines)."),
    port: int = typer.Option(13000, "--port", help="Port to listen on."),
) -> None:
    """Serve a database to many workers through Optuna's gRPC proxy: they pass --storage grpc://HOST:PORT."""
    import signal

    from headsearch import api
    from headsearch.cli.study_commands import unavailable_port
    from headsearch.io import hide_passwords

    if not 0 < port < 65536:
        fail(f"--port {port} is not a port number (1-65535)")
    port_problem = unavailable_port(host, port)  # gRPC itself binds a port in use without a word (SO_REUSEPORT)
    if port_problem:
        fail(f"cannot serve on {host}:{port}: {port_problem}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a scheduler's SIGTERM stops it as Ctrl-C does

    def ready(url: str) -> None:
        typer.echo(f"storage server for {hide_passwords(storage)}: workers pass --storage {url}")
        typer.echo("Ctrl-C (or SIGTERM) stops it", err=True)

    try:
        api.storage_server(storage, host=host, port=port, on_ready=ready)
    except KeyboardInterrupt:
        typer.echo("storage server stopped", err=True)


@command()
@exits(kept="files already written are whole; free space (or fix the disk) and analyze again")
def analyze(
    run_dir: Path = typer.Argument(..., help="A run directory (headsearch train, or a search trial's)."),
    data_dir: Optional[Path] = setting_option("data_dir"),
    data_file: Optional[Path] = setting_option("data_file"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Where analysis.json and the figures go (default RUN_DIR/analysis)."),
    samples: int = typer.Option(256, "--samples", help="Validation samples used for every measurement."),
    ablate: bool = typer.Option(True, "--ablation/--no-ablation", help="Evaluate the model once per head with that head masked."),
    fmt: str = format_option("table | json", short=False),
    device: str = setting_option("device"),
    storage: Optional[str] = typer.Option(None, "--storage", envvar="OPTUNA_STORAGE", show_envvar=True, help=(
        "A search trial's storage URL with its password (study.json hides it), to upload the figures to its study.")),
) -> None:
    """Head diversity, importance, ablation, the pruning curve and attention maps of a trained model."""
    from rich.console import Console

    from headsearch import api
    from headsearch.cli.checks import check_output_folder
    from headsearch.cli.progress import print_analysis

    check_format(fmt, ("table", "json"))
    check_output_folder(out, "--out", "analysis.json and the figures")
    with Console(stderr=True).status("analysing") as status:
        result = api.analyze(run_dir, out=out, samples=samples, ablate=ablate, device=device, data_dir=data_dir,
                             data_file=data_file, storage=storage, progress=lambda m: status.update(f"analysing: {m}"))
    if fmt == "json":
        return echo_json(result)
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
    return list(dict.fromkeys(f"warning: {w.message} ({Path(w.filename).name}:{w.lineno})"
                              for w in caught if w.category.__name__ != "ExperimentalWarning"))


if __name__ == "__main__":
    main()
