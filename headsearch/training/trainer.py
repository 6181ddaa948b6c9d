"""One training loop for every task: the epoch loop alone. How a step runs (mode, compile, capture, verify,
fall back) is `headsearch.training.prepare`; the fair clock (holds of the device, the time alone) is
`headsearch.training.clock`; the device, the seeds and the epoch's length are `headsearch.training.runtime`.

After each epoch it evaluates on the validation split and hands an `EpochRecord` to the callbacks
(a search prunes by raising from `on_epoch_end`). It records the convergence figures a search
optimises: epoch and seconds of the best validation metric, seconds to reach a target, throughput,
parameter count. The best checkpoint is kept (atomically) in the run directory as it improves, and
the final test figure is measured on it.
"""
from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from headsearch.errors import Diverged
from headsearch.io import append_line, write_atomic
from headsearch.tasks import BoundTask, Task
from headsearch.training.pause import history_lines, load_pause, resume_run, save_pause
from headsearch.training.records import PAUSE, Callback, EpochRecord, PauseRun, StepInfo, TrainResult
from headsearch.training.clock import (
    ALONE_STEPS, AloneClock, EpochHold, StepClock, alone_epoch_seconds, marked_batches, shared_hold, warm_up_hold,
)
from headsearch.training.fastpath import check_compile
from headsearch.training.prepare import prepare_steps
from headsearch.training.rundir import save_checkpoint
from headsearch.training.runtime import seed_everything, steps_per_epoch, use_device
from headsearch.training.steps import Steps, synchronize

CHECKPOINT = "model.safetensors"
LOG_SECONDS = 0.5  # at most this often a step callback hears of progress (each report reads the device)


def fit(
    task: Task,
    bound: BoundTask,
    *,
    device: torch.device,
    run_dir: Path | None = None,
    callbacks: Sequence[Callback] = (),
    log_seconds: float = LOG_SECONDS,
    clock: AloneClock | None = None,
    resume: bool = False,
) -> TrainResult:
    """Train `bound`'s model under its own config (`bound.cfg`, the one its data was bound under: a second
    copy could disagree with it); evaluate each epoch; test the best checkpoint at the end.

    Inside an epoch nothing waits for the device, except a step callback's report (at most every
    `log_seconds`, when a callback listens to steps): losses, the divergence check and the learning
    rate stay device tensors until the epoch ends. With a `clock` (a search), each epoch's training and
    evaluation hold the device as `AloneClock` says, and epoch 1 measures the speed alone.

    A callback that raises `PauseRun` from `on_epoch_end` stops the run with its state written to `run_dir`'s
    `PAUSE`; `resume=True` goes on from there, as if the run had never stopped (`headsearch.training.pause`).
    """
    cfg = bound.cfg
    t = cfg.train
    check_compile(t, task)  # before anything is built or trained
    if resume and run_dir is None:
        raise ValueError("fit(resume=True) resumes the run paused in run_dir: pass run_dir")
    paused = load_pause(run_dir / PAUSE, device) if resume else None  # a missing or foreign file fails here
    use_device(device)
    seed_everything(cfg.seed)
    model = bound.build_model().to(device)
    result = TrainResult(status="completed", primary_metric=task.primary.name,
                         params=sum(p.numel() for p in model.parameters()), target=t.target)
    spe = steps_per_epoch(bound, t)
    for cb in callbacks:
        cb.on_start(spe, t.epochs)
    step_callbacks = [cb for cb in callbacks if type(cb).on_step is not Callback.on_step]

    run = Run(task, bound, run_dir, callbacks, result)
    # The id of a callback's exception, not the exception: a local holding it would keep this frame (the model,
    # its graphs and optimizer state) alive through the traceback's reference cycle until the cyclic collector ran.
    stopped_by: int | None = None
    try:
        with warm_up_hold(clock, device):
            steps, result.compile_seconds, note = prepare_steps(task, t, bound, model, device, spe)
        result.step_mode, result.step_note = steps.mode.describe(), note
        for cb in callbacks:
            cb.on_prepared(result.step_mode, result.compile_seconds, note)
        run.started = time.perf_counter()  # wall time, like training time, starts after the warm-up
        report = _reporter(step_callbacks)
        if clock is not None:
            clock.ran_as(result.step_mode)  # a time measured in another mode (a fallback's) does not stand for this one
            result.epoch_seconds_alone = clock.known
        first = 1
        if paused is not None:
            first = resume_run(paused, model=model, steps=steps, bound=bound, run=run, device=device)
            result = run.result  # epoch_seconds_alone included: measured in epoch 1, before the pause
        paused = None  # its tensors (weights, moments) are in the run now: not held twice
        for epoch in range(first, t.epochs + 1):
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
                result.uncaptured_steps = steps.uncaptured
                record = run.close_epoch(model, steps.autocast(), epoch, steps.steps_taken,
                                         float(steps.state.loss_sum) / max(seen, 1), steps.lr(), epoch_seconds, seen)
                try:
                    for cb in callbacks:
                        cb.on_epoch_end(record)
                except Exception as e:
                    stopped_by = id(e)
                    if isinstance(e, PauseRun) and run_dir is not None:
                        save_pause(run_dir / PAUSE, epoch=epoch, model=model, steps=steps, bound=bound, result=result,
                                   best_state=run.best_state, wall_seconds=time.perf_counter() - run.started)
                        e.kept = str(run_dir / PAUSE)
                    raise
    except KeyboardInterrupt:
        run.end("interrupted")
        raise
    except Diverged as e:
        run.end("diverged", str(e))
        raise
    except Exception as e:  # keep what was done; a callback stopping the run (pruning) is not a failure
        by_callback = id(e) == stopped_by
        run.end(("paused" if isinstance(e, PauseRun) else "stopped") if by_callback else "failed",
                f"{type(e).__name__}: {e}")
        raise

    with shared_hold(clock):
        run.evaluate_test_on_best(model, steps.autocast())
    return run.end("completed")


