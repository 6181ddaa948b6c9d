"""One training loop for every task.

After each epoch it evaluates on the validation split and hands an `EpochRecord` to the callbacks
(a search prunes by raising from `on_epoch_end`). It records the convergence figures a search
optimises: epoch and seconds of the best validation metric, seconds to reach a target, throughput,
parameter count. The best checkpoint is kept (atomically) in the run directory as it improves, and
the final test figure is measured on it.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from headsearch.config import RunConfig, TrainConfig
from headsearch.errors import ConfigError, Diverged
from headsearch.io import append_line, write_atomic
from headsearch.tasks import BoundTask, Task
from headsearch.training.fastpath import StepMode, check_compile, compile_blocks, resolve_mode
from headsearch.training.rundir import save_checkpoint
from headsearch.training.steps import (  # noqa: F401  (autocast_context, lr_multiplier, make_optimizer: re-exported)
    CaptureBrokeCuda, Steps, autocast_context, lr_multiplier, make_optimizer, make_steps, synchronize,
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
    params: int | None = None  # the model's parameter count


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


ALONE_STEPS = 30  # steps timed alone: enough for a stable median, few enough that the others wait briefly
ALONE_SETTLE = 5  # untimed steps before them in measure_alone: a process's first steps run cold (allocator, caches)


@dataclass
class AloneClock:
    """How a run learns its architecture's speed with the device to itself: the search's fair `time`.

    Several trials may share a device; the seconds one of them measures then depend on the others.
    With a clock, every epoch runs inside `share.shared()` (training and evaluation, released with the
    device idle), except the first ALONE_STEPS steps of epoch 1, which run inside `share.exclusive()`:
    the other workers of this device (which respect the same lock) wait at their next epoch boundary,
    and those steps, timed one by one, give the architecture's `epoch_seconds_alone` (the median step x
    the epoch's batches, `alone_epoch_seconds`). Then the hold turns shared again, with the device idle,
    for the rest of epoch 1, its evaluation and checkpoint: the others are paused only for the steps
    that are timed (a whole epoch alone, evaluation included, would idle K - 1 workers for far longer).
    Every hold covers the warm-up and the final test too: on a CPU all of it competes for the cores.
    On a CPU the timed steps use `alone_threads` threads (what a process alone on the machine uses).

    What was measured before counts only for the step mode that runs (a time measured after a fallback
    to eager steps must not stand for compiled ones): `recall(step_mode)`, when given, is asked once the
    run's steps are prepared and returns the epoch seconds an earlier trial measured for this
    architecture in that mode, or None (then this run measures). `known` is the value before that
    (the intended mode's). `share` is a `headsearch.training.devicelock.DeviceShare` (or `NoShare`).
    """

    share: Any
    known: float | None = None
    alone_threads: int | None = None
    recall: Callable[[str], float | None] | None = None

    def ran_as(self, step_mode: str) -> None:
        """The run's steps are prepared and run as `step_mode`: look up what was measured for that mode."""
        if self.recall is not None:
            self.known = self.recall(step_mode)

    def measures(self, epoch: int) -> bool:
        """Whether `epoch` holds the timed steps (epoch 1, when nothing was measured before)."""
        return epoch == 1 and self.known is None


class EpochHold:
    """The hold one epoch runs in (`with EpochHold(...) as hold:`): shared, or, for the measured epoch,
    exclusive until `to_shared()` (called with the device idle after the timed steps), shared after."""

    def __init__(self, clock: AloneClock | None, device: torch.device, measured: bool):
        self.clock, self.device, self.measured = clock, device, measured
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "EpochHold":
        if self.clock is not None:
            self._stack.enter_context(_alone(self.clock.share.exclusive(), self.device, self.clock.alone_threads)
                                      if self.measured else self.clock.share.shared())
        return self

    def to_shared(self) -> float:
        """Leave the exclusive hold and take a shared one; returns the seconds waited for it (another
        worker may measure meanwhile), which the epoch's training time leaves out."""
        self._stack.close()
        return self._stack.enter_context(self.clock.share.shared()).waited

    def __exit__(self, *exc) -> bool | None:
        return self._stack.__exit__(*exc)


@contextlib.contextmanager
def _alone(exclusive, device: torch.device, threads: int | None):
    """The exclusive hold, with a lone process's threads on a CPU."""
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


def _warm_up_hold(clock: AloneClock | None, device: torch.device):
    """The hold a run's warm-up (compile, capture, verify: `prepare_steps`) runs in: on a CPU a shared one, since
    compiling takes the very cores a measuring worker's timed steps use; on a GPU none.

    Why none on a GPU: a warm-up lasts 10 to 120 s per new block kind (20 s for the seed ViT on an H200), and an
    exclusive request waits for every shared holder while holding the gate that queues all new shared ones.
    Under a shared hold, every worker of the device would then sit idle through another's whole compile
    whenever a trial with an unmeasured architecture asks to time its steps: early in a search, almost always
    (a lock convoy). Outside any hold, a warm-up costs the GPU a few dozen short steps (the warm-up and
    verification steps) and the host 1/K of its cores (Inductor's compile threads, `search/workers.py`);
    the timed median of ALONE_STEPS steps is robust to the few that overlap them."""
    if clock is None or device.type == "cuda":
        return contextlib.nullcontext()
    return clock.share.shared()


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
    use_device(device)
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
    # The id of a callback's exception, not the exception: a local holding it would keep this frame (the model,
    # its graphs and optimizer state) alive through the traceback's reference cycle until the cyclic collector ran.
    stopped_by: int | None = None
    try:
        with _warm_up_hold(clock, device):
            steps, result.compile_seconds, note = prepare_steps(task, cfg, bound, model, device, spe)
        result.step_mode, result.step_note = steps.mode.describe(), note
        for cb in callbacks:
            cb.on_prepared(result.step_mode, result.compile_seconds, note)
        start = time.perf_counter()  # wall time, like training time, starts after the warm-up
        report = _reporter(step_callbacks)
        if clock is not None:
            clock.ran_as(result.step_mode)  # a time measured in another mode (a fallback's) does not stand for this one
            result.epoch_seconds_alone = clock.known
        for epoch in range(1, t.epochs + 1):
            measured = clock is not None and clock.measures(epoch)
            # The whole epoch (training, evaluation, checkpoint, callbacks) inside one hold, released with the
            # device idle (evaluate reads its results): between holds, a worker measuring alone gets its turn.
            with EpochHold(clock, device, measured) as hold:
                model.train()
                step_clock = StepClock(device) if measured else None
                seen, epoch_seconds = train_epoch(steps, bound, epoch, t.epochs, spe, device, report, log_seconds, step_clock,
                                                  timed_steps=ALONE_STEPS, after_timed=hold.to_shared if measured else None)
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
                                     epoch_seconds_alone=result.epoch_seconds_alone, params=result.params)
                for cb in callbacks:
                    cb.on_evaluate(model, bound, record)
                best_state = keep_epoch(task, t, result, record, model, run_dir, best_state)
                try:
                    for cb in callbacks:
                        cb.on_epoch_end(record)
                except Exception as e:
                    stopped_by = id(e)
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
        result.status = "stopped" if id(e) == stopped_by else "failed"
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
                report=None, log_seconds: float = LOG_SECONDS, step_clock: "StepClock | None" = None,
                timed_steps: int | None = None, after_timed: Callable[[], float] | None = None) -> tuple[int, float]:
    """One epoch of training steps: (samples, seconds). The clock starts and stops with the device idle.

    Nothing here waits for the device, except `report(StepInfo)` when given (at most every
    `log_seconds`, and after the last step), which reads the loss and checks it is finite. A
    `step_clock` marks the start of each of the first `timed_steps` steps (every step when None; its
    batch included) and the end of the last of them; then, with the device idle, `after_timed()` runs
    (the measured epoch leaves its exclusive hold there) and the seconds it returns (waited for the next
    hold) are left out of the epoch's seconds."""
    synchronize(device)
    t0 = last_log = time.perf_counter()
    steps.state.loss_sum.zero_()
    seen, paused = 0, 0.0
    timed = spe if timed_steps is None else min(timed_steps, spe)
    for i, batch in enumerate(itertools.islice(_marked(bound.train_batches(epoch), step_clock, timed), spe)):
        seen += steps.step(batch)
        if report is not None and (time.perf_counter() - last_log >= log_seconds or i == spe - 1):
            steps.state.check_finite(epoch)  # reads the device: only when someone listens
            last_log = time.perf_counter()
            report(StepInfo(epoch, epochs, i + 1, spe, steps.steps_taken, float(steps.state.last_loss), steps.lr(),
                            seen / max(last_log - t0, 1e-9)))
        if i + 1 == timed:
            if step_clock is not None:
                step_clock.mark()
            if after_timed is not None:
                synchronize(device)  # the timed steps' kernels are done before the hold changes
                paused += after_timed()
    synchronize(device)
    return seen, time.perf_counter() - t0 - paused


