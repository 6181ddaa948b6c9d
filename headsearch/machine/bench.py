"""`headsearch bench`: measure, on this machine, the ways a search can run its trials, instead of guessing.

A search's speed depends on how its trials share the device: one process or K, each step eager or
compiled and captured in a CUDA graph, NVIDIA MPS or not, K trials stacked into one model (a cohort)
or not; on a CPU, how many workers and how many threads each. Which is fastest depends on the device,
torch and the model, so it is measured, for the search's base architecture, and saved for `headsearch
run` to plan from (headsearch/machine/measured.py, headsearch/machine/plan.py).

Every way is verified before it is timed, and a way that fails or mismatches is reported with its
one-line reason and never chosen:
- a step mode must run as asked: a captured step is checked against the same step uncaptured before
  training (`headsearch.training.steps.verify_step`), and a capture or compile that fails or mismatches
  falls back, which counts as failed here;
- a cohort slot must compute what the same trial computes alone: the losses of its first
  VERIFY_STEPS steps against a solo run's (relative COHORT_RTOL, COHORT_RTOL_AMP under bf16 autocast,
  where the stacked and the solo matrix products add in another order).

Each way runs in processes of its own (spawned, like search workers: the parent never touches CUDA, so
an MPS daemon started for a way serves every one of its processes), with the data loaded in each,
SETTLE_STEPS untimed steps after the warm-up, then `seconds` of steps timed with the device
synchronised at both ends; K processes start timing together (a barrier). Reported per way: samples
per second in aggregate (all trials' samples over the wall time from the first start to the last end)
and per trial, verified or not, and the warm-up seconds (compiling, capturing) of one trial.

The ways: on a GPU, one process in each step mode (off, graphs, reduce-overhead); K processes in the
fastest verified mode for K in `ks`, without and (where the control binary exists) with MPS; cohorts of
K where the task stacks. On a CPU: W workers x T threads (T = cores / W) for W in 1, 2, 4, ... up to the
cores, and cohorts of K in one worker with every thread.
"""
from __future__ import annotations

import datetime
import itertools
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from headsearch.machine.measured import (
    COHORT, PROCESSES, Measurement, Way, WayResult, bench_key, cpu_name, key_inputs, save_measurement,
)
from headsearch.machine.plan import (
    MAX_PER_GPU, MEMORY_FRACTION, GpuInfo, PlanInputs, trial_bytes, visible_gpus, worker_seat,
)
from headsearch.tasks import apply_overrides, get_task

GPU_MODES = ("off", "graphs", "reduce-overhead")
GPU_KS = (2, 4, 8)
CPU_COHORTS = (2, 4)
SETTLE_STEPS = 3
VERIFY_STEPS = 3
COHORT_RTOL, COHORT_RTOL_AMP = 1e-4, 2e-2
START_TIMEOUT = 600.0  # seconds a process may take to load, compile and capture before the others give up on it


@dataclass(frozen=True)
class Job:
    """What one process of a way measures."""

    task: str
    cfg: Any  # the RunConfig, with train.compile set to the way's step mode
    source: Any  # the DataSource
    way: Way
    gpu: str | None
    seconds: float


