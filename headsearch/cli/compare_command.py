"""`headsearch compare`: train configs with seeds 0..N-1 and say which differences are more than the seeds' spread.

A few lines over headsearch.search.compare (the runs are a study's trials, trained by the search's
workers) and headsearch.analysis.stats; Rich tables here, data there.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from headsearch.cli.common import storage_option

FORMATS = ("table", "json", "csv")
# The metrics the table shows, when the runs have them; the JSON holds every one.
TABLE_METRICS = ("val_{primary}", "test_{primary}", "best_epoch", "time", "params")


def compare(
    configs: list[str] = typer.Argument(..., metavar="CONFIG...", help="YAML files (architecture or run config), study:NAME:TRIAL or study:NAME:pareto."),
    task: str = typer.Option(..., "--task", "-t", help="Task name (see `headsearch tasks`), or a plugin as package.module:attr (docs/plugins.md)."),
    seeds: int = typer.Option(3, "--seeds", help="Seeds per config: 0..N-1 (at least 2)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Local dataset folder (vit-cifar10)."),
    data_file: Optional[Path] = typer.Option(None, "--data-file", help="Local tab-separated parallel file (translation-en-es)."),
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="Task preset for YAML configs, e.g. tiny."),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="Epochs per run (default: each config's)."),
    sets: list[str] = typer.Option([], "--set", help="SECTION.KEY=VALUE for every config, e.g. data.val_size=0 (repeatable)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for comparison.json and curves.png (default RUN_ROOT/<study>/compare)."),
    fmt: str = typer.Option("table", "--format", "-f", help="table | json | csv (on stdout)."),
    storage: str = storage_option("Optuna storage URL: the runs' study, and where study:NAME configs are read."),
    study: Optional[str] = typer.Option(None, "--study", help="The comparison's study name (default compare-<task>-<hash of the configs>)."),
    run_root: Path = typer.Option(Path("runs"), "--run-root", help="Run directories go in RUN_ROOT/<study>/."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Worker processes (default: the plan's, as `run`)."),
    cohort: Optional[int] = typer.Option(None, "--cohort", help="Runs a worker trains as one stacked model (ViT; 1: off)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda ..."),
) -> None:
    """Train every CONFIG with seeds 0..N-1; means, spreads and paired differences with 95% intervals."""
    from headsearch.cli.checks import check_new_storage, check_new_study_name, check_output_folder
    from headsearch.cli.common import fail

    if fmt not in FORMATS:
        fail(f"--format {fmt!r} is not known: use one of {', '.join(FORMATS)}")
    check_new_study_name(study)  # names and where the results go: before anything trains
    check_new_storage(storage)
    check_output_folder(out, "--out", "comparison.json and curves.png")
    search, result = compare_or_fail(
        lambda: _prepare(configs, task, seeds, data_dir, data_file, preset, epochs, sets, storage, study, run_root,
                         workers, cohort, device), run_root, out)
    print_result(result, fmt, search.task)


def compare_or_fail(build, run_root: Path, out: Path | None = None):
    """`build()` -> (Search, ConfigGrid); train what the comparison lacks, read it back, write its files
    (`out`, default RUN_ROOT/<study>/compare, named on stderr). Returns (search, result). Bad input and
    faults end the command with one line, as every command's do."""
    from headsearch.cli.common import fail, fail_on_fault
    from headsearch.errors import HeadsearchError

    try:
        search, grid = build()
        result, paths = run_comparison(search, grid, out or run_root / search.study_name / "compare")
    except HeadsearchError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted: finished runs are kept in the study; run the same command to train the rest", code=130)
    except Exception as e:
        fail_on_fault(e, "finished runs are kept in the study; free space (or fix the disk) and run the same command again")
    typer.echo("written: " + ", ".join(map(str, paths)), err=True)
    return search, result


def run_comparison(search, grid, out: Path):
    """Train what the comparison's study lacks (a live view on stderr), then read it back: (result, files written).
    Failed workers end the command as `run`'s do."""
    from headsearch.cli.common import fail, worker_failure_line
    from headsearch.cli.progress import SearchProgress, grid_label
    from headsearch.search.compare import comparison, write_comparison
    from headsearch.search.workers import open_search, run_search

    study_obj = open_search(search)
    with SearchProgress(study_obj, grid.points, label=grid_label(grid)) as display:
        failures = run_search(search, [display], argv=sys.argv, poll=display.refresh, announce=display.announce)
    if failures:
        fail(worker_failure_line(failures), code=2 if all(f.bad_input for f in failures) else 1)
    result = comparison(study_obj, grid, search.task, search.objectives)
    return result, write_comparison(result, out)


def _prepare(configs, task, seeds, data_dir, data_file, preset, epochs, sets, storage, study, run_root, workers, cohort, device):
    """The comparison's search and grid; nothing written yet."""
    from headsearch.search.compare import comparison_search, parse_sets

    return comparison_search(configs, task, seeds=seeds, storage=storage, run_root=str(run_root), preset=preset,
                             epochs=epochs, sets=parse_sets(sets), study=study,
                             data_dir=str(data_dir) if data_dir else None, data_file=str(data_file) if data_file else None,
                             workers=workers, cohort=cohort, device=device)


def print_result(result: dict, fmt: str, task) -> None:
    import json

    from headsearch.jsonsafe import json_safe

    if fmt == "json":
        typer.echo(json.dumps(json_safe(result), indent=1))
    elif fmt == "csv":
        import csv

        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(["kind", "config", "a", "b", "metric", "mean", "std", "n", "mean_diff", "ci95_lo", "ci95_hi", "p_value"])
        for c in result["configs"]:
            for m, v in c["mean"].items():
                w.writerow(["config", c["name"], "", "", m, v, c["std"].get(m), len(c["runs"]), "", "", "", ""])
        for d in result["differences"]:
            w.writerow(["difference", "", d["a"], d["b"], d["metric"], "", "", d["n"], d["mean_diff"], *d["ci95"], d["p_value"]])
    else:
        print_comparison(result, task)


def print_comparison(result: dict, task, console=None) -> None:
    from rich.table import Table

    from headsearch.cli.progress import log_title, output_console

    console = console or output_console()  # a log's tables: not wrapped
    metrics = [m.format(primary=task.primary.name) for m in TABLE_METRICS]
    metrics = [m for m in metrics if any(m in c["mean"] for c in result["configs"])]
    table = Table(title=log_title(f"{result['study']}: {result['seeds']} seeds per config (mean ± std)", console))
    table.add_column("config")
    table.add_column("runs", justify="right")
    for m in metrics:
        table.add_column(m.replace("_", " "), justify="right")
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
    table = Table(title=f"Pareto front retrained with {result['seeds']} seeds ({result['study']}): mean [95% interval]")
    table.add_column("trial")
    table.add_column("architecture")
    table.add_column("runs", justify="right")
    for o in result["objectives"]:
        table.add_column(f"{o['name'].replace('_', ' ')} {'↑' if o['direction'] == 'maximize' else '↓'}", justify="right")
    table.add_column("front of the means")
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


def register(app: typer.Typer) -> None:
    app.command()(compare)
