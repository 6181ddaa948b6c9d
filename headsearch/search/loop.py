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

from headsearch.search.backends import SoloBackend
from headsearch.search.liveness import Heartbeat
from headsearch.search.scheduler import WAIT
from headsearch.search.trial_life import worker_name

if TYPE_CHECKING:
    from headsearch.search.runner import Search


class TrialLoop:
    """Runs `search`'s trials in `study` on `backend` until the budget is spent, the space exhausted or
    --timeout passed. A trial the backend refuses (a cohort: another stack signature) trains alone at once."""

    def __init__(self, search: "Search", study, backend: Any, device, callbacks: Sequence = (),
                 argv: list[str] | None = None):
        self.search, self.study, self.backend, self.device = search, study, backend, device
        self.callbacks, self.argv = callbacks, argv
        self.beats: dict[int, Heartbeat] = {}  # the running trials' heartbeats, by slot

    def run(self) -> None:
        s, backend = self.search, self.backend
        start, exhausted = time.monotonic(), False
        try:
            while True:
                timed_out = s.settings.timeout is not None and time.monotonic() - start >= s.settings.timeout
                while backend.free and not exhausted and not timed_out:
                    trial = s.scheduler.next_trial(self.study)
                    if trial is None:
                        exhausted = True
                    elif trial is WAIT:
                        if backend.occupied:
                            break  # train the trials at hand; ask again after their epoch
                        time.sleep(s.wait_seconds())
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
                self.search.life.end(self.study, end.tag, end.result if end.error is None else None, end.error,
                                     self.callbacks)
            finally:
                end = None  # a pruned trial's traceback holds its model: let it go before the next trial begins
            self.search.current_trial = None  # kept while an error propagates: the worker's failure line names it

    def _interrupt(self, e: BaseException) -> None:
        """Tell every trial still in a slot how it ended: as it ended if it had, else interrupted."""
        stopped = e if isinstance(e, KeyboardInterrupt) else RuntimeError(
            f"the cohort's worker stopped: {type(e).__name__}: {e}")
        for end in self.backend.interrupt():
            self.beats.pop(end.slot).__exit__(None, None, None)
            error = stopped if end.result.status == "interrupted" else end.error
            self.search.life.end(self.study, end.tag, end.result if error is None else None, error, self.callbacks,
                                 reraise=False)

    def _join(self, trial) -> None:
        """Begin `trial` and put it in a free slot of the backend, or train it alone now if it cannot join."""
        s = self.search
        run = s.life.begin(self.study, trial, self.device, self.callbacks)
        if isinstance(run, str):
            return
        backend = self.backend
        if (why := backend.refusal(run.cfg)) is not None:
            trial.set_user_attr("cohort", {"size": 1, "why": why})
            backend = SoloBackend(self.device)
        solo = isinstance(backend, SoloBackend)
        if solo:
            s.current_trial = trial.number
        beat = Heartbeat(lambda: s.store_of(self.study).beat(trial.number), s.settings.heartbeat).__enter__()
        try:
            bound = s.data.bound_for(run.cfg, self.device) if backend.needs_data else None
            slot = backend.add(run.cfg, bound, run.run_dir, argv=self.argv, clock=run.clock, tag=run,
                               callbacks=run.trainer_callbacks(self.callbacks))
        except BaseException as e:
            beat.__exit__(None, None, None)
            s.current_trial = None
            s.life.end(self.study, run, None, e, self.callbacks)
            return
        if backend is not self.backend:  # refused by the cohort: trained alone now, beside it
            self._train_epoch(backend, {slot: beat})
            return
        self.beats[slot] = beat
        if not solo:
            trial.set_user_attr("cohort", {"size": backend.size, "slot": slot, "worker": worker_name()})

