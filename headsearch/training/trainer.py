"""One training loop for every task.

After each epoch it evaluates on the validation split and hands an `EpochRecord` to the callbacks
(a search prunes by raising from `on_epoch_end`). It records the convergence figures a search
optimises: epoch and seconds of the best validation metric, seconds to reach a target, throughput,
parameter count. The best checkpoint is kept (atomically) in the run directory as it improves, and
the final test figure is measured on it.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from headsearch.config import RunConfig, TrainConfig
from headsearch.errors import ConfigError, Diverged
from headsearch.io import append_line, write_atomic
from headsearch.tasks import BoundTask, Task
from headsearch.training.fastpath import StepMode, check_compile, compile_blocks, resolve_mode
from headsearch.training.rundir import save_checkpoint
from headsearch.training.steps import (  # noqa: F401  (autocast_context, lr_multiplier, make_optimizer: re-exported)
    Steps, autocast_context, lr_multiplier, make_optimizer, make_steps, synchronize,
)

CHECKPOINT = "model.safetensors"
LOG_SECONDS = 0.5  # at most this often a step callback hears of progress (each report reads the device)


@dataclass
class StepInfo:
    epoch: int
    epochs: int
    epoch_step: int
    steps_per_epoch: int
    step: int
    loss: float
    lr: float
    samples_per_s: float


@dataclass
class EpochRecord:
    epoch: int
    step: int
    train_loss: float
    lr: float
    train_seconds: float  # cumulative optimisation time, evaluation excluded
    wall_seconds: float  # cumulative time since training started, evaluation included
    samples_per_s: float  # this epoch's training throughput
    metrics: dict[str, float]  # validation metrics
    diversity: dict[str, float] = field(default_factory=dict)  # mean over layers of each diversity scalar (when tracked)
    epoch_seconds_alone: float | None = None  # the run's epoch seconds with the device to itself (AloneClock), if known


@dataclass
class TrainResult:
    status: str  # "completed", "interrupted", "diverged", "stopped" (by a callback) or "failed"
    primary_metric: str
    params: int
    epochs_run: int = 0
    steps: int = 0
    best_epoch: int | None = None
    best_value: float | None = None
    best_train_seconds: float | None = None  # raw: as measured, whatever else shared the device
    best_wall_seconds: float | None = None
    epoch_seconds_alone: float | None = None  # one epoch's training seconds with the device to itself (AloneClock)
    best_seconds_alone: float | None = None  # best_epoch x epoch_seconds_alone: the search's `time`
    target: float | None = None
    seconds_to_target: float | None = None  # training seconds when the validation metric first reached target
    train_seconds: float = 0.0
    wall_seconds: float = 0.0
    compile_seconds: float = 0.0  # warm-up before training (compiling, capturing graphs); outside every other timing
    step_mode: str = ""  # how steps ran (headsearch.training.fastpath.StepMode.describe)
    step_note: str | None = None  # why a faster mode was given up, if one was
    uncaptured_steps: int = 0  # steps of a batch shape no warm-up showed (run outside the CUDA graphs)
    samples: int = 0  # training samples processed
    samples_per_s: float = 0.0  # samples / train_seconds
    best_metrics: dict[str, float] = field(default_factory=dict)
    best_diversity: dict[str, float] = field(default_factory=dict)  # at the best epoch, when tracked
    test_metrics: dict[str, float] = field(default_factory=dict)
    history: list[EpochRecord] = field(default_factory=list)
    error: str | None = None

    def to_dict(self, with_history: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_history:
            d.pop("history")
        return d


class Callback:
    """Hooks into training. Raising from `on_epoch_end` stops the run (a pruner raises TrialPruned).

    `on_evaluate` runs after each validation, before the epoch's record is kept and written: a
    callback may add measurements of the model to it (the diversity tracker of `headsearch.analysis`
    fills `record.diversity`), outside the training time.
    """

    def on_start(self, steps_per_epoch: int, epochs: int) -> None: ...
    def on_prepared(self, step_mode: str, warm_up_seconds: float, note: str | None) -> None: ...
    def on_step(self, info: StepInfo) -> None: ...
    def on_evaluate(self, model: torch.nn.Module, bound: BoundTask, record: EpochRecord) -> None: ...
    def on_epoch_end(self, record: EpochRecord) -> None: ...


@dataclass
class AloneClock:
    """How a run learns its architecture's speed with the device to itself: the search's fair `time`.

    Several trials may share a device; the seconds one of them measures then depend on the others.
    With a clock, every epoch runs inside `share.shared()` (training and evaluation, released with the
    device idle), except epoch 1, which runs inside `share.exclusive()`: the other workers of this
    device (which respect the same lock) wait at their next epoch boundary, and epoch 1's steps, timed
    one by one, give the architecture's `epoch_seconds_alone` (the median step x the epoch's batches,
    `alone_epoch_seconds`). Every hold covers a whole epoch (training, evaluation, checkpoint, callbacks),
    the warm-up and the final test too: on a CPU all of it competes for the cores. On a CPU the measured
    epoch uses `alone_threads` threads (what a process alone on the machine uses). When an earlier trial of the same
    architecture measured it, `known` is that value and epoch 1 runs shared like the others.
    `share` is a `headsearch.training.devicelock.DeviceShare` (or `NoShare` for a worker alone).
    """

    share: Any
    known: float | None = None
    alone_threads: int | None = None

    def hold(self, epoch: int, device: torch.device):
        """The context an epoch runs in, and whether it is the measured one."""
        if epoch == 1 and self.known is None:
            return _alone(self.share.exclusive(), device, self.alone_threads), True
        return self.share.shared(), False


@contextlib.contextmanager
def _alone(exclusive, device: torch.device, threads: int | None):
    with exclusive:
        before = torch.get_num_threads()
        if device.type == "cpu" and threads:
            torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def _shared(clock: AloneClock | None):
    """A shared hold of the clock's device (nothing without a clock)."""
    return clock.share.shared() if clock is not None else contextlib.nullcontext()


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


