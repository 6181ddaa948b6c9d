"""`headsearch compare`: train configs with seeds 0..N-1 and say which differences are more than the seeds' spread.

A few lines over headsearch.search.compare (the runs are a study's trials, trained by the search's
workers) and headsearch.analysis.stats; Rich tables here, data there.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from headsearch.cli.common import (PLAN_COHORT_HELP, PLAN_WORKERS_HELP, check_format, echo_json, exits, right_columns,
                                   setting_option)

FORMATS = ("table", "json", "csv")
# The metrics the table shows, when the runs have them; the JSON holds every one.
TABLE_METRICS = ("val_{primary}", "test_{primary}", "best_epoch", "time", "params")
RUNS, WORKERS = "Runs", "Storage and workers"
# What Ctrl-C and a full disk leave of a comparison (`compare`, `report --robust`).
KEPT = "finished runs are kept in the study; free space (or fix the disk) and run the same command again"
INTERRUPTED = "finished runs are kept in the study; run the same command to train the rest"


@exits(kept=KEPT, interrupted=INTERRUPTED)
def compare(
    configs: list[str] = typer.Argument(..., metavar="CONFIG...", help="YAML files (architecture or run config), study:NAME:TRIAL or study:NAME:pareto."),
    task: str = setting_option("task", panel=RUNS),
    seeds: int = typer.Option(3, "--seeds", help="Seeds per config: 0..N-1 (at least 2).", rich_help_panel=RUNS),
    data_dir: Optional[Path] = setting_option("data_dir", panel=RUNS),
    data_file: Optional[Path] = setting_option("data_file", panel=RUNS),
    preset: Optional[str] = setting_option("preset", "Task preset for YAML configs, e.g. tiny.", panel=RUNS),
    epochs: Optional[int] = setting_option("epochs", "Epochs per run (default: each config's).", panel=RUNS),
    sets: list[str] = setting_option("sets", "SECTION.KEY=VALUE for every config, e.g. data.val_size=0 (repeatable).", panel=RUNS),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for comparison.json and curves.png (default RUN_ROOT/<study>/compare)."),
    fmt: str = typer.Option("table", "--format", "-f", help="table | json | csv (on stdout)."),
    storage: str = setting_option("storage", "Optuna storage URL: the runs' study, and where study:NAME configs are read.", panel=WORKERS),
    study: Optional[str] = setting_option("study", "The comparison's study name (default compare-<task>-<hash of the configs>).", panel=WORKERS),
    run_root: Path = setting_option("run_root", panel=WORKERS),
    workers: Optional[int] = setting_option("workers", PLAN_WORKERS_HELP, panel=WORKERS),
    cohort: Optional[int] = setting_option("cohort", PLAN_COHORT_HELP, panel=WORKERS),
    device: str = setting_option("device", panel=WORKERS),
) -> None:
    """Train every CONFIG with seeds 0..N-1; means, spreads and paired differences with 95% intervals."""
    from headsearch import api
    from headsearch.cli.checks import check_new_storage, check_new_study_name, check_output_folder
    from headsearch.cli.progress import SearchWatch
    from headsearch.search.compare import parse_sets

    check_format(fmt, FORMATS)
    check_new_study_name(study)  # names and where the results go: before anything trains
    check_new_storage(storage)
    check_output_folder(out, "--out", "comparison.json and curves.png")
    result = api.compare(configs, task, seeds=seeds, storage=storage, run_root=run_root, out=out, preset=preset,
                         epochs=epochs, sets=parse_sets(sets), data_dir=data_dir, data_file=data_file, study=study,
                         workers=workers, cohort=cohort, device=device, watch=SearchWatch(), argv=sys.argv,
                         on_written=echo_written)
    print_result(result, fmt)


def echo_written(paths) -> None:
    """The comparison's files, named on stderr (stdout holds its JSON or CSV)."""
    typer.echo("written: " + ", ".join(map(str, paths)), err=True)


