"""Rich displays: training (a progress bar per epoch and a line per evaluated epoch), a search (a
live table of trials by state, the best values and the current trial), and their results."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from headsearch.search.runner import SearchCallback, arch_summary
from headsearch.search.snapshot import snapshot
from headsearch.training.trainer import Callback, EpochRecord, StepInfo, TrainResult


def _fmt(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.4g}" for k, v in metrics.items())


class TrainProgress(Callback):
    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]epoch {task.fields[epoch]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[speed]} samples/s  {task.fields[metric]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self.task_id = None
        self.last_metric = ""
        self.started = False

    def __enter__(self) -> "TrainProgress":
        return self  # the bar starts with training, so input errors print nothing else

    def __exit__(self, *exc) -> None:
        if self.started:
            self.progress.stop()

    def on_start(self, steps_per_epoch: int, epochs: int) -> None:
        if not self.started:
            self.progress.start()
            self.started = True
        self.task_id = self.progress.add_task("train", total=steps_per_epoch * epochs, epoch=f"0/{epochs}",
                                              loss="-", speed="-", metric="")

    def on_prepared(self, step_mode: str, warm_up_seconds: float, note: str | None) -> None:
        if note:  # a faster mode failed: one line, then training goes on in the slower one
            self.progress.console.print(f"note: {note}; training as {step_mode}")
        if warm_up_seconds:
            self.progress.console.print(f"steps: {step_mode} (warm-up {warm_up_seconds:.1f} s, not timed)")

    def on_step(self, info: StepInfo) -> None:
        self.progress.update(self.task_id, completed=info.step, epoch=f"{info.epoch}/{info.epochs}",
                             loss=f"{info.loss:.4f}", speed=f"{info.samples_per_s:,.0f}", metric=self.last_metric)

    def on_epoch_end(self, record: EpochRecord) -> None:
        self.last_metric = _fmt({k: v for k, v in record.metrics.items()})
        self.progress.console.print(
            f"epoch {record.epoch:>3}  train loss {record.train_loss:.4f}  val: {self.last_metric}"
            f"  ({record.samples_per_s:,.0f} samples/s, {record.wall_seconds:.0f}s)"
        )


def print_result(run_dir: Path, result: TrainResult, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"{result.primary_metric}: best validation {result.best_value:.4g} at epoch {result.best_epoch}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for k, v in result.test_metrics.items():
        table.add_row(f"test {k}", f"{v:.4f}")
    table.add_row("parameters", f"{result.params:,}")
    table.add_row("training seconds (to best)", f"{result.train_seconds:.1f} ({result.best_train_seconds:.1f})")
    if result.seconds_to_target is not None:
        table.add_row(f"seconds to {result.primary_metric} {result.target}", f"{result.seconds_to_target:.1f}")
    table.add_row("throughput", f"{result.samples_per_s:,.0f} samples/s")
    console.print(table)
    console.print(f"run directory: {run_dir}")


class SearchProgress(SearchCallback):
    """Live view of a search: trials by state, the best value of each objective, the current trial."""

    def __init__(self, study, trials: int, console: Console | None = None):
        from rich.live import Live

        self.study, self.trials = study, trials
        self.console = console or Console(stderr=True)
        self.current = "-"
        self.epoch = ""
        self.step = ""
        self.log: list[str] = []
        self.snap = None
        self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)

    def __enter__(self) -> "SearchProgress":
        self.refresh()
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.refresh()
        self.live.__exit__(*exc)
        if not self.console.is_terminal:
            self.console.line()  # Live ends its last line only on a terminal

    def announce(self, line: str) -> None:
        """The search's plan (workers, trials per GPU, step mode, MPS): one line above the live table."""
        self.console.print(f"plan: {line}", soft_wrap=True, markup=False, highlight=False)  # one line, whatever the width

    def refresh(self) -> None:
        self.snap = snapshot(self.study)
        self.live.update(self._render())

    def _render(self) -> Table:
        table = Table.grid(padding=(0, 2))
        if self.snap is not None:
            c = self.snap.counts
            table.add_row("trials", f"{self.snap.finished}/{self.trials} finished: {c['complete']} complete, {c['pruned']} pruned,"
                          f" {c['rejected']} rejected, {c['failed']} failed, {c['running']} running"
                          + (f"; {c['duplicate']} duplicate proposals skipped" if c["duplicate"] else ""))
            if self.snap.best:
                table.add_row("best so far", "  ".join(f"{k} {v:.4g}" for k, v in self.snap.best.items()))
            for r in self.snap.running:
                table.add_row(f"trial {r['number']}", f"{r['arch']}  epoch {r['epoch']}")
        table.add_row("current", f"{self.current} {self.epoch} {self.step}")
        for line in self.log[-8:]:
            table.add_row("", line)
        return table

    def on_trial_start(self, number: int, cfg) -> None:
        self.current, self.epoch, self.step = f"trial {number}: {arch_summary(cfg)}", "", ""
        self.refresh()

    def on_step(self, info: StepInfo) -> None:
        self.epoch = f"epoch {info.epoch}/{info.epochs}"
        self.step = f"step {info.epoch_step}/{info.steps_per_epoch} loss {info.loss:.3f} ({info.samples_per_s:,.0f} samples/s)"
        self.live.update(self._render())

    def on_epoch_end(self, record: EpochRecord) -> None:
        self.epoch = f"epoch {record.epoch} val: {_fmt(record.metrics)}"
        self.refresh()

    def on_trial_end(self, number: int, state: str) -> None:
        t = self.study.trials[number]
        detail = ""
        if state == "COMPLETE":
            detail = "  ".join(f"{k} {v:.4g}" for k, v in zip(self.study.metric_names or [], t.values or []))
        elif "pruned" in t.user_attrs:
            from headsearch.search.report import pruned_text

            direction = (self.study.user_attrs.get("headsearch") or {}).get("objectives", [{}])[0].get("direction")
            detail = pruned_text(t.user_attrs["pruned"], direction)
        elif "rejected" in t.user_attrs:
            detail = t.user_attrs["rejected"]
        elif "fail_reason" in t.user_attrs:
            detail = t.user_attrs["fail_reason"]
        self.log.append(f"trial {number} {state.lower()}: {t.user_attrs.get('arch', '')}  {detail}")
        self.current, self.epoch, self.step = "-", "", ""
        self.refresh()


