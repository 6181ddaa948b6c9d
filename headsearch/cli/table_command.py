"""`headsearch table`: train every architecture of a space to the search budget, seeds 0..N-1, and write the
table (headsearch.search.table) that `benchmarks/search_quality.py` replays searches against."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from headsearch.cli.common import PLAN_COHORT_HELP, PLAN_WORKERS_HELP, exits, right_columns, setting_option
from headsearch.cli.compare_command import INTERRUPTED, RUNS, WORKERS
from headsearch.search.settings import SET_HELP


@exits(kept=f"{INTERRUPTED}; free space (or fix the disk) first", interrupted=INTERRUPTED)
def table(
    task: str = setting_option("task", panel=RUNS),
    space: str = setting_option("space", "Search space (a built-in name or a YAML path) whose every architecture is trained.", panel=RUNS),
    out: Path = typer.Option(..., "--out", "-o", help="The table's JSON file (written when the runs end; again on every resume)."),
    seeds: int = typer.Option(3, "--seeds", help="Seeds per architecture: 0..N-1 (at least 2).", rich_help_panel=RUNS),
    sample: Optional[int] = typer.Option(None, "--sample", help="Train a seeded sample of this many architectures instead of all.", rich_help_panel=RUNS),
    sample_seed: int = typer.Option(0, "--sample-seed", help="Seed of --sample's draw.", rich_help_panel=RUNS),
    preset: Optional[str] = setting_option("preset", "Task preset whose search budget every run uses, e.g. tiny.", panel=RUNS),
    epochs: Optional[int] = setting_option("epochs", "Epochs per run (default: the preset's search budget).", panel=RUNS),
    data_dir: Optional[Path] = setting_option("data_dir", panel=RUNS),
    data_file: Optional[Path] = setting_option("data_file", panel=RUNS),
    storage: str = setting_option("storage", "Optuna storage URL of the runs' study (resumable).", panel=WORKERS),
    study: Optional[str] = setting_option("study", "The runs' study (default table-<task>-<space>[-<preset>]).", panel=WORKERS),
    run_root: Path = setting_option("run_root", panel=WORKERS),
    workers: Optional[int] = setting_option("workers", PLAN_WORKERS_HELP, panel=WORKERS),
    cohort: Optional[int] = setting_option("cohort", PLAN_COHORT_HELP, panel=WORKERS),
    device: str = setting_option("device", panel=WORKERS),
    sets: list[str] = setting_option("sets", SET_HELP + " For every run (a cheaper epoch, say); recorded in the table.", panel=RUNS),
) -> None:
    """Train every architecture of a space (seeds 0..N-1, no pruning) and write them as a benchmark table."""
    from headsearch import api
    from headsearch.cli.checks import check_new_storage, check_new_study_name, check_output_file
    from headsearch.cli.progress import SearchWatch
    from headsearch.tasks import parse_sets

    check_new_study_name(study)  # names and where the table goes: before anything trains
    check_new_storage(storage)
    check_output_file(out, "--out", "the table's JSON")
    built, path = api.table(task, space, out=out, seeds=seeds, sample=sample, sample_seed=sample_seed, preset=preset,
                            epochs=epochs, data_dir=data_dir, data_file=data_file, storage=storage, study=study,
                            run_root=run_root, workers=workers, cohort=cohort, device=device, sets=parse_sets(sets),
                            watch=SearchWatch(), argv=sys.argv)
    print_table(built)
    typer.echo(f"written: {path}", err=True)


def print_table(built: dict) -> None:
    from rich.table import Table

    from headsearch.cli.progress import log_title, output_console
    from headsearch.search.table import seconds_of, summary_rows

    console = output_console()  # a log's table: not wrapped
    rows = sorted(summary_rows(built), key=lambda r: -r["final"] if built["direction"] == "maximize" else r["final"])
    t = Table("architecture", *right_columns("params", "seeds", f"final val {built['primary_metric']} (mean)",
                                             "epoch seconds alone (mean)"),
              title=log_title(f"{built['task']} x {built['space']['name']}: {len(rows)} of {built['architectures_in_space']}"
                              f" architectures, {built['epochs']} epochs, seeds per architecture as shown", console))
    for r in rows:
        t.add_row(r["arch"], f"{r['params']:,}", str(r["seeds"]), f"{r['final']:.4f}", f"{r['epoch_seconds']:.2f}")
    console.print(t)
    console.print(f"training time of the table's runs, alone on {built['device']}: {seconds_of(built) / 60:.1f} min")