@dataclass
class Run:
    """One run's bookkeeping, whoever trains it (`fit`, or a cohort for each of its slots: `cohort.Slot`): its
    result, run directory, callbacks, best weights so far and start. Each evaluated epoch is recorded and kept,
    the best weights tested and the run ended the same way for both."""

    task: Task
    bound: BoundTask
    run_dir: Path | None
    callbacks: Sequence[Callback]
    result: TrainResult
    best_state: dict[str, torch.Tensor] | None = None
    started: float = field(default_factory=time.perf_counter)

    def close_epoch(self, model: torch.nn.Module, autocast, epoch: int, steps: int, loss: float, lr: float,
                    seconds: float, seen: int) -> EpochRecord:
        """An epoch trained (`steps` in all so far, its mean `loss`, the next step's `lr`, its `seconds` and `seen`
        samples): evaluate `model` on the validation split (under `autocast`), add the epoch to the result, hand
        its record to the callbacks' `on_evaluate` and keep it (`keep_epoch`). Returns the record."""
        model.eval()
        with torch.no_grad(), autocast:
            metrics = self.bound.evaluate(model, "val")
        result = self.result
        result.train_seconds += seconds
        result.steps, result.epochs_run, result.samples = steps, epoch, result.samples + seen
        record = EpochRecord(epoch, steps, loss, lr, result.train_seconds, time.perf_counter() - self.started,
                             seen / seconds, metrics, epoch_seconds_alone=result.epoch_seconds_alone,
                             params=result.params)
        for cb in self.callbacks:
            cb.on_evaluate(model, self.bound, record)
        self.keep_epoch(record, model)
        return record

    def keep_epoch(self, record: EpochRecord, model: torch.nn.Module) -> None:
        """Keep an evaluated epoch: its record in the history and metrics.jsonl, the best figures so far, the
        best weights (in `best_state`, and checkpointed atomically in `run_dir`), the time to the target."""
        result, primary = self.result, self.task.primary
        result.history.append(record)
        value = record.metrics[primary.name]
        if result.best_value is None or primary.better(value, result.best_value):
            result.best_epoch, result.best_value, result.best_metrics = record.epoch, value, dict(record.metrics)
            result.best_diversity = dict(record.diversity)
            result.best_train_seconds, result.best_wall_seconds = record.train_seconds, record.wall_seconds
            self.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if self.run_dir is not None:
                save_checkpoint(self.best_state, self.run_dir / CHECKPOINT,
                                {"epoch": str(record.epoch), "task": self.task.name})
        if result.target is not None and result.seconds_to_target is None and not primary.better(result.target, value):
            result.seconds_to_target = record.train_seconds
        if self.run_dir is not None:
            append_line(self.run_dir / "metrics.jsonl", json.dumps(asdict(record)))

    def rewrite_kept(self) -> None:
        """metrics.jsonl and the best checkpoint written again from the result and the best weights (a resumed run:
        whatever a resumption that died midway appended or saved after the pause is replaced)."""
        if self.run_dir is None:
            return
        write_atomic(self.run_dir / "metrics.jsonl", history_lines(self.result))
        if self.best_state is not None and self.result.best_epoch is not None:
            save_checkpoint(self.best_state, self.run_dir / CHECKPOINT,
                            {"epoch": str(self.result.best_epoch), "task": self.task.name})

    def evaluate_test_on_best(self, model: torch.nn.Module, autocast) -> None:
        """The test figures of the best weights (into the result, under `autocast`), and the task's outputs in
        `run_dir`."""
        if self.best_state is not None:
            model.load_state_dict(self.best_state)
        model.eval()
        with torch.no_grad(), autocast:
            self.result.test_metrics = self.bound.evaluate(model, "test")
        if self.run_dir is not None:
            self.bound.write_outputs(self.run_dir)

    def end(self, status: str, error: str | None = None) -> TrainResult:
        """The run ended with `status` (`TrainResult.status`; `error` says why, when given): its closing
        figures, and final.json in `run_dir`. Returns the result."""
        result = self.result
        result.status = status
        if error is not None:
            result.error = error
        result.wall_seconds = time.perf_counter() - self.started
        if result.epoch_seconds_alone is not None and result.best_epoch is not None:
            result.best_seconds_alone = result.best_epoch * result.epoch_seconds_alone
        result.samples_per_s = result.samples / result.train_seconds if result.train_seconds else 0.0
        if self.run_dir is not None:
            write_atomic(self.run_dir / "final.json", json.dumps(result.to_dict(), indent=2) + "\n")
        return result


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
    for i, batch in enumerate(itertools.islice(marked_batches(bound.train_batches(epoch), step_clock, timed), spe)):
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
