"""The scheduler: which trial a worker runs next, under the budget lock.

"Take the budget lock, count, ask" makes the trial budget exact across any number of workers on any
number of machines sharing one storage; the fence behind it (`Scheduler._fence`) keeps it exact when the
lock did not hold. An architecture some trial holds is never trained twice: a proposal of one is told FAIL
(`duplicate_of`) and the sampler asked again; who holds it is read again from the storage once the proposal's
config is written (`Scheduler._held_elsewhere`), so a worker whose count went stale while the lock did not hold
gives way to the trial another worker asked meanwhile. A dead worker's running trial is failed and retried
(`DeadTrials`).
"""
from __future__ import annotations

import contextlib
import random
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable

from optuna.trial import TrialState

from headsearch.config import RunConfig
from headsearch.errors import ConfigError, HeadsearchError
from headsearch.search.liveness import SilenceWatch, finished_trial_error, retry_callback
from headsearch.search.optuna_private import running_without_heartbeat, stale_trial_ids, trial_id
from headsearch.search.record import (arch_summary, config_key, counts_toward_budget, failed_for_good, is_paused,
                                      resumes)
from headsearch.search.storage import LockHold, budget_lock

if TYPE_CHECKING:
    from headsearch.search.architectures import SpaceArchitectures
    from headsearch.search.definition import SearchDefinition
    from headsearch.search.study import StudyHandle

WAIT = object()  # next_trial: the budget is held by running trials; ask again later
# Proposals of an architecture some trial holds that the sampler may make in a row before the search takes
# an architecture no trial holds itself (at random, seeded): each is a FAIL trial marked duplicate_of.
DUPLICATE_ASKS = 5
# Where no lock puts the workers' asks in one order (grpc://), a worker's sampler seeds are its count plus its own
# multiple of this stride (`Scheduler._seed_index`): seeded by the count alone, workers that read the same count
# propose the same architecture in lockstep. 64 light workers on grpc:// gave 629 duplicate proposals for 192
# trials, and 53 of them gave way six times in a row at the start and quit with no trial trained.
RACING_STRIDE = 100_000


class _OverBudget(Exception):
    """The trial just asked found the budget full in the storage's own order (`Scheduler._fence`)."""