def print_result(result: dict, fmt: str) -> None:
    from headsearch.jsonsafe import json_safe

    if fmt == "json":
        echo_json(json_safe(result))
    elif fmt == "csv":
        import csv

        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(["kind", "config", "a", "b", "metric", "mean", "std", "n", "mean_diff", "ci95_lo", "ci95_hi", "p_value"])
        w.writerows(["config", c["name"], "", "", m, v, c["std"].get(m), len(c["runs"]), "", "", "", ""]
                    for c in result["configs"] for m, v in c["mean"].items())
        w.writerows(["difference", "", d["a"], d["b"], d["metric"], "", "", d["n"], d["mean_diff"], *d["ci95"],
                     d["p_value"]] for d in result["differences"])
    else:
        print_comparison(result)


def print_comparison(result: dict, console=None) -> None:
    from rich.table import Table

    from headsearch.cli.progress import log_title, output_console

    console = console or output_console()  # a log's tables: not wrapped
    primary = result["curve_metric"].removeprefix("val_")  # the task's primary metric
    metrics = [m.format(primary=primary) for m in TABLE_METRICS]
    metrics = [m for m in metrics if any(m in c["mean"] for c in result["configs"])]
    table = Table("config", *right_columns("runs", *(m.replace("_", " ") for m in metrics)),
                  title=log_title(f"{result['study']}: {result['seeds']} seeds per config (mean ± std)", console))
    for c in result["configs"]:
        table.add_row(c["name"], str(len(c["runs"])), *(_mean_std(c, m) for m in metrics))
    console.print(table)
    shown = [d for d in result["differences"] if d["metric"] in metrics]
    if shown:
        diffs = Table(title=log_title("paired differences b - a over seeds (95% bootstrap interval, paired t-test)", console))
        for col in ("a", "b", "metric", "mean b - a", "95% interval", "p"):
            diffs.add_column(col, justify="right" if col in ("mean b - a", "p") else "left")
        for d in shown:
            lo, hi = d["ci95"]
            mark = " *" if d["distinguishable"] else ""
            diffs.add_row(d["a"], d["b"], d["metric"].replace("_", " "), f"{d['mean_diff']:+.4g}",
                          f"[{lo:+.4g}, {hi:+.4g}]{mark}", f"{d['p_value']:.3g}")
        console.print(diffs)
        console.print("* distinguishable: the interval excludes 0 and p < 0.05")
    best = result.get("best")
    if best:
        if best["distinguishable"]:
            console.print(f"best on {best['metric']}: {best['name']}, distinguishable from every other config")
        else:
            console.print(f"best on {best['metric']}: {best['name']}, but not distinguishable from "
                          f"{', '.join(best['not_distinguishable_from'])} with {result['seeds']} seeds")
    if result["missing"]:
        console.print(f"[yellow]{len(result['missing'])} run(s) missing (failed or not trained):[/yellow] " +
                      ", ".join(f"{m['config']} seed {m['seed']}" for m in result["missing"]))


def print_robust_front(result: dict, console=None) -> None:
    """`report --robust`: the front's configs on their mean objectives over seeds, with 95% intervals, and
    which of them stay on the front of the means."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    on_front = set(result["front_on_means"])
    objectives = [f"{o['name'].replace('_', ' ')} {'↑' if o['direction'] == 'maximize' else '↓'}"
                  for o in result["objectives"]]
    table = Table("trial", "architecture", *right_columns("runs", *objectives), "front of the means",
                  title=f"Pareto front retrained with {result['seeds']} seeds ({result['study']}): mean [95% interval]")
    for c in result["configs"]:
        a = c["config"]["arch"]
        arch = "-".join(map(str, a["enc_heads"])) + f" skip={a['skip']} fusion={a['fusion']}"
        cells = []
        for o in result["objectives"]:
            mean, ci = c["mean"].get(o["name"]), c["ci95"].get(o["name"])
            cells.append("-" if mean is None else f"{mean:.4g}" + (f" [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else ""))
        table.add_row(c["name"], arch, str(len(c["runs"])), *cells, "yes" if c["name"] in on_front else "no")
    console.print(table)


def _mean_std(c: dict, m: str) -> str:
    mean, std = c["mean"].get(m), c["std"].get(m)
    if mean is None:
        return "-"
    if m == "params":
        return f"{mean:,.0f}"
    return f"{mean:.4g}" + (f" ± {std:.2g}" if std is not None else "")
