"""The fair clock: how a run learns its architecture's speed with the device to itself (the search's `time`),
whatever else shares the device. Holds of the device (`devicelock.DeviceShare`) around each epoch, warm-up
and test; the timed steps of epoch 1 under the exclusive hold; `measure_alone` for a run that cannot time
itself (a cohort slot). docs/design.md §7.4 gives the reasoning and the figures."""
from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from headsearch.environment import env_flag
from headsearch.tasks import BoundTask, Task
from headsearch.training.devicelock import Share
from headsearch.training.prepare import prepare_steps
from headsearch.training.runtime import seed_everything, steps_per_epoch, use_device
from headsearch.training.steps import synchronize


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
    (the intended mode's).
    """

    share: Share
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
            self._stack.enter_context(alone_hold(self.clock.share.exclusive(), self.device, self.clock.alone_threads)
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
def alone_hold(exclusive, device: torch.device, threads: int | None):
    """The exclusive hold, with a lone process's threads on a CPU."""
    with exclusive:
        before = torch.get_num_threads()
        if device.type == "cpu" and threads:
            torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def shared_hold(clock: AloneClock | None):
    """A shared hold of the clock's device (nothing without a clock)."""
    return clock.share.shared() if clock is not None else contextlib.nullcontext()


def unheld_warm_up() -> bool:
    """Whether a GPU warm-up runs outside any device hold: the default since an H200 measured it fair and faster
    (benchmarks/RESULTS.md, "The second GPU run"); HEADSEARCH_UNHELD_WARM_UP=0 holds it shared as before.
    `warm_up_hold` says why."""
    return env_flag("HEADSEARCH_UNHELD_WARM_UP")


def warm_up_hold(clock: AloneClock | None, device: torch.device):
    """The hold a run's warm-up (compile, capture, verify: `prepare_steps`) runs in: none on a GPU, or a shared
    one on a CPU or with HEADSEARCH_UNHELD_WARM_UP=0. On a CPU always shared: compiling takes the very cores a measuring
    worker's timed steps use.

    Why none on a GPU: a warm-up lasts 10 to 120 s per new block kind (20 s for the seed ViT on an H200), and an
    exclusive request waits for every shared holder while holding the gate that queues all new shared ones.
    Under a shared hold, every worker of the device then sits idle through another's whole compile whenever a
    trial with an unmeasured architecture asks to time its steps: early in a search, almost always (a lock
    convoy, found in review). Outside any hold, a warm-up costs the GPU a few dozen short steps (the warm-up
    and verification steps) and the host 1/K of its cores (Inductor's compile threads, `search/workers.py`);
    the timed median of ALONE_STEPS steps is robust to the few that overlap them. Measured on an H200 (`gpu.sh
    next`, 24-trial slices of the headline job, 8 workers, cold caches): held, 3 trials finished in 2 minutes
    (two architectures' 60-100 s compiles held every worker); unheld, 18; each architecture's time alone within
    2% of the held run's."""
    if clock is None or (device.type == "cuda" and unheld_warm_up()):
        return contextlib.nullcontext()
    return clock.share.shared()


def marked_batches(batches, step_clock, timed: int):
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


def measure_alone(task: Task, bound: BoundTask, device: torch.device, clock: AloneClock) -> float:
    """An architecture's epoch seconds with the device to itself, measured apart from its run: a solo copy of
    the model, warmed up in the step mode a solo run would use, times the steps a solo run's epoch 1 times
    (the first ALONE_STEPS, or every step of a shorter epoch) under the clock's exclusive hold (a process
    alone's threads on a CPU); the median step x the epoch's batches, as `AloneClock` measures a solo run's
    epoch 1. A cohort's trials get their `time` this way, so it is the
    same figure whatever cohort they trained in. The config is `bound.cfg`; `bound` is used under a fresh
    data order (its own is untouched), and the global RNG is put back as it was."""
    cfg = bound.cfg
    t = cfg.train
    use_device(device)
    spe = steps_per_epoch(bound, t)
    steps = min(ALONE_STEPS, spe)
    scratch = bound.rebind(cfg)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        seed_everything(cfg.seed)
        model = bound.build_model().to(device)
        with warm_up_hold(clock, device):
            solo_steps, _, _ = prepare_steps(task, t, scratch, model, device, spe)
        clock.ran_as(solo_steps.mode.describe())
        if clock.known is not None:  # measured before in the mode the solo run fell back to
            return clock.known
        model.train()
        with alone_hold(clock.share.exclusive(), device, clock.alone_threads):
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
