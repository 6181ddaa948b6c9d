"""Training: `train_run` is the library entry point behind `headsearch train`; `train_bound` trains
on already-loaded data (each search trial); `preflight` checks what can be checked before data loads.

The whole config is a parameter of `train_run`, `preflight` and `check_fits` (checks and binding the data
need any field) and the cohort's `add`/`refusal`/`cohort_key` (a run joins by its config); below them a run
reads its bound task's own copy (`bound.cfg`: `train_bound`, `trainer.fit`, `clock.measure_alone`), so one
trial has one config, and the step machinery (`prepare.prepare_steps`) gets the training section only."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Sequence

from headsearch.config import RunConfig
from headsearch.tasks import DataSource, Task, get_task


def preflight(task: Task, cfg: RunConfig, source: DataSource) -> None:
    """Every check of a run that needs neither its data nor a directory: the data source, the task's
    own config checks, and the fast path's (CUDA graphs need a static-shape task)."""
    from headsearch.training.fastpath import check_compile

    task.check_source(source)
    task.check_config(cfg)
    check_compile(cfg.train, task)


def check_device(device: str | None) -> None:
    """A device string that names no device here is bad input (one line), found before anything is made."""
    from headsearch.training.runtime import resolve_device

    resolve_device(device)


def device_memory(device) -> int | None:
    """Bytes of memory the device has in all: a GPU's own memory, the machine's RAM for the CPU (None: unknown)."""
    import os

    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def check_fits(task: Task, cfg: RunConfig, device) -> None:
    """The size guard: a config whose estimated training memory (headsearch.models.size, a lower bound)
    exceeds the device's whole memory cannot run; say so with the estimate before anything is allocated."""
    from headsearch.errors import ConfigError
    from headsearch.models.size import gib

    if task.footprint is None:
        return
    need, have = task.footprint(cfg), device_memory(device)
    if have is not None and need.training_bytes > have:
        raise ConfigError(f"this architecture needs {need.describe()} but {device} has {gib(have)}:"
                          " lower d_model, d_ff, the layer or head counts, or train.batch_size")


def train_run(
    cfg: RunConfig,
    source: DataSource,
    out: Path | None = None,
    *,
    device: str | None = None,
    argv: list[str] | None = None,
    callbacks: Sequence = (),
    clock=None,
    tensorboard: Path | str | None = None,
):
    """Check inputs, load data, create the run directory, train, and return (run_dir, TrainResult).
    `clock`: a `clock.AloneClock`, to measure the architecture's epoch seconds with the device to itself.
    `tensorboard`: a folder for the run's per-epoch TensorBoard records (`training.tensorboard`, an extra).

    Everything that can be wrong with the input is found before the run directory is created, so a
    bad input leaves nothing behind.
    """
    from headsearch.training.rundir import check_run_dir, default_run_dir
    from headsearch.training.runtime import resolve_device
    from headsearch.training.tensorboard import TensorBoardWriter, check_tensorboard

    task = get_task(cfg.task)
    if tensorboard is not None:
        check_tensorboard(tensorboard)
    preflight(task, cfg, source)
    dev = resolve_device(device)
    check_fits(task, cfg, dev)
    run_dir = Path(out) if out is not None else default_run_dir(task.name)
    check_run_dir(run_dir)
    bound = task.setup(cfg, source, dev)
    if tensorboard is None:
        return run_dir, train_bound(bound, run_dir, device=dev, argv=argv, callbacks=callbacks, clock=clock)
    with contextlib.closing(TensorBoardWriter(tensorboard, hparams=cfg.arch.to_dict())) as writer:
        return run_dir, train_bound(bound, run_dir, device=dev, argv=argv, callbacks=[writer, *callbacks],
                                    clock=clock)


def train_bound(bound, run_dir: Path, *, device, argv: list[str] | None = None, callbacks: Sequence = (), clock=None,
                resume: bool = False):
    """Create `run_dir` (the bound task's config, command, versions, task artifacts) and train `bound` in it
    (`clock`: a search's `clock.AloneClock`, for the fair time). The config is `bound.cfg`: the one the data
    was bound under, so the run directory records what actually trained. `resume`: go on from the run paused
    in `run_dir` (`headsearch.training.pause`); its command.txt and env.json are then the resuming one's."""
    from headsearch.training.rundir import create_run_dir
    from headsearch.training.trainer import fit

    create_run_dir(run_dir, bound.cfg.to_yaml(), argv)
    bound.write_artifacts(run_dir)
    return fit(get_task(bound.cfg.task), bound, device=device, run_dir=run_dir, callbacks=callbacks, clock=clock,
               resume=resume)
