"""How a search uses this machine, decided once when it starts and said in one line.

On a GPU machine the defaults are the fast path: each trial's step compiled and captured in a CUDA
graph (`train.compile: auto`, headsearch/training/fastpath.py), several trials per GPU when one trial
cannot fill it (a 0.1 M-parameter ViT keeps an H100 about a third busy), and NVIDIA MPS so that those
trials' kernels run side by side (started and stopped by headsearch, headsearch/search/mps.py).
`--trials-per-gpu K` or `--workers N` override the count. On a machine without a GPU nothing
changes: one worker unless told otherwise, eager steps.

Cohorts (headsearch/training/cohort.py): where the task stacks its models (the ViT), the K trials a GPU
takes train as one stacked model in one worker per GPU instead of K processes: every kernel gets K
times the work for the same launches. That is the default on CUDA when the base config stacks and no
process count was given; `--cohort K` asks for cohorts of K anywhere (the CPU included), `--cohort 1`
turns them off.

The rule for the count (`trials_per_gpu_for`): a step that does little arithmetic leaves the GPU idle
between its kernels, so more of them can share it. K = FILL_FLOPS_PER_SM x the GPU's multiprocessors /
the FLOPs of one training step (headsearch/models/size.py), rounded, then capped by memory (K models
training must fit in 80% of the GPU's memory), by the CPU cores (each worker drives its GPU from one
host thread) and by MAX_PER_GPU. FILL_FLOPS_PER_SM comes from the one measurement there is (issue
12's table, one H100, 132 multiprocessors): concurrent processes of the seed ViT (13.8 GFLOP a step at
batch 256) gained up to K = 8 with MPS (aggregate 37,000 samples/s at K = 1, 156,000 at 4, 175,000 at
8). benchmarks/search_throughput.py measures it again; README's Speed section says where it stands.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from headsearch.errors import ConfigError

# GFLOP of concurrent training steps one multiprocessor absorbs before the GPU is busy: 8 seed-ViT
# steps (13.76 GFLOP each at batch 256) over an H100's 132 multiprocessors.
FILL_FLOPS_PER_SM = 8 * 13.76e9 / 132
MAX_PER_GPU = 16
MEMORY_FRACTION = 0.8  # of the GPU's memory that K training models may take, by the size guard's estimate


@dataclass(frozen=True)
class GpuInfo:
    """What the rule reads of a GPU."""

    name: str
    multiprocessors: int
    memory_bytes: int

    @classmethod
    def of(cls, index: int = 0) -> "GpuInfo":
        import torch

        props = torch.cuda.get_device_properties(index)
        return cls(props.name, props.multi_processor_count, props.total_memory)


@dataclass(frozen=True)
class Plan:
    """The worker processes of a search on this machine and how their trials run."""

    devices: tuple[str | None, ...]  # CUDA_VISIBLE_DEVICES of each worker process (None: the CPU)
    per_gpu: int | None  # concurrent trials on each GPU; None without GPUs
    why: str  # how the count was chosen
    step_mode: str  # what the trials' train.compile means on their device
    mps: bool  # several workers share a GPU: NVIDIA MPS is worth starting
    cohort: int = 1  # trials each worker trains together as one stacked model (1: one at a time)

    def describe(self, mps_status: Any = None) -> str:
        """One line, e.g. "8 trials per GPU on 1 GPU (auto: ...); steps: compiled blocks + CUDA graphs; MPS on"."""
        workers = len(self.devices)
        if self.per_gpu is None:
            where = f"{workers} worker{'s' * (workers > 1)} on the CPU"
        else:
            gpus = len(set(self.devices))
            where = f"{self.per_gpu} trial{'s' * (self.per_gpu > 1)} per GPU on {gpus} GPU{'s' * (gpus > 1)}"
        if self.cohort > 1:
            where = f"cohorts of {self.cohort} trials (one stacked model) in {where}" if self.per_gpu is None else \
                f"{where}, as a cohort of {self.cohort} in {workers} worker{'s' * (workers > 1)}"
        steps = "stacked, eager" if self.cohort > 1 else self.step_mode
        parts = [f"{where} ({self.why})", f"steps: {steps}"]
        if mps_status is not None:
            parts.append(mps_status.describe())
        return "; ".join(parts)


def trials_per_gpu_for(step_flops: int | None, training_bytes: int, gpu: GpuInfo, cpu_cores: int,
                       trials: int) -> tuple[int, str]:
    """Concurrent trials per GPU for a model whose training step costs `step_flops` and whose training
    takes `training_bytes` (the module docstring gives the rule). Returns (K, why)."""
    if not step_flops:
        return 1, "auto: no FLOPs estimate for this task"
    fill = FILL_FLOPS_PER_SM * gpu.multiprocessors
    by_work = max(1, round(fill / step_flops))
    by_memory = max(1, math.floor(MEMORY_FRACTION * gpu.memory_bytes / max(training_bytes, 1)))
    caps = {"work": by_work, "memory": by_memory, "CPU cores": max(1, cpu_cores), "the maximum": MAX_PER_GPU,
            "trials": max(1, trials)}
    k = min(caps.values())
    limit = min(caps, key=caps.get)
    why = f"auto: a step is {step_flops / 1e9:.3g} GFLOP, {by_work} fill a {gpu.name}"
    if limit != "work":
        why += f"; capped by {limit}"
    return k, why


def plan_search(search: Any, visible: list[str] | None = None, gpu: GpuInfo | None = None,
                cpu_cores: int | None = None) -> Plan:
    """The plan of `search` (a `headsearch.search.runner.Search`) on this machine. `visible`, `gpu` and
    `cpu_cores` default to what the machine has (tests pass their own)."""
    import torch

    from headsearch.search.workers import process_count, visible_gpus, worker_devices
    from headsearch.training.fastpath import resolve_mode

    s = search.settings
    if visible is None:
        visible = [] if s.device == "cpu" else visible_gpus()
    device = torch.device("cuda" if visible else "cpu")
    step_mode = resolve_mode(search.base.train, search.task, device).describe()
    flag = "--workers" if s.workers else "--trials-per-gpu" if s.trials_per_gpu else None
    stacks = search.task.stack_refusal is not None and search.task.stack_refusal(search.base) is None
    if s.cohort is not None and s.cohort > 1 and not stacks:
        why = (search.task.stack_refusal(search.base) if search.task.stack_refusal else
               f"task {search.task.name} trains its trials one at a time")
        raise ConfigError(f"--cohort {s.cohort}: {why}; leave --cohort out (or give 1)")
    if not visible:
        devices = tuple(worker_devices(process_count(s, 0), []))
        return Plan(devices, None, "--cohort" if s.cohort and s.cohort > 1 else flag or "default", step_mode, mps=False,
                    cohort=s.cohort or 1)
    if s.cohort is not None and s.cohort > 1:  # asked for: this many together in each worker (one per GPU by default)
        devices = worker_devices(process_count(s, len(visible)) if flag else len(visible), visible)
        return Plan(tuple(devices), s.cohort * math.ceil(len(devices) / len(visible)), "--cohort", step_mode,
                    mps=len(devices) > len(set(devices)), cohort=s.cohort)
    if flag:
        devices = worker_devices(process_count(s, len(visible)), visible)
        per_gpu, why = math.ceil(len(devices) / len(visible)), flag
    else:
        footprint = search.task.footprint(search.base) if search.task.footprint else None
        per_gpu, why = trials_per_gpu_for(footprint.step_flops if footprint else None,
                                          footprint.training_bytes if footprint else 0,
                                          gpu or GpuInfo.of(0),
                                          # a cohort is one process: the cores cap only processes
                                          MAX_PER_GPU if stacks and s.cohort is None else cpu_cores or os.cpu_count() or 1,
                                          math.ceil(s.trials / len(visible)))
        if stacks and s.cohort is None and per_gpu > 1:  # the default on CUDA: one worker per GPU, a cohort of K
            return Plan(tuple(visible), per_gpu, why, step_mode, mps=False, cohort=per_gpu)
        devices = worker_devices(per_gpu * len(visible), visible)
    return Plan(tuple(devices), per_gpu, why, step_mode, mps=len(devices) > len(set(devices)))
