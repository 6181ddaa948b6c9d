"""`headsearch report`, `export` and `dashboard`: reading a study that `headsearch run` wrote.

Registered on the main app by cli/main.py. Bad input (an unreadable storage, an unknown study,
a trial that cannot be exported) gets one line on stderr and exit code 2, and creates nothing.
"""
from __future__ import annotations

import errno
from pathlib import Path
from typing import Optional

import typer

from headsearch.cli.checks import check_artifact_folder, check_output_folder, check_study_to_read
from headsearch.cli.common import check_format, echo_json, exits, fail, right_columns, setting_option

STORAGE_HELP = "Optuna storage URL of the search (sqlite:///FILE.db, postgresql://..., journal:FILE.log, redis://..., grpc://HOST:PORT)."
STUDY_HELP = "Study name (default: the only study in the storage)."
FORMATS = ("table", "json", "csv")


def _quiet_optuna() -> None:
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


@exits(kept="the study is unchanged and plots already written are whole; free space and run it again")
def report(
    study: Optional[str] = setting_option("study", STUDY_HELP),
    storage: str = setting_option("storage", STORAGE_HELP),
    fmt: str = typer.Option("table", "--format", "-f", help="table (Rich tables), json (the whole report) or csv (one row per trial)."),
    plots: Optional[Path] = typer.Option(None, "--plots", help="Also write PNG and HTML plots into this folder and upload them to the study as artifacts."),
    robust: int = typer.Option(0, "--robust", help="Retrain the Pareto front with seeds 0..N-1 (`headsearch compare`) and show it on mean values with 95% intervals."),
    run_root: Path = setting_option("run_root", "With --robust: run directories go in RUN_ROOT/<study>-robust/."),
    device: str = setting_option("device", "With --robust: auto, cpu, cuda ..."),
    pruning_audit: bool = typer.Option(False, "--pruning-audit", help="Also replay the study's stored curves under other pruning rules and rungs: epochs each would have trained, and the front members it would have pruned."),
) -> None:
    """Summarise a search: Pareto front, trial counts, parameter importances, what pruning saved."""
    from headsearch import api

    check_format(fmt, FORMATS)
    check_study_to_read(study)
    if pruning_audit and (robust or fmt == "csv"):
        fail("--pruning-audit goes with --format table or json, without --robust")
    if plots is not None:
        if robust:
            fail("--plots does not go with --robust (it writes curves.png in RUN_ROOT/<study>-robust/compare):"
                 " run `headsearch report --plots DIR` without --robust for the search's plots")
        check_output_folder(plots, "--plots", "the plots")
        check_artifact_folder(storage)  # the PNGs are uploaded there
    _quiet_optuna()
    if robust:
        return _robust_report(study, storage, robust, fmt, run_root, device)
    files = api.study_report(storage, study, plots=plots, pruning_audit=pruning_audit)
    rep, audit, published, notes = files.report, files.audit, files.plots, files.notes
    if fmt == "json":
        data = rep.to_dict()
        if audit is not None:
            data["pruning_audit"] = audit.to_dict()
        echo_json(data, indent=2)
    elif fmt == "csv":
        import csv
        import sys

        header, rows = rep.csv_rows()
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)
    else:
        print_report(rep)
        if audit is not None:
            print_pruning_audit(audit)
    if published:
        # With json/csv on stdout, the list of plots goes to stderr so the data stays parseable.
        to_err = fmt != "table"
        typer.echo(f"plots (PNGs uploaded as artifacts to {files.artifact_dir}):", err=to_err)
        for path in published.files:
            uploaded = published.artifacts.get(path)
            typer.echo(f"  {path}" + (f"  (artifact {uploaded})" if uploaded else ""), err=to_err)
        if published.dashboard:
            typer.echo(f"figures saved in the study for optuna-dashboard: {', '.join(published.dashboard)}", err=to_err)
        elif published.dashboard_note:
            typer.echo(published.dashboard_note, err=to_err)
        if notes is not None and notes.written:
            typer.echo(f"notes saved in the study for optuna-dashboard: {notes.summary()}", err=to_err)


