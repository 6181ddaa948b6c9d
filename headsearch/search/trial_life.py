"""A trial's life in a search: begun (its config, run directory, pruning, fair clock), then told how it ended.

Whatever trains it (alone, in a cohort, looked up in a table), a trial begins and ends here, so its record
(`headsearch.search.record`) is written the same way in a real search and in a simulated one.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import optuna
from optuna.exceptions import StorageInternalError
from optuna.trial import TrialState

from headsearch.analysis.tracking import diversity_callbacks
from headsearch.config import RunConfig
from headsearch.errors import ConfigError, Diverged, Terminated, device_fault, interruption
from headsearch.search.artifacts import write_trial_link
from headsearch.search.liveness import StorageUnavailable, finished_trial_error, retry_callback
from headsearch.search.record import arch_summary, record_result, resumes
from headsearch.search.trial_pruning import TrialPaused, TrialPruning
from headsearch.training.records import PAUSE, Callback

if TYPE_CHECKING:
    from headsearch.training.clock import AloneClock
    from headsearch.machine.fairtime import Seat
    from headsearch.search.definition import SearchDefinition
    from headsearch.search.scheduler import Scheduler
    from headsearch.search.study import StudyHandle


@dataclass
class TrialRun:
    """A trial being trained: its config, run directory, pruning callback and fair clock, and its TensorBoard
    writer (--tensorboard) if any."""

    trial: object
    cfg: RunConfig
    run_dir: Path
    pruning: TrialPruning
    clock: AloneClock
    tensorboard: Callback | None = None
    resume: bool = False  # it goes on from its paused trial's state (`resumes`), in that trial's run directory

    def trainer_callbacks(self, callbacks: Sequence[Callback] = ()) -> list[Callback]:
        """What its trainer (or cohort slot) is given: the TensorBoard writer first (so that it records the epoch
        a pruner stops at), the pruner, the diversity tracker, then `callbacks`."""
        return [*([self.tensorboard] if self.tensorboard else []), self.pruning, *diversity_callbacks(self.cfg),
                *callbacks]


class SearchCallback(Callback):
    """A trainer callback that also hears when each trial starts and ends (the CLI's live display), and each
    architecture's cost measured before the first trial (`headsearch.search.costs.ArchCost`)."""

    def on_cost(self, done: int, total: int, cost) -> None: ...
    def on_trial_start(self, number: int, cfg: RunConfig) -> None: ...
    def on_trial_end(self, number: int, state: str) -> None: ...


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class TrialLife:
    """Begins and ends a search's trials in this worker: their configs from the scheduler, their fair clocks on
    the worker's `seat` (its device), their ends told through the study handle and to the user's Optuna callbacks."""

    def __init__(self, definition: "SearchDefinition", scheduler: "Scheduler", handle: "StudyHandle", seat: "Seat",
                 optuna_callbacks: Sequence = ()):
        self.definition, self.scheduler, self.handle, self.seat = definition, scheduler, handle, seat
        self.optuna_callbacks = optuna_callbacks

    def begin(self, study, trial, callbacks: Sequence) -> "TrialRun | str":
        """A trial's config, run directory, pruning and fair clock, or the name of the state it ended in
        already ("REJECTED": an invalid config)."""
        s = self.definition
        trial.set_user_attr("worker", worker_name())
        try:
            cfg, recorded = self.scheduler.config_of(trial, self.seat.device)
        except ConfigError as e:
            # An invalid combination (e.g. a head count that does not divide a searched d_model, or a
            # model too big for the device): recorded as such, and never trained.
            trial.set_user_attr("rejected", str(e))
            study.tell(trial, state=TrialState.PRUNED)
            return "REJECTED"
        if not recorded:  # sampled under the lock, its config was written then
            trial.set_user_attr("config", cfg.to_dict())
        trial.set_user_attr("arch", arch_summary(cfg))
        paused = resumes(trial)
        first = trial.number if paused is None else self._run_of(study, paused)
        run_dir = Path(s.settings.run_root) / s.study_name / f"trial-{first:05d}"
        trial.set_user_attr("run_dir", str(run_dir.resolve()))
        earlier = self._go_on_from(study, trial, paused) if paused is not None else None
        for cb in callbacks:
            cb.on_trial_start(trial.number, cfg)
        _, curve_pruner = s.make_pruner()
        pruning = TrialPruning(study, trial, s.task.primary.name, curve_pruner, s.pruner_name(), not s.multi_objective,
                               epochs=cfg.train.epochs, store=self.handle.store_of(study), pause=s.settings.pruner_pause,
                               earlier=earlier)
        writer = None
        if s.settings.tensorboard is not None:
            from headsearch.training.tensorboard import TensorBoardWriter, trial_dir

            writer = TensorBoardWriter(trial_dir(s.settings.tensorboard, trial.number), hparams=trial.params)
        return TrialRun(trial, cfg, run_dir, pruning, self.alone_clock(study, trial, cfg), writer, paused is not None)

    def _run_of(self, study, number: int) -> int:
        """The first trial of the run that trial `number` belongs to (itself, unless it resumes another: a
        resumption may itself have been paused and resumed): the run directory is that trial's."""
        store = self.handle.store_of(study)
        while (earlier := resumes(store.frozen_trial(number))) is not None:
            number = earlier
        return number

    def _go_on_from(self, study, trial, number: int) -> dict[int, float]:
        """A resumption of paused trial `number` begins with that trial's record: its curve (each epoch's value,
        so the rules and the dashboard see the whole run), the epoch it goes on after, and what its first epoch
        measured (parameters, fair epoch seconds). Returns the curve."""
        store = self.handle.store_of(study)
        paused = store.frozen_trial(number)
        trial.set_user_attr("resumed_at", int(paused.user_attrs["paused"]["epoch"]))
        for key in ("params", "epoch_seconds_alone", "alone_key"):
            if key in paused.user_attrs:
                trial.set_user_attr(key, paused.user_attrs[key])
        curve = {int(e): float(v) for e, v in paused.intermediate_values.items()}
        for epoch, value in sorted(curve.items()):
            if self.definition.multi_objective:
                store.set_intermediate_value(trial.number, epoch, value)
            else:
                trial.report(value, epoch)
        return curve

    def alone_clock(self, study, trial, cfg: RunConfig) -> AloneClock:
        """The trial's fair clock on this worker's seat (`Seat.clock`), in the step mode it intends; the trial's
        `alone_key` names the mode once its steps are prepared (a fallback changes it)."""
        intended = self.seat.step_mode(cfg, self.definition.task)
        return self.seat.clock(study, cfg, intended, lambda key: trial.set_user_attr("alone_key", key))

    def end(self, study, run: TrialRun, result, error: BaseException | None, callbacks: Sequence,
            reraise: bool = True) -> str:
        """Tell the study how a trial ended: COMPLETE with its objectives (`result`), PRUNED, or FAIL with
        its reason. An interruption or an unexpected error is re-raised after the trial is told (unless
        `reraise` is False: a cohort telling its other trials first). Two endings are not told: the storage
        gone (`StorageUnavailable`, re-raised: the trial's heartbeat or lease stops and a resumed search
        retries it, so it is never recorded failed for good), and a trial another worker already gave up
        (this worker was paused past 3 heartbeats: its retry trains it again): "LOST"."""
        if run.tensorboard is not None:
            run.tensorboard.close()
        if isinstance(error, StorageUnavailable):
            raise error
        store = self.handle.store_of(study)
        try:
            if not store.frozen_trial(run.trial.number).state.is_finished():
                return self._tell(study, run, result, error, callbacks, reraise)
        except finished_trial_error():  # given up between the check and the tell
            pass
        finally:
            store.ended(run.trial.number)
        print(f"trial {run.trial.number} was failed by another worker while this one was paused (past 3 heartbeats):"
              " its result is dropped and its retry trains it again", file=sys.stderr, flush=True)
        for cb in callbacks:
            cb.on_trial_end(run.trial.number, "LOST")
        if reraise and error is not None and not isinstance(error, Exception):  # Ctrl-C still stops the worker
            raise error
        return "LOST"

    def _tell(self, study, run: TrialRun, result, error: BaseException | None, callbacks: Sequence,
              reraise: bool) -> str:
        s, trial, pruning = self.definition, run.trial, run.pruning
        state, values = TrialState.FAIL, None
        if error is None:
            values = [o.value(result) for o in s.objectives]
            record_result(trial, result)
            state = TrialState.COMPLETE
        elif isinstance(error, optuna.TrialPruned):
            trial.set_user_attr("epochs_run", len(pruning.curve))
            if isinstance(error, TrialPaused) and error.kept is not None:
                trial.set_user_attr("paused", {"epoch": max(pruning.curve), "checkpoint": error.kept})
            state = TrialState.PRUNED
        elif isinstance(error, Diverged) or out_of_gpu_memory(error):
            out_of_memory = out_of_gpu_memory(error)
            trial.set_user_attr("fail_reason", "out of GPU memory" if out_of_memory else str(error))
            trial.set_user_attr("epochs_run", len(pruning.curve))
            if out_of_memory:
                sys.modules["torch"].cuda.empty_cache()
        else:
            reason = fail_reason(error)
            # Retried: after Ctrl-C another process (a dashboard, a poller) may hold SQLite's lock for a moment,
            # and the interruption must not turn into a storage error that leaves the trial RUNNING.
            with_storage_retries(lambda: trial.set_user_attr("fail_reason", reason))
            with_storage_retries(lambda: study.tell(trial, state=TrialState.FAIL))
            if stopped_by_the_machine(error):  # its architecture goes first in the next run, as a dead worker's does
                frozen = self.handle.store_of(study).frozen_trial(trial.number)
                with_storage_retries(lambda: retry_callback()(study, frozen))
            if reraise:
                raise error
            return "FAIL"
        if run.run_dir.is_dir():  # lets `headsearch analyze` upload its figures to this trial
            write_trial_link(run.run_dir, s.settings.storage, s.study_name, trial.number)
        study.tell(trial, values=values, state=state)
        if run.resume and state == TrialState.COMPLETE:
            (run.run_dir / PAUSE).unlink(missing_ok=True)  # the run is whole: its pause can no longer matter
        for cb in callbacks:
            cb.on_trial_end(trial.number, state.name)
        self._call_optuna_callbacks(study, trial.number)
        return state.name

    def _call_optuna_callbacks(self, study, number: int) -> None:
        """The user's Optuna callbacks on the trial just told, as `study.optimize` calls them (an exception
        in one stops this worker, as it stops `optimize`)."""
        if not self.optuna_callbacks:
            return
        frozen = next(t for t in study.get_trials(deepcopy=True) if t.number == number)
        for callback in self.optuna_callbacks:
            callback(study, frozen)


def fail_reason(error: BaseException) -> str:
    """Why a trial failed, as its record keeps it: an interruption (Ctrl-C, SIGTERM) or a device fault (the
    device unusable, whatever trained on it: `headsearch.errors.device_fault`) is `interrupted (...)` and retried;
    any other error, `Type: message`, is for good (`headsearch.search.record.failed_for_good`)."""
    if isinstance(error, KeyboardInterrupt):
        return interruption(error)
    if (fault := device_fault(error)) is not None:
        return f"interrupted (device fault: {fault})"
    return f"{type(error).__name__}: {error}"


def stopped_by_the_machine(error: BaseException) -> bool:
    """Whether a trial was stopped by its machine, not by its user or its architecture: a scheduler's SIGTERM (a
    time limit, a preemption) or a device fault. Its architecture is re-enqueued (Optuna's retry callback, up to
    twice), so the next run trains it first, as it retries a dead worker's trial; after Ctrl-C the user chose to
    stop, and the sampler chooses again."""
    return isinstance(error, Terminated) or (isinstance(error, Exception) and device_fault(error) is not None)


def out_of_gpu_memory(error: BaseException) -> bool:
    """Whether `error` is torch's CUDA out-of-memory error, asked without importing torch: a worker that never
    trained (a light worker, trials looked up in a table) has no torch loaded and cannot have raised it."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(error, torch.cuda.OutOfMemoryError)


def with_storage_retries(write, attempts: int = 5, wait: float = 0.2):
    """`write()`, tried again (after `wait`, doubling) when the storage fails transiently (Optuna's
    StorageInternalError: e.g. SQLite locked by another reader); the last failure is raised."""
    for attempt in range(attempts):
        try:
            return write()
        except StorageInternalError:
            if attempt == attempts - 1:
                raise
            time.sleep(wait * 2**attempt)
