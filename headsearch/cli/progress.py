"""Rich display for training: a progress bar per epoch and a line per evaluated epoch."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

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

    def __enter__(self) -> "TrainProgress":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def on_start(self, steps_per_epoch: int, epochs: int) -> None:
        self.task_id = self.progress.add_task("train", total=steps_per_epoch * epochs, epoch=f"0/{epochs}",
                                              loss="-", speed="-", metric="")

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