def cpu_ways(cores: int, cohort_ks: Sequence[int]) -> list[Way]:
    """A CPU's ways: W workers x cores / W threads (W = 1, 2, 4, ... up to the cores), and cohorts of each of
    `cohort_ks` in one worker with every thread (none where the task does not stack)."""
    workers = [w for w in (2 ** i for i in range(8)) if w <= max(1, cores)]
    ways = [Way(PROCESSES, w, "off", threads=max(1, cores // w)) for w in workers]
    return ways + [Way(COHORT, k, "off", threads=max(1, cores)) for k in cohort_ks]


def gpu_ks(training_bytes: int, gpu: GpuInfo) -> list[int]:
    """The K to try on a GPU: GPU_KS within memory (K models in MEMORY_FRACTION of it) and MAX_PER_GPU. K
    processes are also capped by the cores (one host thread drives each: `bench`); a cohort is one process."""
    by_memory = math.floor(MEMORY_FRACTION * gpu.memory_bytes / max(training_bytes, 1))
    return [k for k in GPU_KS if k <= min(by_memory, MAX_PER_GPU)] or [1]


def bench(inputs: PlanInputs, *, seconds: float | None = None, ks: Sequence[int] | None = None,
          modes: Sequence[str] | None = None, cohorts: bool = True,
          report: Callable[[WayResult], None] | None = None, save: bool = True) -> Measurement:
    """Measure the ways the search `inputs` describe (its task, base config, data and device) can run its trials
    on this machine; save the measurement in headsearch's cache unless `save` is False, after each way, so that
    a bench stopped part-way keeps what it measured. `report(result)` hears each way as it is measured.

    Narrowing (a GPU's full bench is twelve ways of K processes that each compile, capture and verify:
    8-15 minutes): `ks`, the K tried (default: GPU_KS within memory, CPU_COHORTS on a CPU); `modes`, the step
    modes tried by one process on a GPU (default GPU_MODES; K processes run the fastest of them); `cohorts`
    False measures no cohort."""
    import torch

    from headsearch.machine.mps import managed_mps, mps_available
    from headsearch.training.fastpath import resolve_mode

    started = time.perf_counter()
    visible = [] if inputs.settings.device == "cpu" else visible_gpus()
    on_gpu = bool(visible)
    seconds = seconds or (10.0 if on_gpu else 6.0)
    cores = os.cpu_count() or 1
    gpu = GpuInfo.of(0) if on_gpu else None
    if ks is None and on_gpu:
        mode = resolve_mode(inputs.base.train, inputs.task, torch.device("cuda"))
        ks = gpu_ks(trial_bytes(inputs.step_footprint(), mode), gpu)
    ks = CPU_COHORTS if ks is None else ks
    modes = tuple(modes or GPU_MODES)
    unknown = [m for m in modes if m not in GPU_MODES]
    if unknown:
        raise ValueError(f"unknown step modes {unknown}: use {', '.join(GPU_MODES)}")
    has_mps = on_gpu and mps_available()
    stacks = cohorts and inputs.stacks
    results: list[WayResult] = []
    device = gpu.name if on_gpu else cpu_name()
    what = key_inputs(device, torch.__version__, inputs.base)

    def measurement() -> Measurement:
        return Measurement(bench_key(what), datetime.date.today().isoformat(), device, torch.__version__,
                           inputs.task.name, tuple(results), round(time.perf_counter() - started, 1), what)

    def measure(way: Way) -> WayResult:
        cfg = with_compile(inputs.task, inputs.base, way.step_mode)
        jobs = [Job(inputs.task.name, cfg, inputs.source, way, visible[0] if on_gpu else None, seconds)] * (
            1 if way.kind == COHORT else way.k)
        with managed_mps(way.mps) as mps:
            if way.mps and not mps.active:
                result = WayResult(way, False, f"MPS is not usable: {mps.reason}")
            else:
                result = run_way(jobs)
        results.append(result)
        if save:
            save_measurement(measurement())  # after each way: a bench stopped part-way keeps what it measured
        if report is not None:
            report(result)
        return result

    if not on_gpu:
        for way in cpu_ways(cores, ks if stacks else ()):
            measure(way)
    else:
        # One process in each step mode first: K processes then run the fastest mode verified.
        alone = [r for r in map(measure, (Way(PROCESSES, 1, mode) for mode in modes)) if r.verified]
        best = max(alone, key=lambda r: r.samples_per_s).way.step_mode if alone else "off"
        for k in (k for k in ks if 1 < k <= cores):
            for mps in (False, True) if has_mps else (False,):
                measure(Way(PROCESSES, k, best, mps=mps))
        for k in ks if stacks else ():
            measure(Way(COHORT, k, "off"))
    m = measurement()
    if save:
        save_measurement(m)
    return m


def with_compile(task: Any, cfg: Any, mode: str) -> Any:
    """`cfg` with its steps in `mode` (train.compile)."""
    return apply_overrides(task, cfg, {"train": {"compile": mode}})


# -- running a way: its processes ----------------------------------------------------------------------------


def run_way(jobs: Sequence[Job]) -> WayResult:
    """Run the processes of one way (one per job, timing together) and combine what they measured."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(len(jobs)), ctx.Queue()
    procs = [ctx.Process(target=_job_main, args=(job, barrier, queue), name=f"headsearch-bench-{i}")
             for i, job in enumerate(jobs)]
    for p in procs:
        p.start()
    figures = []
    try:
        for _ in procs:
            figures.append(queue.get(timeout=START_TIMEOUT + 4 * jobs[0].seconds + 120))
    except Exception:
        figures.append({"error": "a process gave no result in time (killed, or stuck)"})
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return combine(jobs[0].way, figures)


def combine(way: Way, figures: Sequence[dict]) -> WayResult:
    """One way's result from its processes' figures: failed if any failed or mismatched, with the reason of
    the process that did (not of the others it left waiting at the barrier, whose reason is `secondary`)."""
    failed = [f for f in figures if f.get("error") or f.get("mismatch")]
    if failed:
        first = min(failed, key=lambda f: bool(f.get("secondary")))
        return WayResult(way, False, first.get("error") or first["mismatch"])
    start, end = min(f["start"] for f in figures), max(f["end"] for f in figures)
    total = sum(f["samples"] for f in figures)
    per_trial = sum(f["samples"] / f["trials"] / (f["end"] - f["start"]) for f in figures) / len(figures)
    return WayResult(way, True, None, round(total / (end - start), 1), round(per_trial, 1),
                     round(max(f["compile_seconds"] for f in figures), 2))


def _job_main(job: Job, barrier, queue) -> None:
    """A bench process, seated as a search's worker is (`worker_seat`: pinned, K compiling at once, the way's threads);
    never raises (its one-line reason goes back instead) and never leaves the others waiting at the barrier."""
    try:
        seat = worker_seat(job.gpu, 1 if job.way.kind == COHORT else job.way.k, job.way.threads,
                           "cpu" if job.gpu is None else "cuda")
        figures = (measure_cohort if job.way.kind == COHORT else measure_process)(job, barrier, seat.device)
    except threading.BrokenBarrierError:  # another process of the way failed: its reason is the way's
        figures = {"error": "another process of this way failed before timing began", "secondary": True}
    except BaseException as e:  # noqa: BLE001 - reported as the way's reason
        barrier.abort()
        text = " ".join(str(e).split())[:200]
        figures = {"error": f"{type(e).__name__}: {text}" if text else type(e).__name__}
    queue.put(figures)


def measure_process(job: Job, barrier, device) -> dict:
    """One trial's steps in the job's step mode on `device`: warmed up (compiled, captured and verified), then timed."""
    from headsearch.training.prepare import prepare_steps
    from headsearch.training.runtime import seed_everything, steps_per_epoch

    task, cfg = get_task(job.task), job.cfg
    bound = task.setup(cfg, job.source, device)
    seed_everything(cfg.seed)
    model = bound.build_model().to(device)
    steps, compile_seconds, note = prepare_steps(task, cfg.train, bound, model, device, steps_per_epoch(bound, cfg.train))
    if steps.mode.name != job.way.step_mode:  # it fell back: the mode asked for failed or mismatched
        barrier.abort()
        return {"mismatch": note or f"ran as {steps.mode.name}"}
    batches = itertools.chain.from_iterable(bound.train_batches(epoch) for epoch in itertools.count(1))  # endless
    figures = _timed(lambda: steps.step(next(batches)), device, job.seconds, barrier)
    return {**figures, "trials": 1, "compile_seconds": compile_seconds}


def measure_cohort(job: Job, barrier, device) -> dict:
    """A cohort of K on `device`: slot 0 first checked against the same trial alone (VERIFY_STEPS steps), then timed."""
    from headsearch.models.cohort import soft_width
    from headsearch.models.variants import fusion_of
    from headsearch.training.cohort import Cohort
    from headsearch.training.runtime import steps_per_epoch

    task, cfg, k = get_task(job.task), job.cfg, job.way.k
    bound = task.setup(cfg, job.source, device)
    soft = soft_width(cfg.arch, min(cfg.arch.enc_heads)) if fusion_of(cfg.arch.fusion).soft is not None else None
    cohort = Cohort(task, k, device, soft_columns=soft, keep_step_losses=True)
    started = time.perf_counter()
    for i in range(k):
        slot_cfg = cfg.replace(seed=cfg.seed + i)  # each slot its own trial: own weights, data order, draws
        cohort.add(slot_cfg, bound.rebind(slot_cfg))
    cohort.train_steps(VERIFY_STEPS)
    stacked = [float(step[0]) for step in cohort.step_losses]
    solo = solo_losses(task, cfg, bound, device, VERIFY_STEPS)
    rtol = COHORT_RTOL_AMP if cfg.train.amp and device.type == "cuda" else COHORT_RTOL
    if any(not math.isclose(a, b, rel_tol=rtol) for a, b in zip(stacked, solo)):
        barrier.abort()
        return {"mismatch": f"a cohort slot's losses {_fmt(stacked)} differ from the same trial alone {_fmt(solo)}"}
    cohort.step_losses = None
    compile_seconds = time.perf_counter() - started
    slot = cohort.slots[cohort.occupied[0]]
    spe = min(steps_per_epoch(slot.bound, slot.cfg.train), 8)
    figures = _timed(lambda: cohort.train_steps(spe)[2] * k, device, job.seconds, barrier)  # samples of all k slots
    return {**figures, "trials": k, "compile_seconds": round(compile_seconds, 2)}


def solo_losses(task: Any, cfg: Any, bound: Any, device: Any, n: int) -> list[float]:
    """The first `n` step losses of `cfg` trained alone (eager), from the initial weights, data order and
    learning-rate schedule a cohort slot gets in `Cohort.train_steps(n)` (epochs of n steps)."""
    from headsearch.training.prepare import prepare_steps
    from headsearch.training.runtime import seed_everything

    solo_cfg = with_compile(task, cfg, "off")
    scratch = bound.rebind(solo_cfg)
    seed_everything(cfg.seed)
    model = bound.build_model().to(device)
    # The schedule of an n-step epoch, as the cohort's `train_steps(n)` used for its slots.
    steps, _, _ = prepare_steps(task, solo_cfg.train, scratch, model, device, n)
    losses = []
    for batch in itertools.islice(scratch.train_batches(1), n):
        steps.step(batch)
        losses.append(float(steps.state.last_loss))
    return losses


def _fmt(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.5g}" for v in values) + "]"


def _timed(step: Callable[[], int], device: Any, seconds: float, barrier) -> dict:
    """SETTLE_STEPS untimed calls, then (after every process of the way is ready) calls for `seconds`: the figures
    samples, start and end, on the system-wide monotonic clock, the device synchronised at both ends."""
    from headsearch.training.steps import synchronize

    for _ in range(SETTLE_STEPS):
        step()
    synchronize(device)
    barrier.wait(timeout=START_TIMEOUT)
    start = time.monotonic()
    samples = 0
    while time.monotonic() - start < seconds:
        samples += step()
    synchronize(device)
    return {"samples": samples, "start": start, "end": time.monotonic()}
