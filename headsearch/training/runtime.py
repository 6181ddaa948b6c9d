"""What every run needs before its first step, whoever trains it (the trainer, a cohort, the fair clock,
bench): the device, checked to exist; the seeds; the number of steps in an epoch."""
from __future__ import annotations

import random

import numpy as np
import torch

from headsearch.config import TrainConfig
from headsearch.errors import ConfigError
from headsearch.tasks import BoundTask


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def resolve_device(device: str | None = None) -> torch.device:
    """"auto" (CUDA when there is a GPU, else the CPU) or a torch device string, checked to exist here."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"--device {device!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {device}: this machine has no CUDA GPU (or torch has no CUDA): use cpu or auto")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"--device {device}: only {count} CUDA device(s) are visible (cuda:0 .. cuda:{count - 1})")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {device}: this machine has no Apple GPU (MPS): use cpu or auto")
    elif dev.type not in ("cpu", "mps"):
        raise ConfigError(f"--device {device!r}: headsearch trains on cpu or cuda (or mps): use one of those, or auto")
    return dev


def use_device(device: torch.device) -> None:
    """Make `device` CUDA's current device: kernels, streams, events and graphs that name no device go to
    the current one, so `--device cuda:1` would otherwise capture and time on cuda:0."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def steps_per_epoch(bound: BoundTask, t: TrainConfig) -> int:
    n = bound.batches_per_epoch()
    return min(n, t.max_steps_per_epoch) if t.max_steps_per_epoch else n