def print_search_summary(study, storage: str, console: Console | None = None) -> None:
    console = console or Console()
    snap = snapshot(study)
    c = snap.counts
    console.print(f"study {study.study_name}: {c['complete']} complete, {c['pruned']} pruned, {c['rejected']} rejected,"
                  f" {c['failed']} failed" + (f"; {c['duplicate']} duplicate proposals skipped (not trained)" if c["duplicate"] else ""))
    if snap.best:
        console.print("best per objective: " + "  ".join(f"{k} {v:.4g}" for k, v in snap.best.items()))
    console.print(f"next: headsearch report --study {study.study_name} --storage {storage}")


def print_analysis(result: dict, console: Console | None = None) -> None:
    """The tables of `headsearch analyze`: per-layer diversity and importance, and the pruning curve."""
    from headsearch.analysis.figures import short_name

    console = console or Console()
    table = Table(title=f"{result['task']}: {result['metric']} {result['baseline']:.4g} on {result['samples']} validation samples")
    for col in ("layer", "H", "q-ortho", "ctx-nonortho", "out-dissim", "att-div", "entropy", "importance"):
        table.add_column(col, justify="right" if col != "layer" else "left")
    table.caption = ("q-ortho, ctx-nonortho (0-1): high = heads less diverse; out-dissim, att-div: high = more diverse;"
                     " entropy in nats; importance: min-max of the per-layer normalised scores")
    fmt_num = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    for layer in result["layers"]:
        sc = layer["scalars"]
        imp = [v for v in layer["importance"] if v is not None]
        table.add_row(short_name(layer["name"]), str(layer["heads"]), fmt_num(sc.get("query_orthogonality")),
                      fmt_num(sc.get("context_nonorthogonality_normalized")), fmt_num(sc.get("output_dissimilarity")),
                      fmt_num(sc.get("attention_diversity")),
                      fmt_num(sum(layer["entropy"]) / len(layer["entropy"])),
                      f"{min(imp):.2f}-{max(imp):.2f}" if imp else "-")
    console.print(table)
    curve = Table(title="pruning curve (least important heads first)")
    curve.add_column("heads pruned", justify="right")
    curve.add_column(result["metric"], justify="right")
    for p in result["pruning_curve"]:
        curve.add_row(f"{p['heads_pruned']} ({100 * p['fraction']:.0f}%)", f"{p[result['metric']]:.4g}")
    console.print(curve)
    console.print(f"wrote {len(result['figures'])} figures and analysis.json to {Path(result['figures'][0]).parent}")
    if result.get("uploaded"):
        console.print(f"uploaded to {result['uploaded']}")
