"""Training: `train_run` is the library entry point behind `headsearch train` (and each search trial)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from headsearch.config import RunConfig
from headsearch.tasks import DataSource, get_task


def train_run(
    cfg: RunConfig,
    source: DataSource,
    out: Path | None = None,
    *,
    device: str | None = None,
    argv: list[str] | None = None,
    callbacks: Sequence = (),
):
    """Check inputs, load data, create the run directory, train, and return (run_dir, TrainResult).

    Everything that can be wrong with the input is found before the run directory is created, so a
    bad input leaves nothing behind.
    """
    from headsearch.training.rundir import check_run_dir, create_run_dir, default_run_dir
    from headsearch.training.trainer import fit, resolve_device

    task = get_task(cfg.task)
    task.check_source(source)
    run_dir = Path(out) if out is not None else default_run_dir(task.name)
    check_run_dir(run_dir)
    dev = resolve_device(device)
    bound = task.setup(cfg, source, dev)
    create_run_dir(run_dir, cfg.to_yaml(), argv)
    bound.write_artifacts(run_dir)
    return run_dir, fit(task, cfg, bound, device=dev, run_dir=run_dir, callbacks=callbacks)
