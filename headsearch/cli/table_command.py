"""`headsearch table`: train every architecture of a space to the search budget, seeds 0..N-1, and write the
table (headsearch.search.table) that `benchmarks/search_quality.py` replays searches against."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from headsearch.cli.common import SET_HELP, storage_option


def table(
    task: str = typer.Option(..., "--task", "-t", help="Task name (see `headsearch tasks`), or a plugin as package.module:attr (docs/plugins.md)."),
    space: str = typer.Option("deep-head", "--space", "-s", help="Search space (a built-in name or a YAML path) whose every architecture is trained."),
    out: Path = typer.Option(..., "--out", "-o", help="The table's JSON file (written when the runs end; again on every resume)."),
    seeds: int = typer.Option(3, "--seeds", help="Seeds per architecture: 0..N-1 (at least 2)."),
    sample: Optional[int] = typer.Option(None, "--sample", help="Train a seeded sample of this many architectures instead of all."),
    sample_seed: int = typer.Option(0, "--sample-seed", help="Seed of --sample's draw."),
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="Task preset whose search budget every run uses, e.g. tiny."),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="Epochs per run (default: the preset's search budget)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Local dataset folder (vit-cifar10)."),
    data_file: Optional[Path] = typer.Option(None, "--data-file", help="Local tab-separated parallel file (translation-en-es)."),
    storage: str = storage_option("Optuna storage URL of the runs' study (resumable)."),
    study: Optional[str] = typer.Option(None, "--study", help="The runs' study (default table-<task>-<space>[-<preset>])."),
    run_root: Path = typer.Option(Path("runs"), "--run-root", help="Run directories go in RUN_ROOT/<study>/."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Worker processes (default: the plan's, as `run`)."),
    cohort: Optional[int] = typer.Option(None, "--cohort", help="Runs a worker trains as one stacked model (ViT; 1: off)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda ..."),
    sets: list[str] = typer.Option([], "--set", help=SET_HELP + " For every run (a cheaper epoch, say); recorded in the table."),
) -> None:
    """Train every architecture of a space (seeds 0..N-1, no pruning) and write them as a benchmark table."""
    from headsearch.cli.checks import check_new_storage, check_new_study_name, check_output_file
    from headsearch.cli.common import fail, fail_on_fault, worker_failure_line
    from headsearch.cli.progress import SearchProgress, grid_label
    from headsearch.errors import HeadsearchError
    from headsearch.search.table import read_table, table_search, write_table
    from headsearch.search.workers import open_search, run_search
    from headsearch.tasks import parse_sets

    check_new_study_name(study)  # names and where the table goes: before anything trains
    check_new_storage(storage)
    check_output_file(out, "--out", "the table's JSON")
    kept = "finished runs are kept in the study; run the same command to train the rest"
    try:
        search, grid, space_search = table_search(
            task, space, seeds=seeds, preset=preset, epochs=epochs, data_dir=str(data_dir) if data_dir else None,
            data_file=str(data_file) if data_file else None, storage=storage, study=study, run_root=str(run_root),
            device=device, workers=workers, cohort=cohort, sample=sample, sample_seed=sample_seed, sets=parse_sets(sets))
        study_obj = open_search(search)
        with SearchProgress(study_obj, grid.points, label=grid_label(grid)) as display:
            failures = run_search(search, [display], argv=sys.argv, poll=display.refresh, announce=display.announce)
        if failures:
            fail(worker_failure_line(failures), code=2 if all(f.bad_input for f in failures) else 1)
        built = read_table(study_obj, grid, space_search, command=shlex.join(["headsearch", *sys.argv[1:]]),
                           device=device_name(search))
        if not built["architectures"]:
            fail(f"no run of study {search.study_name} finished: see `headsearch report --study {search.study_name}`", code=1)
        path = write_table(built, out)
    except HeadsearchError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail(f"interrupted: {kept}", code=130)
    except Exception as e:
        fail_on_fault(e, f"{kept}; free space (or fix the disk) first")
    print_table(built)
    typer.echo(f"written: {path}", err=True)


def device_name(search) -> str:
    import torch

    from headsearch.search.measured import cpu_name
    from headsearch.training.runtime import resolve_device

    d = resolve_device(search.settings.device)
    return torch.cuda.get_device_name(d) if d.type == "cuda" else cpu_name()


def print_table(built: dict) -> None:
    from rich.table import Table

    from headsearch.cli.progress import log_title, output_console
    from headsearch.search.table import seconds_of, summary_rows

    console = output_console()  # a log's table: not wrapped
    rows = sorted(summary_rows(built), key=lambda r: -r["final"] if built["direction"] == "maximize" else r["final"])
    t = Table(title=log_title(f"{built['task']} x {built['space']['name']}: {len(rows)} of {built['architectures_in_space']}"
                              f" architectures, {built['epochs']} epochs, seeds per architecture as shown", console))
    for col in ("architecture", "params", "seeds", f"final val {built['primary_metric']} (mean)", "epoch seconds alone (mean)"):
        t.add_column(col, justify="left" if col == "architecture" else "right")
    for r in rows:
        t.add_row(r["arch"], f"{r['params']:,}", str(r["seeds"]), f"{r['final']:.4f}", f"{r['epoch_seconds']:.2f}")
    console.print(t)
    console.print(f"training time of the table's runs, alone on {built['device']}: {seconds_of(built) / 60:.1f} min")


def register(app: typer.Typer) -> None:
    app.command()(table)
