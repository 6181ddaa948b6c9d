"""How a search uses this machine, decided once when it starts and said in one line.

Three sources, in order:

1. **The user's flags**: `--workers N`, `--trials-per-gpu K`, `--cohort K` set the count (and `--compile`
   the step mode).
2. **A measurement of this machine** (`headsearch bench`, headsearch/machine/bench.py): the fastest way
   it verified for this device model, torch version, task and base architecture
   (headsearch/machine/measured.py). The plan line ends `(measured by headsearch bench on DATE)`.
3. **The rule**, when nothing was measured here; the plan line ends `(rule: headsearch bench measures
   this machine)`. On a GPU it is the way measured fastest on a GPU so far: K processes per GPU, each
   step compiled and captured in a CUDA graph (`train.compile: auto`, headsearch/training/fastpath.py),
   with NVIDIA MPS so that their kernels run side by side (headsearch/machine/mps.py). On a CPU: one
   worker, eager steps.

Cohorts (K trials stacked into one model, headsearch/training/cohort.py) are a default only where
`headsearch bench` measured them faster on this machine: on a GPU they have never been measured against
K processes with CUDA graphs, and an eager cohort step launches at least as many kernels as a solo step.

The rule for the count (`trials_per_gpu_for`): a step that does little arithmetic leaves the GPU idle
between its kernels, so more of them can share it. K = FILL_FLOPS_PER_SM x the GPU's multiprocessors /
the FLOPs of one training step (headsearch/models/size.py), rounded, then capped by memory (K models
training must fit in 80% of the GPU's memory), by the CPU cores (each worker drives its GPU from one
host thread) and by MAX_PER_GPU. FILL_FLOPS_PER_SM comes from the one measurement there is (issue
12's table, one H100, 132 multiprocessors): concurrent processes of the seed ViT (13.8 GFLOP a step at
batch 256) gained up to K = 8 with MPS (aggregate 37,000 samples/s at K = 1, 156,000 at 4, 175,000 at
8). For translation, whose step cost depends on its sentences, the FLOPs are those of an average step on
the data (each training pair at its CUDA bucket's length, `Task.data_footprint`), not of `max_len`-token
sentences: the data is loaded on the CPU for it (once, shared with the search's data check).

Worker processes are pinned to GPUs here too (`worker_devices`): worker i gets the visible GPU
i mod #GPUs, named as CUDA_VISIBLE_DEVICES names it.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from headsearch.errors import ConfigError
from headsearch.machine.fairtime import Seat
from headsearch.machine.measured import COHORT, Measurement, WayResult, bench_key, cpu_name, key_inputs, load_measurement
from headsearch.machine.mps import shares_a_gpu

# GFLOP of concurrent training steps one multiprocessor absorbs before the GPU is busy: 8 seed-ViT
# steps (13.76 GFLOP each at batch 256) over an H100's 132 multiprocessors.
FILL_FLOPS_PER_SM = 8 * 13.76e9 / 132
MAX_PER_GPU = 16
MEMORY_FRACTION = 0.8  # of the GPU's memory that K training models may take, by the size guard's estimate
RULE = "rule: headsearch bench measures this machine"


def process_count(s: Any, n_gpus: int) -> int:
    """Worker processes on this machine for settings `s`: --workers, or --trials-per-gpu times the GPUs (or one)."""
    if s.trials_per_gpu is not None:
        return s.trials_per_gpu * max(1, n_gpus)
    return s.workers or 1


def visible_gpus() -> list[str]:
    """The GPUs this process may use, named as CUDA_VISIBLE_DEVICES names them (an index, a UUID or a MIG ID)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        try:
            import torch

            return [str(i) for i in range(torch.cuda.device_count())]
        except Exception:
            return []
    # CUDA ignores an invalid ID and all after it ("-1" hides every GPU)
    names = itertools.takewhile(lambda name: not name.startswith("-"), (v.strip() for v in listed.split(",")))
    return [name for name in names if name]