def steps_per_epoch(bound: BoundTask, t: TrainConfig) -> int:
    n = bound.batches_per_epoch()
    return min(n, t.max_steps_per_epoch) if t.max_steps_per_epoch else n


def fit(
    task: Task,
    cfg: RunConfig,
    bound: BoundTask,
    *,
    device: torch.device,
    run_dir: Path | None = None,
    callbacks: Sequence[Callback] = (),
    log_seconds: float = LOG_SECONDS,
    clock: AloneClock | None = None,
) -> TrainResult:
    """Train `bound`'s model under `cfg`; evaluate each epoch; test the best checkpoint at the end.

    Inside an epoch nothing waits for the device, except a step callback's report (at most every
    `log_seconds`, when a callback listens to steps): losses, the divergence check and the learning
    rate stay device tensors until the epoch ends. With a `clock` (a search), each epoch's training and
    evaluation hold the device as `AloneClock` says, and epoch 1 measures the speed alone.
    """
    t = cfg.train
    check_compile(t, task)  # before anything is built or trained
    seed_everything(cfg.seed)
    model = bound.build_model().to(device)
    result = TrainResult(status="completed", primary_metric=task.primary.name,
                         params=sum(p.numel() for p in model.parameters()), target=t.target)
    spe = steps_per_epoch(bound, t)
    for cb in callbacks:
        cb.on_start(spe, t.epochs)
    step_callbacks = [cb for cb in callbacks if type(cb).on_step is not Callback.on_step]

    best_state: dict[str, torch.Tensor] | None = None
    start = time.perf_counter()
    stopped_by: BaseException | None = None
    try:
        with _shared(clock):  # compiling and capturing are device work too
            steps, result.compile_seconds, note = prepare_steps(task, cfg, bound, model, device, spe)
        result.step_mode, result.step_note = steps.mode.describe(), note
        for cb in callbacks:
            cb.on_prepared(result.step_mode, result.compile_seconds, note)
        start = time.perf_counter()  # wall time, like training time, starts after the warm-up
        report = _reporter(step_callbacks)
        result.epoch_seconds_alone = clock.known if clock is not None else None
        for epoch in range(1, t.epochs + 1):
            hold, measured = clock.hold(epoch, device) if clock is not None else (contextlib.nullcontext(), False)
            # The whole epoch (training, evaluation, checkpoint, callbacks) inside one hold, released with the
            # device idle (evaluate reads its results): between holds, a worker measuring alone gets its turn.
            with hold:
                model.train()
                step_clock = StepClock(device) if measured else None
                seen, epoch_seconds = train_epoch(steps, bound, epoch, t.epochs, spe, device, report, log_seconds, step_clock)
                steps.state.check_finite(epoch)
                if measured:
                    result.epoch_seconds_alone = alone_epoch_seconds(step_clock.seconds(), seen, t.batch_size)
                model.eval()
                with torch.no_grad(), autocast_context(t, device):
                    metrics = bound.evaluate(model, "val")
                result.train_seconds += epoch_seconds
                result.steps, result.epochs_run, result.samples = steps.steps_taken, epoch, result.samples + seen
                result.uncaptured_steps = steps.uncaptured
                record = EpochRecord(epoch, steps.steps_taken, float(steps.state.loss_sum) / max(seen, 1), steps.lr(),
                                     result.train_seconds, time.perf_counter() - start, seen / epoch_seconds, metrics,
                                     epoch_seconds_alone=result.epoch_seconds_alone)
                for cb in callbacks:
                    cb.on_evaluate(model, bound, record)
                best_state = keep_epoch(task, t, result, record, model, run_dir, best_state)
                try:
                    for cb in callbacks:
                        cb.on_epoch_end(record)
                except Exception as e:
                    stopped_by = e
                    raise
    except KeyboardInterrupt:
        result.status = "interrupted"
        _finish(result, run_dir, start)
        raise
    except Diverged as e:
        result.status, result.error = "diverged", str(e)
        _finish(result, run_dir, start)
        raise
    except Exception as e:  # keep what was done; a callback stopping the run (pruning) is not a failure
        result.status = "stopped" if e is stopped_by else "failed"
        result.error = f"{type(e).__name__}: {e}"
        _finish(result, run_dir, start)
        raise

    with _shared(clock):
        evaluate_test_on_best(model, best_state, bound, t, device, result, run_dir)
    _finish(result, run_dir, start)
    return result


