"""Per-epoch TensorBoard records (`--tensorboard DIR`): an optional extra, `pip install 'headsearch[tensorboard]'`.

`TensorBoardWriter` is a trainer callback. After each evaluated epoch (a solo `fit`'s, or a cohort slot's:
both hand the slot's own `EpochRecord` to its callbacks) it writes to its run's event file, at global step =
the epoch:

    train/loss            the epoch's mean training loss (metrics.jsonl's train_loss)
    train/lr              the learning rate after the epoch's last step (lr)
    time/epoch_seconds    this epoch's training seconds (the difference of the cumulative train_seconds)
    val/<metric>          each validation metric (metrics)
    diversity/<name>      each head-diversity scalar, when diversity is tracked

and, once, the run's hyperparameters (`hparams`: the architecture's fields for `headsearch train`, the
trial's sampled parameters for `headsearch run`) for TensorBoard's HPARAMS tab, in the same event file.
`headsearch train` writes one run into DIR; `headsearch run` one per trial, DIR/trial-00003, so TensorBoard
lists the trials as separate runs. Each worker process writes its own trials' directories: no writer is
shared. The record of an epoch a pruner stops at is written too (the writer comes before the pruner).

TensorBoard is imported only when the option is given: `check_tensorboard`, called before anything is created,
says in one line (a `HeadsearchError`) that the package is missing or that DIR cannot be a writable folder.
"""
from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any, Mapping

from headsearch.errors import HeadsearchError
from headsearch.io import folder_problem
from headsearch.training.trainer import Callback, EpochRecord

MISSING = ("--tensorboard needs the tensorboard package, which is not installed:"
           " pip install 'headsearch[tensorboard]'")


def check_tensorboard(log_dir: str | Path) -> None:
    """Before anything runs: a one-line `HeadsearchError` when torch's TensorBoard writer cannot be imported
    here (the extra is not installed), or when `log_dir` cannot become a writable folder."""
    try:
        importlib.import_module("torch.utils.tensorboard")  # what the writer imports (it needs tensorboard)
    except ImportError:
        raise HeadsearchError(MISSING) from None
    root = Path(log_dir)
    if problem := folder_problem(root, "the TensorBoard runs"):
        raise HeadsearchError(f"--tensorboard {root}{problem}")


def trial_dir(root: str | Path, number: int) -> Path:
    """The TensorBoard run of trial `number` under `root` (named as its run directory is)."""
    return Path(root) / f"trial-{number:05d}"


def hparam_value(v: Any) -> bool | int | float | str:
    """A value TensorBoard's hparams accept: numbers, strings and booleans as they are, lists joined with '-'
    (a head schedule: 8-4-2), anything else as its string."""
    if isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return "-".join(map(str, v))
    return str(v)


class TensorBoardWriter(Callback):
    """Writes each epoch's record into `log_dir` (made when the first epoch ends). `close()` when the run ends."""

    def __init__(self, log_dir: str | Path, hparams: Mapping[str, Any] | None = None):
        self.log_dir = Path(log_dir)
        self.hparams = dict(hparams) if hparams else {}
        self.writer = None
        self._train_seconds = 0.0  # the cumulative training seconds at the previous epoch's end

    def on_epoch_end(self, record: EpochRecord) -> None:
        w = self._open(record)
        step = record.epoch
        w.add_scalar("train/loss", record.train_loss, step)
        w.add_scalar("train/lr", record.lr, step)
        w.add_scalar("time/epoch_seconds", record.train_seconds - self._train_seconds, step)
        self._train_seconds = record.train_seconds
        for name, value in record.metrics.items():
            w.add_scalar(f"val/{name}", value, step)
        for name, value in record.diversity.items():
            if value is not None and math.isfinite(value):
                w.add_scalar(f"diversity/{name}", value, step)
        w.flush()

    def _open(self, record: EpochRecord):
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.log_dir))
            if self.hparams:
                from torch.utils.tensorboard.summary import hparams

                # Into this run's own file (SummaryWriter.add_hparams would make a sub-run and write its metrics
                # again at step 0); the HPARAMS tab reads the metrics from the val/ scalars.
                summaries = hparams({k: hparam_value(v) for k, v in self.hparams.items()},
                                    {f"val/{name}": 0.0 for name in record.metrics})
                for summary in summaries:
                    self.writer.file_writer.add_summary(summary)
        return self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