class Scheduler:
    """Chooses this worker's next trial of a search's study (`handle`'s); keeps the configs it sampled for their
    trials. `make_sampler(trial_index)`: the search's sampler for the trial about to be asked."""

    def __init__(self, definition: "SearchDefinition", archs: "SpaceArchitectures", handle: "StudyHandle",
                 make_sampler: Callable[[int], Any]):
        self.definition, self.archs, self.handle, self.make_sampler = definition, archs, handle, make_sampler
        self.sampled: dict[int, RunConfig] = {}  # configs sampled under the budget lock, by trial number
        self.racing = False  # asking with no lock held (`LockHold.exclusive`): see RACING_STRIDE
        self._stride = RACING_STRIDE * random.SystemRandom().randrange(1, 1000)
        self.dead = DeadTrials(handle)
        # (study, trials, whether the budget is spent) -> the paused trial to resume now and why, or None
        # (--pruner-pause: `trial_pruning.resumable`, a `Resumption`)
        self.resumable: Callable[[Any, list, bool], Any] | None = None
        # Hears (seconds waited for the budget lock, seconds it was held) after every ask: a cluster's
        # measurements of the lock (benchmarks/cluster.py); None costs nothing.
        self.on_lock: Callable[[float, float], None] | None = None

    def next_trial(self, study):
        """The next trial to run under the budget lock, or None (the budget is spent, the space exhausted),
        or WAIT (running trials hold the rest)."""
        # A study adopted in this process (the simulator's, in memory) has no other worker to exclude: only a
        # storage URL's lock is taken, and a URL no storage scheme knows is refused there, never left unlocked.
        store = self.handle.store_of(study)
        lock = contextlib.nullcontext(LockHold("in memory")) if store.lock_url is None else budget_lock(store.lock_url, store.study_name)
        # The space's architectures, listed once per process before the lock rather than under it: 780 of them
        # took 0.36 s, which 64 workers starting together spent one after another inside the lock.
        self.archs.listing()
        asked = time.perf_counter()
        with lock as hold:
            held = time.perf_counter()
            self.racing = not hold.exclusive
            try:
                return self._next_trial_locked(study)
            finally:
                if self.on_lock is not None:
                    self.on_lock(held - asked, time.perf_counter() - held)

    def _next_trial_locked(self, study):
        with warnings.catch_warnings():
            # Optuna warns that heartbeats go with Study.optimize; ask/tell workers beat themselves (Heartbeat).
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            warnings.filterwarnings("ignore", message=".*fail_stale_trials is experimental")
            while True:
                try:
                    return self._next_trial_once(study)
                except _OverBudget:
                    continue  # another worker took the last place meanwhile: count again

    def _next_trial_once(self, study):
        s, trials_wanted = self.definition, self.definition.settings.trials
        while True:
            self.dead.fail(study)  # a dead worker's trial -> FAIL, re-enqueued as WAITING
            trials = study.get_trials(deepcopy=False)
            waiting = sum(1 for t in trials if t.state == TrialState.WAITING)
            # Failed trials do not count toward the budget; stop if they pile up (every config diverging).
            failed = sum(1 for t in trials if failed_for_good(t))
            if failed >= max(5, 2 * trials_wanted):
                raise HeadsearchError(
                    f"{failed} trials failed in study {s.study_name} (see their fail_reason with `headsearch report`):"
                    " fix the cause (e.g. a lower lr) before running more"
                )
            counted = sum(1 for t in trials if counts_toward_budget(t))
            spent = counted >= trials_wanted
            if waiting == 0 and self.resumable is not None and (go_on := self.resumable(study, trials, spent)) is not None:
                # Before any new trial (a promotion first, as in ASHA), and whether or not the budget has room: the
                # paused trial holds its place, and its resumption takes none.
                study.enqueue_trial(go_on.trial.params, user_attrs={"resumes": go_on.trial.number,
                                                                     "resumed_because": go_on.because})
                continue
            running = any(t.state == TrialState.RUNNING for t in trials)
            # Nothing left to ask: running trials hold the rest. With heartbeats (leases on a journal), wait for
            # them: one may belong to a dead worker and come back as a retry (or fail and free its place). With
            # paused trials, wait too: what the running ones show may let the rule resume one.
            any_paused = self.resumable is not None and any(is_paused(t) for t in trials)
            done = WAIT if running and (self.handle.store_of(study).tells_dead_workers or any_paused) else None
            if waiting == 0 and spent:
                return done
            next_point = getattr(s.space, "next_point", None)  # a grid that says which point comes next
            if next_point is not None and waiting == 0:
                point = next_point(trials)
                if point is None:  # every point is held, by finished runs or running ones
                    return done
                study.enqueue_trial(point)
            if next_point is not None or waiting:  # a grid's point, or an enqueued one (a retry, a warm start)
                study.sampler = self.make_sampler(self._seed_index(len(trials)))
                trial = self._ask(study)
                if next_point is not None or self._unless_held(study, trial) is not None:
                    return trial
                continue  # an enqueued architecture that a trial holds already: told FAIL, not trained
            return self._ask_unheld(study, trials, done)

    def _ask_unheld(self, study, trials: list, done):
        """A new trial whose architecture no trial holds (`holds_architecture`), its config sampled and kept
        (under the budget lock, so two workers never start the same one). A proposal of a held architecture
        is told FAIL with user_attr duplicate_of (neither trained nor counted) and the sampler is asked again,
        reseeded; after DUPLICATE_ASKS such proposals in a row the search takes an architecture no trial holds.
        `done` (None, or WAIT while trials run) when every architecture of the space is held; WAIT when, with no
        lock held, other workers took that one too (at the start of a search, dozens asking at once): ask again
        later rather than stop."""
        trials = list(trials)
        if self.archs.exhausted(trials):
            return done
        for attempt in range(DUPLICATE_ASKS + 1):
            if attempt == DUPLICATE_ASKS:
                point = self.archs.untried_point(trials, self._seed_index(len(trials)))
                if point is None:  # a space too big to list kept giving held points: stop this worker
                    return done
                study.enqueue_trial(point)
            study.sampler = self.make_sampler(self._seed_index(len(trials)))
            trial = self._ask(study)
            if self._unless_held(study, trial) is not None:
                return trial
            trials.append(self.handle.store_of(study).frozen_trial(trial.number))
        # Under a lock the unheld point is nobody else's: reached only when workers asking at once without one took
        # it too, and the space has architectures left.
        return WAIT

    def _seed_index(self, count: int) -> int:
        """The index a sampler (or the unheld point) is seeded with: the trials counted, so that a search replays
        the same way; plus this worker's own stride when no lock orders the asks (RACING_STRIDE)."""
        return count + self._stride if self.racing else count

    def _ask(self, study):
        """`study.ask()`, its first heartbeat (or lease) recorded at once, under the budget lock, then fenced."""
        trial = study.ask()
        self.handle.store_of(study).beat(trial.number)
        if resumes(trial) is None:  # a resumption takes no place of the budget
            self._fence(study, trial)
        return trial

    def _fence(self, study, trial) -> None:
        """Make the budget exact whatever happened to the lock: if the trials created before `trial`, in the
        storage's own order, already fill the budget, `trial` is told FAIL as over-budget (never trained, not
        counted, holds no architecture) and `_OverBudget` raised. Every worker sees the same order, so whoever
        asked last backs off: a worker paused past its lock's silence limit, a broken lock, a symlinked path
        that got a second lock, an NFS client caching a lock file's time, enqueued trials beyond --trials."""
        # Trial ids, not numbers: an id is the storage's order of creation (a database's key, a journal's
        # record), where two trials created at once on a database without the lock could share a number.
        mine = trial_id(trial)
        before = sum(1 for t in study.get_trials(deepcopy=False) if trial_id(t) < mine and counts_toward_budget(t))
        if before < self.definition.settings.trials:
            return
        trial.set_user_attr("over_budget", before)
        study.tell(trial, state=TrialState.FAIL)
        self.handle.store_of(study).ended(trial.number)
        raise _OverBudget

    def _unless_held(self, study, trial):
        """`trial`, its config sampled and kept for its beginning; or None when another trial holds its
        architecture already (`_held_elsewhere`): then it is told FAIL with user_attr duplicate_of (neither
        trained nor counted). A config that cannot be built is returned as is (its beginning rejects it and
        says why)."""
        try:
            cfg = self.archs.sample_config(trial, self.definition.device)
        except ConfigError:
            return trial
        config = cfg.to_dict()
        trial.set_user_attr("config", config)
        # A resumption holds its architecture with its paused trial, whose run it goes on with.
        holder = self._held_elsewhere(study, trial, config_key(config)) if resumes(trial) is None else None
        if holder is None:
            self.sampled[trial.number] = cfg
            return trial
        trial.set_user_attr("duplicate_of", holder.number)
        trial.set_user_attr("arch", arch_summary(cfg))
        study.tell(trial, state=TrialState.FAIL)
        return None

    def _held_elsewhere(self, study, trial, key: str):
        """The trial besides `trial` that holds the architecture `key`, the earliest in the storage's own order
        (trial ids, as in `_fence`), or None. Read again from the storage once `trial`'s config is written, not
        taken from the trials counted under the lock: those are stale when the lock did not hold (a worker
        paused past its silence limit counted before another worker broke its lock and asked; both seed their
        samplers with the same count and propose the same architecture). Two workers proposing one architecture
        at once each write their config before they read, so the later reader sees the other's: it gives way to
        an earlier trial (the paused worker's is the later one), and to a later one too, whose worker read
        before this config was written and so went on. Every worker reads the same trials in the same order,
        so the architecture is never trained twice; at worst both give way and ask again, which costs an ask,
        not a place of the budget. While the lock holds no later trial exists yet, so this is the check under
        the lock. One extra read per ask."""
        mine = trial_id(trial)
        others = sorted((t for t in study.get_trials(deepcopy=False) if trial_id(t) != mine), key=trial_id)
        return self.archs.holder(others, key)

    def config_of(self, trial, device) -> tuple[RunConfig, bool]:
        """The config sampled for `trial` under the lock (recorded already: True), or sampled now (False;
        ConfigError if invalid)."""
        cfg = self.sampled.pop(trial.number, None)
        return (cfg, True) if cfg is not None else (self.archs.sample_config(trial, device), False)