def _marked(batches, step_clock, timed: int):
    """The batches, with `step_clock.mark()` before each of the first `timed` is drawn (so a step's time
    includes its batch)."""
    for i, batch in enumerate(batches):
        if step_clock is not None and i < timed:
            step_clock.mark()
        yield batch


class StepClock:
    """Times every step of an epoch without waiting for the device inside it: CUDA events on a GPU (read
    once, after the epoch), the host clock on a CPU. `seconds()` lists the steps' durations."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        # The stream the steps run on: `device`'s current stream, not the current device's. `Event.record()`
        # with no stream records on `torch.cuda.current_stream()` of the current device (torch/cuda/streams.py,
        # Event.record): for steps on cuda:1 while cuda:0 is current, an idle stream, and every step would
        # time as the host's launch time. Taken once: the steps run inside the same stream context as this.
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
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
    graph... eager with the graph, then plain eager) and say so in `note`, one line.

    Running out of device memory while warming up a fast mode falls back too: compiling and capturing
    need memory that eager steps do not (each graph's pool holds its temporaries for good), so a model
    that fits eagerly must not fail its trial there. The failed attempt's steps (its graphs, their pool,
    its optimizer state) are dropped and CUDA's cache emptied before the next mode. Out of memory in
    eager steps is the run's own, and raised. A capture that left CUDA unusable (`CaptureBrokeCuda`) is
    raised too: no fallback can run in this process."""
    t = cfg.train
    mode = resolve_mode(t, task, device)
    total, warmup = spe * t.epochs, round(t.warmup_epochs * spe)
    notes: list[str] = []
    seconds = 0.0
    for candidate in fallbacks(mode):
        step_model = steps = None
        out_of_memory = False
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
        except (KeyboardInterrupt, Diverged, ConfigError, CaptureBrokeCuda):
            raise  # not the fast path's fault (a slower mode would meet it too), or nothing can run after it
        except Exception as e:  # torch.cuda.OutOfMemoryError included: a RuntimeError
            if candidate.name == "off":
                raise
            out_of_memory = isinstance(e, torch.cuda.OutOfMemoryError)
            reason = " ".join(str(e).split())[:160] or type(e).__name__
            failed = "ran out of device memory" if out_of_memory else "failed"
            notes.append(f"{candidate.describe()} {failed} ({type(e).__name__}: {reason})")
        # Here the exception and its traceback (whose frames hold the failed steps) are gone; drop the rest: the
        # steps, and the grads they left on the model (a failed capture's live in its graphs' memory pool).
        steps = step_model = None
        model.zero_grad(set_to_none=True)
        if out_of_memory and device.type == "cuda":
            gc.collect()  # reference cycles among the failed attempt's objects would keep their memory
            torch.cuda.empty_cache()
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


def measure_alone(task: Task, cfg: RunConfig, bound: BoundTask, device: torch.device, clock: AloneClock) -> float:
    """An architecture's epoch seconds with the device to itself, measured apart from its run: a solo copy of
    the model, warmed up in the step mode a solo run would use, times the steps a solo run's epoch 1 times
    (the first ALONE_STEPS, or every step of a shorter epoch) under the clock's exclusive hold (a process
    alone's threads on a CPU); the median step x the epoch's batches, as `AloneClock` measures a solo run's
    epoch 1. A cohort's trials get their `time` this way, so it is the
    same figure whatever cohort they trained in. `bound` is used under a fresh data order (its own is
    untouched), and the global RNG is put back as it was."""
    t = cfg.train
    use_device(device)
    spe = steps_per_epoch(bound, t)
    steps = min(ALONE_STEPS, spe)
    scratch = bound.rebind(cfg)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        seed_everything(cfg.seed)
        model = bound.build_model().to(device)
        with _warm_up_hold(clock, device):
            solo_steps, _, _ = prepare_steps(task, cfg, scratch, model, device, spe)
        clock.ran_as(solo_steps.mode.describe())
        if clock.known is not None:  # measured before in the mode the solo run fell back to
            return clock.known
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