def print_pruning_audit(audit, console=None) -> None:
    """`report --pruning-audit`: one row per replayed rule (see headsearch.search.audit)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"pruning audit: {audit.trials} trained trials' curves replayed under each rule (* this study's rule)")
    for name in ("rule", "rungs", "epochs", "saved", "trials pruned", "front lost", "unknown", "false prunes"):
        table.add_column(name, justify="left" if name in ("rule", "rungs", "front lost") else "right")
    for r in audit.rules:
        epochs = str(r.epochs) if r.epochs == r.epochs_at_most else f"{r.epochs}-{r.epochs_at_most}"
        saved = "-" if r.rule == "none" else _audit_saved(r)
        lost = ", ".join(map(str, r.front_lost)) or "-"
        table.add_row(r.rule + (" *" if r.own else ""), r.rungs_text, epochs, saved, str(len(r.pruned)), lost, str(r.unknown),
                      _false_prunes(r))
    console.print(table)
    for line in audit_notes(audit):
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def _false_prunes(r) -> str:
    """"1/4: 25% (4-70%)": of the trials the rule stops whose end is known, those on the front, and the 95% interval."""
    if r.false_prune_rate is None:
        return "-"
    low, high = r.false_prune_interval
    return f"{r.false_prunes}/{r.stopped_known}: {r.false_prune_rate:.0%} ({low:.0%}-{high:.0%})"


def _audit_saved(r) -> str:
    """Epochs saved against no pruning and how many times fewer; a range where unknown trials may run on."""
    none = r.epochs + r.epochs_saved
    low = none - r.epochs_at_most
    if low == r.epochs_saved:
        return f"{r.epochs_saved} ({r.fewer_than_none:.2f}x fewer)" if r.fewer_than_none else str(r.epochs_saved)
    return f"{low}-{r.epochs_saved} ({none / r.epochs_at_most:.2f}-{r.fewer_than_none:.2f}x fewer)"


def audit_notes(audit) -> list[str]:
    """The lines under the audit's table: what "unknown" means, and what the replay assumed."""
    lines = [f"front: trials {', '.join(map(str, audit.front)) or '-'}; saved: epochs fewer than no pruning."
             " unknown: trials a rule lets run past the epoch the study pruned them at (never trained further):"
             " counted with the epochs known, or to their end where the rule could not stop them (a-b: up to b)."
             " false prunes: of the trials a rule stops whose end is known (run to their last epoch here; with"
             " --pruner-pause, the paused runs resumed to the end), those on the front, with a 95% Wilson interval;"
             " a trial pruned for good has no end to count, so a study that killed shows - for its own rule."]
    if audit.note:
        lines.append(audit.note)
    if not audit.options_stored:
        lines.append("the study does not record its pruner options: replayed with headsearch run's defaults")
    if audit.own_differs:
        lines.append(f"the replay of this study's own rule decides trials {', '.join(map(str, audit.own_differs))}"
                     " otherwise than the study did (one worker's replay: the study's trials saw the others as they"
                     " ran, or it ran other settings)")
    return lines


def _robust_report(study: Optional[str], storage: str, seeds: int, fmt: str, run_root: Path, device: str) -> None:
    """`report --robust N`: the front retrained through `compare`, shown on mean values."""
    import sys

    from headsearch import api
    from headsearch.cli.compare_command import INTERRUPTED, KEPT, echo_written, print_result, print_robust_front
    from headsearch.cli.progress import SearchWatch

    with exits(kept=KEPT, interrupted=INTERRUPTED):
        result = api.robust(storage, study, seeds=seeds, run_root=run_root, device=device, watch=SearchWatch(),
                            argv=sys.argv, on_written=echo_written)
    if fmt == "table":
        print_robust_front(result)
    print_result(result, fmt)