class DeadTrials:
    """Fails the RUNNING trials of dead workers, each re-enqueued as WAITING (Optuna's retry callback, up to
    twice): on a database, Optuna's stale heartbeats, and trials that never recorded one (a worker killed
    between `ask` and its first heartbeat); where the storage's row keeps leases (a journal file, a Redis journal),
    trials whose lease was not renewed. Silence is judged over 3 heartbeats of this worker's own clock."""

    def __init__(self, handle: "StudyHandle"):
        self.handle = handle
        self._silence: SilenceWatch | None = None  # running trials without a sign of life, as this worker saw them

    def fail(self, study) -> None:
        store = self.handle.store_of(study)
        if not store.tells_dead_workers:
            return
        if self._silence is None:
            self._silence = SilenceWatch(3 * store.heartbeat)
        if store.heartbeats:
            # Optuna's own test (`fail_stale_trials`), with a reason recorded: a heartbeat older than the grace
            # period by the database's clock.
            for stale in stale_trial_ids(store.storage, store.study_id):
                self._give_up(study, stale, "interrupted (its heartbeat stopped: its worker died or lost the storage)")
            ids = running_without_heartbeat(store.storage, store.study_id)
            reason = "interrupted (its worker stopped before its first heartbeat)"
            silent = self._silence.silent({("id", i): None for i in ids})
            dead = [i for _, i in silent]
        else:
            running = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]
            reason = "interrupted (its worker stopped renewing its lease)"
            silent = self._silence.silent({("lease", t.number): store.leases.read(t.number) for t in running})
            dead = [store.trial_id(n) for _, n in silent]
        for key, dead_id in zip(silent, dead):
            self._silence.forget(key)
            self._give_up(study, dead_id, reason)

    def _give_up(self, study, dead_id: int, reason: str) -> None:
        """Tell a dead worker's trial FAIL with `reason` (not counted, holds no architecture) and retry it."""
        store = self.handle.store_of(study)
        try:
            store.storage.set_trial_user_attr(dead_id, "fail_reason", reason)
            if not store.storage.set_trial_state_values(dead_id, state=TrialState.FAIL):
                return
        except finished_trial_error():  # it ended meanwhile (its worker was alive after all)
            return
        frozen = store.storage.get_trial(dead_id)
        store.ended(frozen.number)
        retry_callback()(study, frozen)