def worker_devices(n_workers: int, visible: Sequence[str]) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each of `n_workers` processes: round-robin over the `visible` GPU names
    (worker i gets visible[i % len(visible)]), so K x len(visible) workers put K on each GPU and the first
    len(visible) workers start on different GPUs. No GPUs: None for every worker (they share the CPU)."""
    if not visible:
        return [None] * n_workers
    return [visible[i % len(visible)] for i in range(n_workers)]


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
class PlanInputs:
    """What the plan (and `headsearch bench`) read of a search, built by the search (`Search.plan_inputs`): its
    settings (device, workers, trials_per_gpu, cohort, compile, trials), task, base config, whether that base can
    stack its trials into cohorts, its data source, and `step_footprint()`, the base config's training footprint
    (headsearch.models.size), computed only when asked: it may load the data."""

    settings: Any  # the SearchSettings
    task: Any
    base: Any  # the RunConfig every trial starts from
    stacks: bool
    source: Any  # the DataSource
    step_footprint: Callable[[], Any]


@dataclass(frozen=True)
class Plan:
    """The worker processes of a search on this machine and how their trials run."""

    devices: tuple[str | None, ...]  # CUDA_VISIBLE_DEVICES of each worker process (None: the CPU)
    per_gpu: int | None  # concurrent trials on each GPU; None without GPUs
    why: str  # how the count was chosen
    step_mode: str  # what the trials' train.compile means on their device
    mps: bool  # several workers share a GPU: NVIDIA MPS is worth starting
    cohort: int = 1  # trials each worker trains together as one stacked model (1: one at a time)
    basis: str | None = None  # "measured by headsearch bench on DATE", the rule (RULE), or None (the user's flags)
    compile: str | None = None  # the train.compile the trials use, when a measurement chose it (None: as configured)
    threads: int | None = None  # CPU threads per worker, when a measurement chose them (None: the cores shared)

    def describe(self, mps_status: Any = None) -> str:
        """One line, e.g. "8 trials per GPU on 1 GPU (auto: ...); steps: ...; MPS started: ... (rule: ...)"."""
        workers = len(self.devices)
        if self.per_gpu is None:
            where = f"{workers} worker{'s' * (workers > 1)} on the CPU"
        else:
            gpus = len(set(self.devices))
            where = f"{self.per_gpu} trial{'s' * (self.per_gpu > 1)} per GPU on {gpus} GPU{'s' * (gpus > 1)}"
        if self.cohort > 1:
            where = f"cohorts of {self.cohort} trials (one stacked model) in {where}" if self.per_gpu is None else \
                f"{where}, as a cohort of {self.cohort} in {workers} worker{'s' * (workers > 1)}"
        if self.threads is not None:
            where += f", {self.threads} thread{'s' * (self.threads > 1)} each"
        steps = "stacked, eager" if self.cohort > 1 else self.step_mode
        parts = [f"{where} ({self.why})", f"steps: {steps}"]
        if mps_status is not None:
            parts.append(mps_status.describe())
        return "; ".join(parts) + (f" ({self.basis})" if self.basis else "")


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


def machine_measurement(base: Any, visible: Sequence[str], gpu: "GpuInfo | None" = None) -> Measurement | None:
    """The saved `headsearch bench` measurement for the search's base config `base` on this machine (its first
    visible GPU, or its CPU), if any."""
    import torch

    device = (gpu or GpuInfo.of(0)).name if visible else cpu_name()
    return load_measurement(bench_key(key_inputs(device, torch.__version__, base)))


def share_cores(n_processes: int) -> int:
    """This process's share of the cores when `n_processes` run at once, also set as its Inductor compile
    threads (unless set already): processes share the cores instead of each starting one compile job per core."""
    share = max(1, (os.cpu_count() or 1) // n_processes)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(share))
    return share


def worker_seat(gpu: str | None, n_processes: int, threads: int | None, device: str | None) -> Seat:
    """A worker process's seat: pinned to `gpu` (before torch initialises CUDA) and given its share of the CPU's
    threads (`threads`, a measurement's, else the cores shared among `n_processes`), knowing the threads a process
    alone here uses (the fair time's measure). `device`: the search's --device, resolved once pinned."""
    if gpu is not None:
        # The parent's own name for the GPU (CUDA_VISIBLE_DEVICES "2,3" gives "2" and "3"), set before
        # torch initialises CUDA in this process, which then sees it as cuda:0.
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    import torch

    from headsearch.training.runtime import resolve_device

    alone_threads = torch.get_num_threads()  # before this worker's share is set
    share = share_cores(n_processes)
    if gpu is None:
        torch.set_num_threads(threads or share)
    return Seat(resolve_device(device), alone_threads)


def trial_bytes(footprint: Any, mode: Any) -> int:
    """The memory one trial's process takes when its steps run in `mode` (a `fastpath.StepMode`), from the size
    guard's `footprint` of its config (0: none): with CUDA graphs in private pools (the default), each captured
    batch shape keeps its own activations."""
    from headsearch.training.capture import shared_graph_pool

    if footprint is None:
        return 0
    graphs = mode.cuda_graph and not shared_graph_pool()
    return footprint.captured_training_bytes if graphs else footprint.training_bytes


def plan_search(inputs: PlanInputs, visible: list[str] | None = None, gpu: GpuInfo | None = None,
                cpu_cores: int | None = None, measurement: Measurement | None | bool = True) -> Plan:
    """The plan of the search `inputs` describe on this machine: the user's flags, else
    the saved measurement of this machine (`measurement`: True reads it from the cache; tests pass one,
    or None for none), else the rule. `visible`, `gpu` and `cpu_cores` default to what the machine has."""
    import torch

    from headsearch.training.fastpath import resolve_mode

    s = inputs.settings
    if visible is None:
        visible = [] if s.device == "cpu" else visible_gpus()
    device = torch.device("cuda" if visible else "cpu")
    mode = resolve_mode(inputs.base.train, inputs.task, device)  # once: the plan line's, the memory rule's
    step_mode = mode.describe()
    flag = "--workers" if s.workers else "--trials-per-gpu" if s.trials_per_gpu else None
    cohort = s.cohort if s.cohort is not None and s.cohort > 1 else 1  # --cohort K: K together in each worker
    if cohort > 1 and not inputs.stacks:
        why = (inputs.task.stack_refusal(inputs.base) if inputs.task.stack_refusal else
               f"task {inputs.task.name} trains its trials one at a time")
        raise ConfigError(f"--cohort {s.cohort}: {why}; leave --cohort out (or give 1)")
    if flag or cohort > 1:  # the user's count (a cohort without one: one worker per GPU)
        devices = worker_devices(process_count(s, len(visible)) if flag else max(1, len(visible)), visible)
        return Plan(tuple(devices), cohort * math.ceil(len(devices) / len(visible)) if visible else None,
                    "--cohort" if cohort > 1 else flag, step_mode, mps=shares_a_gpu(devices), cohort=cohort)
    if measurement is True:
        measurement = machine_measurement(inputs.base, visible, gpu)
    choice = measurement.choice(cohorts=inputs.stacks and s.cohort is None) if measurement else None
    if choice is not None:
        return measured_plan(inputs, measurement, choice, visible, device, mode)
    if not visible:
        return Plan((None,), None, "default: one worker", step_mode, mps=False, basis=RULE)
    # The rule: K processes per GPU with the fast path (CUDA graphs) and MPS: what was measured fastest on a GPU.
    footprint = inputs.step_footprint()
    per_gpu, why = trials_per_gpu_for(footprint.step_flops if footprint else None, trial_bytes(footprint, mode),
                                      gpu or GpuInfo.of(0), cpu_cores or os.cpu_count() or 1,
                                      math.ceil(s.trials / len(visible)))
    devices = worker_devices(per_gpu * len(visible), visible)
    return Plan(tuple(devices), per_gpu, why, step_mode, mps=shares_a_gpu(devices), basis=RULE)


def measured_plan(inputs: PlanInputs, m: Measurement, choice: WayResult, visible: Sequence[str], device: Any,
                  mode: Any) -> Plan:
    """The plan that runs `choice`, the fastest way `headsearch bench` verified here, capped by the budget.
    `mode`: the base config's step mode on `device`, resolved again only when the way's compile replaces it."""
    from headsearch.training.fastpath import resolve_mode

    way = choice.way
    why = f"{way.describe()}: {choice.samples_per_s:,.0f} samples/s"
    basis = f"measured by headsearch bench on {m.date}"
    if way.kind == COHORT:
        devices = tuple(visible) if visible else (None,)
        return Plan(devices, way.k if visible else None, why, "stacked, eager", mps=False, cohort=way.k, basis=basis,
                    threads=way.threads)
    per_device = max(1, min(way.k, math.ceil(inputs.settings.trials / max(1, len(visible)))))
    compile_mode = way.step_mode if inputs.settings.compile is None else None
    if compile_mode is not None:
        mode = resolve_mode(dataclasses.replace(inputs.base.train, compile=compile_mode), inputs.task, device)
    devices = worker_devices(per_device * max(1, len(visible)), visible)  # without GPUs: per_device on the CPU
    return Plan(tuple(devices), per_device if visible else None, why, mode.describe(),
                mps=way.mps and shares_a_gpu(devices), basis=basis, compile=compile_mode,
                threads=None if visible else way.threads)