def print_report(rep, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    c = rep.counts
    objs = ", ".join(f"{o.name} {'↑' if o.direction == 'maximize' else '↓'}" for o in rep.objectives)
    console.print(f"[bold]study {rep.study}[/bold]  task {rep.task or '-'}  objectives: {objs}  storage {rep.storage}")
    console.print(f"trials: {c['complete']} complete, {c['pruned']} pruned, {c['rejected']} rejected, {c['failed']} failed,"
                  f" {c['running']} running, {c['waiting']} waiting"
                  + (f"; {c['duplicate']} duplicate proposals (not trained, not counted)" if c["duplicate"] else "")
                  + (f"; {c['over_budget']} asked over the budget (not trained, not counted)" if c["over_budget"] else ""))

    title = "Pareto front" if rep.multi_objective else "best trial"
    objectives = [f"{o.name} {'↑' if o.direction == 'maximize' else '↓'}" + (f" ({o.unit})" if o.unit else "")
                  for o in rep.objectives]
    # The task's primary metric on the test split; the rest is in --format json.
    test_names = [rep.primary_metric] if any(rep.primary_metric in r.test_metrics for r in rep.front) else []
    front = Table(*right_columns("trial"), "heads", "skip", "fusion",
                  *right_columns(*objectives, *(f"test {k}" for k in test_names), "best epoch"),
                  title=f"{title} ({len(rep.front)} trials)")
    for r in rep.front:
        number = str(r.number) + (f" (= {', '.join(map(str, r.duplicates))})" if r.duplicates else "")
        front.add_row(number, "-".join(map(str, r.schedule or [])) or "-", r.skip or "-", r.fusion or "-",
                      *[_fmt(r.values.get(o.name)) for o in rep.objectives],
                      *[_fmt(r.test_metrics.get(k)) for k in test_names], str(r.best_epoch or "-"))
    if rep.front:
        console.print(front)
        for r in rep.front:
            if r.run_dir:
                console.print(f"  trial {r.number}: {r.run_dir}", soft_wrap=True)
    else:
        console.print("no complete trials yet: nothing on the Pareto front")

    imp = Table("objective", "importances", title="parameter importances (PED-ANOVA, per objective)")
    for i in rep.importances:
        text = "  ".join(f"{k} {v:.2f}" for k, v in i.importances.items()) if not i.error else f"not computed: {i.error}"
        imp.add_row(i.objective, text)
    console.print(imp)

    s = rep.savings
    console.print(f"pruning: {s.trials} trained trials ran {s.epochs_run} epochs; without pruning {s.epochs_without_pruning}"
                  f" -> {s.epochs_saved} epochs saved ({s.saved_fraction:.0%})")
    if rep.costs:
        console.print(rep.costs["line"], soft_wrap=True, markup=False, highlight=False)
    if rep.anytime:
        console.print(anytime_line(rep.anytime), soft_wrap=True)
    if rep.rung_check:
        console.print(rung_line(rep.rung_check, rep.primary_metric), soft_wrap=True, markup=False, highlight=False)
    if rep.rung_warning:
        console.print(f"warning: {rep.rung_warning}", soft_wrap=True, markup=False, highlight=False)

    if rep.diversity_vs_quality:
        div = Table("diversity (mean over layers)", *right_columns(*(o.name for o in rep.objectives)),
                    title="head diversity vs objectives across complete trials (Spearman rho)")
        for metric, rhos in rep.diversity_vs_quality.items():
            div.add_row(metric, *[_fmt(rhos.get(o.name)) for o in rep.objectives])
        console.print(div)

    trials = Table(*right_columns("trial"), "state", "architecture",
                   *right_columns(*(o.name for o in rep.objectives), "epochs"), "note", title="all trials")
    for r in rep.trials:
        trials.add_row(str(r.number), r.state, r.arch or "-", *[_fmt(r.values.get(o.name)) for o in rep.objectives],
                       str(r.epochs_run) if r.epochs_run is not None else "-", r.note)
    console.print(trials)


def anytime_line(curve) -> str:
    """The anytime curve in one line: the front's hypervolume (of the final front's) at each quarter of the
    trained trials, and the trial after which it last grew."""
    n = len(curve)
    marks = sorted({max(1, round(n * q)) for q in (0.25, 0.5, 0.75, 1.0)})
    at = " / ".join(f"{curve[m - 1].hypervolume:.2f}" for m in marks)
    last = next(p for p in curve if p.hypervolume >= curve[-1].hypervolume - 1e-12)
    when = f"trial {last.trials} of {n}"
    if last.fair_seconds is not None and curve[-1].fair_seconds:
        when += f", {last.fair_seconds:,.0f} of {curve[-1].fair_seconds:,.0f} fair seconds"
    return (f"anytime: front hypervolume after {' / '.join(map(str, marks))} trained trials: {at}"
            f" (of the final front's); last grew at {when}")


def rung_line(rows, metric: str | None) -> str:
    """The rung check in one line: Spearman's rho at epoch 1, at each rung and at the last epoch (the
    others are in --format json and the --plots figure); a rung's n where fewer trials reached it."""
    finished = max(r.n for r in rows)
    shown = [r for i, r in enumerate(rows) if i == 0 or r.is_rung or i == len(rows) - 1]
    parts = []
    for r in shown:
        tags = [t for t, on in (("rung", r.is_rung), ("last", r is rows[-1]), (f"n={r.n}", r.n < finished)) if on]
        rho = "-" if r.rho is None else f"{r.rho:.2f}"
        parts.append(f"epoch {r.epoch}" + (f" ({', '.join(tags)})" if tags else "") + f" {rho}")
    return (f"rungs: Spearman's rho between each epoch and the final {metric or 'value'}, over {finished} finished"
            f" trials: {'; '.join(parts)}")


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


@exits(kept="configs already written are whole; free space and export again")
def export(
    study: Optional[str] = setting_option("study", STUDY_HELP),
    storage: str = setting_option("storage", STORAGE_HELP),
    trial: Optional[int] = typer.Option(None, "--trial", help="Export this trial (it must be complete)."),
    pareto: bool = typer.Option(False, "--pareto", help="Export every trial on the Pareto front (or the best trial of a single-objective study)."),
    best: Optional[str] = typer.Option(None, "--best", help="Export the complete trial best on this objective or validation metric."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for the YAML files (trial-00012.yaml, ...)."),
) -> None:
    """Write chosen trials' full run configs as YAML for `headsearch train --config`."""
    from headsearch import api

    if sum([trial is not None, pareto, best is not None]) != 1:
        fail("pass exactly one of --trial N, --pareto, --best METRIC")
    check_study_to_read(study)
    check_output_folder(out, "--out", "the YAML files")
    _quiet_optuna()
    for p in api.export(storage, study, out=out, trial=trial, pareto=pareto, best=best):
        typer.echo(str(p))


@exits()
def dashboard(
    study: Optional[str] = setting_option("study", "Check this study exists and print its page's URL."),
    storage: str = setting_option("storage", STORAGE_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 to be reachable from other machines)."),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
    artifact_dir: Optional[Path] = typer.Option(None, "--artifact-dir", help="Artifact folder (default: beside the database, where `report --plots` uploads)."),
) -> None:
    """Serve optuna-dashboard on the search's storage, with its plots as artifacts."""
    import importlib.util

    from headsearch.errors import HeadsearchError

    if importlib.util.find_spec("optuna_dashboard") is None:
        fail("optuna-dashboard is not installed: pip install 'headsearch[dashboard]'")
    if not 0 < port < 65536:
        fail(f"--port {port} is not a port number (1-65535)")
    check_study_to_read(study)
    check_artifact_folder(storage, artifact_dir, "--artifact-dir", writes=False)  # served, not written
    _quiet_optuna()
    from headsearch.io import hide_passwords
    from headsearch.search.artifacts import default_artifact_dir
    from headsearch.search.report import open_existing_storage, study_names

    store = open_existing_storage(storage)
    names = study_names(store)
    if study is not None and study not in names:
        raise HeadsearchError(f"unknown study {study} in {storage}: studies there are {', '.join(names) or 'none'}")
    from optuna.artifacts import FileSystemArtifactStore
    from optuna_dashboard import run_server

    port_problem = unavailable_port(host, port)
    if port_problem:
        fail(f"cannot serve on {host}:{port}: {port_problem}")
    adir = artifact_dir if artifact_dir is not None else default_artifact_dir(storage)
    _notes_before_serving(store, [study] if study is not None else names)
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    base = f"http://{shown}:{port}/dashboard"
    if study is not None:
        typer.echo(f"study {study}: {base}/studies/{store.get_study_id_from_name(study)}")
    else:
        typer.echo(f"optuna-dashboard: {base}  ({len(names)} studies)")
    typer.echo(f"storage {hide_passwords(storage)}, artifacts in {adir}; Ctrl-C stops the server", err=True)
    try:
        run_server(store, host=host, port=port, artifact_store=FileSystemArtifactStore(str(adir)))
    except OSError as e:
        fail(f"cannot serve on {host}:{port}: {e.strerror or e}")
    except KeyboardInterrupt:
        pass


def _notes_before_serving(store, names) -> None:
    """The dashboard notes (why each trial was pruned; the study's pruning plan and savings) brought up to date
    in each study served. A storage that cannot be written (read-only) is served without them: one line says so."""
    import optuna

    from headsearch.search.notes import write_dashboard_notes

    for name in names:
        try:
            done = write_dashboard_notes(optuna.load_study(study_name=name, storage=store))
        except Exception as e:  # a read-only database, a storage error: the dashboard is still worth serving
            typer.echo(f"study {name}: notes not written ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", err=True)
            continue
        if done.written:
            typer.echo(f"study {name}: notes written for optuna-dashboard: {done.summary()}", err=True)


def unavailable_port(host: str, port: int) -> str | None:
    """Why the dashboard could not listen on host:port (None: it can), found by binding it the way its
    server will (address reuse on), before anything is printed or served."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"{host} is not an address of this machine ({e.strerror}): use --host 127.0.0.1 or 0.0.0.0"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            busy = "the port is in use (another dashboard?): pass another --port" if e.errno == errno.EADDRINUSE else e.strerror
            return busy or str(e)
    return None