def enqueue_first(study, params) -> list[int]:
    """Put architectures first (Optuna's `enqueue_trial`: a warm start from known ones, e.g. the papers'),
    each unless a trial of the study already has its parameters (a resumed search enqueues nothing twice).
    Returns the indices in `params` that were enqueued."""
    have = [t.params for t in study.get_trials(deepcopy=False)]
    out = []
    for i, p in enumerate(params):
        if p not in have:
            study.enqueue_trial(p)
            have.append(p)
            out.append(i)
    return out


def enqueued_beyond_budget(study, trials: int) -> str | None:
    """Said with the plan, before any trial, when the trials waiting to run (`--enqueue`'s architectures, a
    resumed study's retries) are more than the places `trials` (--trials) leaves: the extra ones are fenced
    (`Scheduler._fence`), never trained, and the user should know before the search, not from the report."""
    all_trials = study.get_trials(deepcopy=False)
    waiting = sum(1 for t in all_trials if t.state == TrialState.WAITING)
    taken = sum(1 for t in all_trials if counts_toward_budget(t)) - waiting
    room = max(0, trials - taken)
    if waiting <= room:
        return None
    left = f"--trials {trials}" if taken == 0 else f"the {room} place{'s' * (room != 1)} --trials {trials} leaves ({taken} taken)"
    return (f"{waiting} architectures enqueued, more than {left}: {room} will run and {waiting - room} will not;"
            f" raise --trials to {taken + waiting} to train them all")