def keep_epoch(task: Task, t: TrainConfig, result: TrainResult, record: EpochRecord, model: torch.nn.Module,
               run_dir: Path | None, best_state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """Keep an evaluated epoch: its record in the history and metrics.jsonl, the best figures so far, the
    best weights (returned, and checkpointed atomically in `run_dir`), the time to the target."""
    result.history.append(record)
    value = record.metrics[task.primary.name]
    if result.best_value is None or task.primary.better(value, result.best_value):
        result.best_epoch, result.best_value, result.best_metrics = record.epoch, value, dict(record.metrics)
        result.best_diversity = dict(record.diversity)
        result.best_train_seconds, result.best_wall_seconds = record.train_seconds, record.wall_seconds
        best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if run_dir is not None:
            save_checkpoint(best_state, run_dir / CHECKPOINT, {"epoch": str(record.epoch), "task": task.name})
    if t.target is not None and result.seconds_to_target is None and not task.primary.better(t.target, value):
        result.seconds_to_target = record.train_seconds
    if run_dir is not None:
        append_line(run_dir / "metrics.jsonl", json.dumps(asdict(record)))
    return best_state


def evaluate_test_on_best(model: torch.nn.Module, best_state: dict[str, torch.Tensor] | None, bound: BoundTask, t: TrainConfig,
              device: torch.device, result: TrainResult, run_dir: Path | None) -> None:
    """The test figures of the best weights (into `result`), and the task's outputs in `run_dir`."""
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    with torch.no_grad(), autocast_context(t, device):
        result.test_metrics = bound.evaluate(model, "test")
    if run_dir is not None:
        bound.write_outputs(run_dir)


def _reporter(step_callbacks: Sequence[Callback]):
    """What train_epoch calls with progress (None when no callback listens to steps)."""
    if not step_callbacks:
        return None

    def report(info: StepInfo) -> None:
        for cb in step_callbacks:
            cb.on_step(info)

    return report


def train_epoch(steps: Steps, bound: BoundTask, epoch: int, epochs: int, spe: int, device: torch.device,
                report=None, log_seconds: float = LOG_SECONDS, step_clock: "StepClock | None" = None) -> tuple[int, float]:
    """One epoch of training steps: (samples, seconds). The clock starts and stops with the device idle.

    Nothing here waits for the device, except `report(StepInfo)` when given (at most every
    `log_seconds`, and after the last step), which reads the loss and checks it is finite. A
    `step_clock` marks the start of every step (its batch included) and the end of the last."""
    synchronize(device)
    t0 = last_log = time.perf_counter()
    steps.state.loss_sum.zero_()
    seen = 0
    for i, batch in enumerate(itertools.islice(_marked(bound.train_batches(epoch), step_clock), spe)):
        seen += steps.step(batch)
        if report is not None and (time.perf_counter() - last_log >= log_seconds or i == spe - 1):
            steps.state.check_finite(epoch)  # reads the device: only when someone listens
            last_log = time.perf_counter()
            report(StepInfo(epoch, epochs, i + 1, spe, steps.steps_taken, float(steps.state.last_loss), steps.lr(),
                            seen / max(last_log - t0, 1e-9)))
    if step_clock is not None:
        step_clock.mark()
    synchronize(device)
    return seen, time.perf_counter() - t0


def _marked(batches, step_clock):
    """The batches, with `step_clock.mark()` before each is drawn (so a step's time includes its batch)."""
    for batch in batches:
        if step_clock is not None:
            step_clock.mark()
        yield batch


class StepClock:
    """Times every step of an epoch without waiting for the device inside it: CUDA events on a GPU (read
    once, after the epoch), the host clock on a CPU. `seconds()` lists the steps' durations."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Each step's duration (after the epoch: on a GPU this reads the events, which the epoch's end synchronised)."""
        pairs = zip(self.marks, self.marks[1:])
        if self.cuda:
            return [a.elapsed_time(b) / 1000 for a, b in pairs]
        return [b - a for a, b in pairs]


def alone_epoch_seconds(step_seconds: list[float], samples: int, batch_size: int) -> float:
    """One epoch's training seconds estimated from its steps: the median step time x the epoch's batches
    (a partial last batch counted by its size). The median keeps a step slowed by something outside
    headsearch (the machine's other processes, which no lock reaches) out of the figure."""
    return statistics.median(step_seconds) * samples / batch_size


def prepare_steps(task: Task, cfg: RunConfig, bound: BoundTask, model: torch.nn.Module, device: torch.device,
                  spe: int) -> tuple[Steps, float, str | None]:
    """The run's steps, warmed up (compiled, captured) before the clock starts: (steps, warm-up seconds,
    note). If compiling or capturing fails, fall back a step at a time (compiled blocks without the
    graph... eager with the graph, then plain eager) and say so in `note`, one line."""
    t = cfg.train
    mode = resolve_mode(t, task, device)
    total, warmup = spe * t.epochs, round(t.warmup_epochs * spe)
    notes: list[str] = []
    seconds = 0.0
    for candidate in fallbacks(mode):
        step_model = None
        try:
            step_model = compile_blocks(model, candidate, dynamic=None if task.static_shapes else True)
            steps = make_steps(candidate, model, step_model, bound, t, device, total, warmup)
            started = time.perf_counter()
            try:
                seconds += steps.warm_up(bound.warmup_batches(spe))  # 0 when nothing compiles or captures
            except BaseException:
                seconds += time.perf_counter() - started  # a failed attempt's time is warm-up time too
                raise
            return steps, seconds, "; ".join(notes) or None
        except (KeyboardInterrupt, Diverged, ConfigError, torch.cuda.OutOfMemoryError):
            raise  # not the fast path's fault: a slower mode would meet it too
        except Exception as e:
            if candidate.name == "off":
                raise
            reason = " ".join(str(e).split())[:160] or type(e).__name__
            notes.append(f"{candidate.describe()} failed ({type(e).__name__}: {reason})")
    raise AssertionError("the eager mode is always the last fallback")


def fallbacks(mode: StepMode) -> list[StepMode]:
    """`mode`, then what to try if it fails: without compiling (keeping the graph), then plain eager."""
    chain = [mode]
    if mode.inductor is not None and mode.cuda_graph:
        chain.append(StepMode("graphs", None, True))
    if mode.name != "off":
        chain.append(StepMode("off", None, False))
    return chain


def _finish(result: TrainResult, run_dir: Path | None, start: float) -> None:
    result.wall_seconds = time.perf_counter() - start
    if result.epoch_seconds_alone is not None and result.best_epoch is not None:
        result.best_seconds_alone = result.best_epoch * result.epoch_seconds_alone
    result.samples_per_s = result.samples / result.train_seconds if result.train_seconds else 0.0
    if run_dir is not None:
        write_atomic(run_dir / "final.json", json.dumps(result.to_dict(), indent=2) + "\n")


ALONE_STEPS = 30  # steps timed by measure_alone: enough for a stable median
ALONE_SETTLE = 5  # untimed steps before them: a process's first steps run cold (allocator, caches)


def measure_alone(task: Task, cfg: RunConfig, bound: BoundTask, device: torch.device, clock: AloneClock,
                  steps: int = ALONE_STEPS) -> float:
    """An architecture's epoch seconds with the device to itself, measured apart from its run: a solo copy of
    the model, warmed up in the step mode a solo run would use, times `steps` training steps under the
    clock's exclusive hold (a process alone's threads on a CPU); the median step x the epoch's batches, as
    `AloneClock` measures a solo run's epoch 1. A cohort's trials get their `time` this way, so it is the
    same figure whatever cohort they trained in. `bound` is used under a fresh data order (its own is
    untouched), and the global RNG is put back as it was."""
    t = cfg.train
    spe = steps_per_epoch(bound, t)
    scratch = bound.rebind(cfg)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        seed_everything(cfg.seed)
        model = bound.build_model().to(device)
        with _shared(clock):
            solo_steps, _, _ = prepare_steps(task, cfg, scratch, model, device, spe)
        model.train()
        with _alone(clock.share.exclusive(), device, clock.alone_threads):
            step_clock = StepClock(device)
            synchronize(device)
            batches = itertools.islice(itertools.chain.from_iterable(scratch.train_batches(e) for e in itertools.count(1)),
                                       ALONE_SETTLE + steps)
            for i, batch in enumerate(batches):
                if i >= ALONE_SETTLE:
                    step_clock.mark()
                solo_steps.step(batch)
            step_clock.mark()
            synchronize(device)
    return alone_epoch_seconds(step_clock.seconds(), min(bound.n_train, spe * t.batch_size), t.batch_size)
