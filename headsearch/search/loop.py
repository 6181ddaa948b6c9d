"""The search's one loop, over any backend (`headsearch.search.backends`): real and simulated trials alike.

    while the budget or the time lasts:
        fill the free slots: next trial (the scheduler, under the budget lock) -> begin it -> add it
        train an epoch -> tell each trial that ended

A plain worker's backend has one slot that trains its trial to the end; a cohort's has K slots trained an
epoch at a time; the simulator's looks each epoch up in a table. Asking, sampling, skipping duplicates,
ending an exhausted space, the pruner's decisions and telling are this loop's either way, so a replay
makes the decisions a real search makes.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

from headsearch.errors import device_fault
from headsearch.search.backends import SoloBackend
from headsearch.search.liveness import Heartbeat
from headsearch.search.scheduler import WAIT, Scheduler
from headsearch.search.trial_life import TrialLife, worker_name

if TYPE_CHECKING:
    from headsearch.search.definition import WorkerContext
    from headsearch.search.settings import SearchSettings
    from headsearch.search.study import StudyHandle


def wait_seconds(heartbeat: int | None) -> float:
    """How long a worker waits before counting again while running trials hold the rest of the budget:
    a tenth of the silence after which a dead worker's trial is failed, between 1 and 10 seconds."""
    return min(10.0, max(1.0, 0.3 * (heartbeat or 10)))


class TrialLoop:
    """Runs a search's trials in `study` on `backend` until the budget is spent, the space exhausted or
    --timeout passed: the scheduler's next trial, begun and ended by `life`, on this worker's `context` (data,
    seat). A trial the backend refuses (a cohort: another stack signature) trains alone at once."""

    def __init__(self, settings: "SearchSettings", scheduler: Scheduler, life: TrialLife, context: "WorkerContext",
                 handle: "StudyHandle", study, backend: Any, callbacks: Sequence = (), argv: list[str] | None = None):
        self.settings, self.scheduler, self.life, self.context, self.handle = settings, scheduler, life, context, handle
        self.study, self.backend, self.device = study, backend, context.seat.device
        self.callbacks, self.argv = callbacks, argv
        self.beats: dict[int, Heartbeat] = {}  # the running trials' heartbeats, by slot

    def run(self) -> None:
        settings, backend = self.settings, self.backend
        start, exhausted = time.monotonic(), False
        try:
            while True:
                timed_out = settings.timeout is not None and time.monotonic() - start >= settings.timeout
                while backend.free and not exhausted and not timed_out:
                    trial = self.scheduler.next_trial(self.study)
                    if trial is None:
                        exhausted = True
                    elif trial is WAIT:
                        if backend.occupied:
                            break  # train the trials at hand; ask again after their epoch
                        time.sleep(wait_seconds(settings.heartbeat))
                    else:
                        self._join(trial)
                if not backend.occupied:
                    if exhausted or timed_out:
                        return
                    continue
                self._train_epoch(backend, self.beats)
        except BaseException as e:
            self._interrupt(e)
            raise

    def _train_epoch(self, backend, beats: dict) -> None:
        for end in backend.train_epoch():
            beats.pop(end.slot).__exit__(None, None, None)
            try:
                self.life.end(self.study, end.tag, end.result if end.error is None else None, end.error,
                              self.callbacks)
            finally:
                end = None  # a pruned trial's traceback holds its model: let it go before the next trial begins
            self.context.current_trial = None  # kept while an error propagates: the worker's failure line names it

    def _interrupt(self, e: BaseException) -> None:
        """Tell every trial still in a slot how it ended: as it ended if it had, else interrupted (by a device
        fault too: as the device failed every trial on it, not the one whose step saw it first)."""
        stopped = e if isinstance(e, KeyboardInterrupt) or device_fault(e) else RuntimeError(
            f"the cohort's worker stopped: {type(e).__name__}: {e}")
        for end in self.backend.interrupt():
            self.beats.pop(end.slot).__exit__(None, None, None)
            error = stopped if end.result.status == "interrupted" else end.error
            self.life.end(self.study, end.tag, end.result if error is None else None, error, self.callbacks,
                          reraise=False)

    @staticmethod
    def _resume_refusal(run, backend) -> str | None:
        """Why `backend` cannot take the resumption `run` (a cohort: it starts every slot from the beginning)."""
        if run.resume and not backend.resumes:
            return "a resumption trains alone: a cohort starts its trials from the beginning"
        return None

    def _join(self, trial) -> None:
        """Begin `trial` and put it in a free slot of the backend, or train it alone now if it cannot join."""
        run = self.life.begin(self.study, trial, self.callbacks)
        if isinstance(run, str):
            return
        backend = self.backend
        if (why := backend.refusal(run.cfg) or self._resume_refusal(run, backend)) is not None:
            trial.set_user_attr("cohort", {"size": 1, "why": why})
            backend = SoloBackend(self.device)
        solo = isinstance(backend, SoloBackend)
        if solo:
            self.context.current_trial = trial.number
        store = self.handle.store_of(self.study)
        beat = Heartbeat(lambda: store.beat(trial.number), self.settings.heartbeat).__enter__()
        try:
            bound = self.context.data.bound_for(run.cfg, self.device) if backend.needs_data else None
            slot = backend.add(run.cfg, bound, run.run_dir, argv=self.argv, clock=run.clock, tag=run,
                               callbacks=run.trainer_callbacks(self.callbacks), resume=run.resume)
        except BaseException as e:
            beat.__exit__(None, None, None)
            self.context.current_trial = None
            self.life.end(self.study, run, None, e, self.callbacks)
            return
        if backend is not self.backend:  # refused by the cohort: trained alone now, beside it
            self._train_epoch(backend, {slot: beat})
            return
        self.beats[slot] = beat
        if not solo:
            trial.set_user_attr("cohort", {"size": backend.size, "slot": slot, "worker": worker_name()})

