"""The Optuna study of a search: its sampler, and creating it or loading it to resume.

A study carries its search in the user attribute `headsearch` (task, space, objectives, base config,
sampler, pruner, ...). Running the same command again loads the study and resumes it; a study of
the same name with a different task, objectives, base config or space is refused, except for the
fields of `EXECUTION_ONLY`, which change how a trial runs and not what it computes.
"""
from __future__ import annotations

import importlib.util
import re
import warnings
from typing import Any, Mapping, Sequence

from headsearch.config import stable_key
from headsearch.errors import ConfigError, HeadsearchError
from headsearch.search.liveness import open_patiently, patient, trial_leases

# How a trial runs, not what it computes: a study may be resumed with --compile on or off.
EXECUTION_ONLY = {"train": ("compile", "channels_last")}
COMPARED = ("task", "objectives", "base_config", "space")  # what a resumed study must keep


def default_sampler(requested: str | None, n_objectives: int) -> str:
    """The sampler's name: the one requested, else NSGA-II for several objectives and TPE for one."""
    return requested or ("nsga2" if n_objectives > 1 else "tpe")


# Optuna's GPSampler takes several objectives from Optuna 4.4 on; older ones raise at its first sample.
GP_MULTI_OBJECTIVE = (4, 4)


def release(version: str) -> tuple[int, ...]:
    """'4.0.0' -> (4, 0, 0); '2.11.0+cu130' -> (2, 11, 0); '5.0.0rc1' -> (5, 0, 0)."""
    head = re.match(r"\d+(?:\.\d+){0,2}", version)  # the release's first numbers, up to three
    return tuple(int(part) for part in head.group().split(".")) if head else ()


def check_sampler(name: str, n_objectives: int) -> None:
    """Refuse, in one line and before any study exists, a sampler the installed Optuna cannot run."""
    import optuna

    if name == "gp" and importlib.util.find_spec("scipy") is None:  # Optuna's GPSampler fits with SciPy
        raise ConfigError("--sampler gp needs scipy, which is not installed: pip install scipy, or use another --sampler")
    if name == "gp" and n_objectives > 1 and release(optuna.__version__) < GP_MULTI_OBJECTIVE:
        raise ConfigError(f"--sampler gp with {n_objectives} objectives needs optuna >= 4.4 (installed:"
                          f" {optuna.__version__}): upgrade optuna, or use --sampler nsga2 or tpe")


def _nsga2(seed: int, trials: int, curve_direction: str | None):
    import optuna

    # A population of 50 would spend a 50-trial budget on one random generation.
    return optuna.samplers.NSGAIISampler(population_size=max(4, min(50, trials // 4)), seed=seed)


def _tpe(seed: int, trials: int, curve_direction: str | None):
    import optuna

    tpe = optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True)
    return CurveDirection(tpe, curve_direction) if curve_direction else tpe


def _seeded(sampler: str):
    """The builder of Optuna's sampler class `sampler`, given the seed alone."""
    def build(seed: int, trials: int, curve_direction: str | None):
        import optuna

        return getattr(optuna.samplers, sampler)(seed=seed)
    return build


# The samplers by name: a row each, built by `make_sampler`. "cost", the cost-aware sampler
# (`headsearch.search.cost_sampler`), has no builder here: `Search.make_sampler` builds it from the costs
# measured before training (`headsearch.search.costs`).
SAMPLERS = {"nsga2": _nsga2, "tpe": _tpe, "random": _seeded("RandomSampler"), "gp": _seeded("GPSampler"), "cost": None}


def make_sampler(name: str, *, seed: int, trials: int, trial_index: int = 0, curve_direction: str | None = None):
    """The sampler `name` (a row of `SAMPLERS`), seeded by the search's seed and the index of the trial
    about to start (counted under the budget lock), so workers started anywhere propose different
    points and a search replays the same way. `curve_direction`: in a study of several objectives, the
    direction of the curve headsearch records as intermediate values (the primary metric), which TPE
    needs to rank pruned trials (`CurveDirection`). A name without a row is refused (KeyError; `--sampler` is
    checked once, in `headsearch.search.settings`), never sampled at random."""
    if SAMPLERS[name] is None:
        raise ValueError("the cost-aware sampler needs the measured costs: Search.make_sampler builds it")
    return SAMPLERS[name](sampler_seed(seed, trial_index), trials, curve_direction)


def sampler_seed(seed: int, trial_index: int) -> int:
    """The seed of the sampler for trial `trial_index` of a search seeded `seed`: apart for every trial, and within
    the 32 bits numpy's generators take (a search seeded 123456 stopped at its first ask with numpy's "Seed must
    be between 0 and 2**32 - 1"); the same as before for every seed that worked."""
    return (seed * 100_003 + trial_index) % 2**32


class CurveDirection:
    """TPE for a study of several objectives whose pruned trials carry a curve.

    TPE ranks a pruned trial by its last intermediate value in `study.direction`, which a study of several
    objectives refuses to give (RuntimeError at the first sample after a pruned trial): Optuna's own
    `Trial.report` refuses intermediate values there, so TPE never meets them, but headsearch records each
    epoch's primary metric through the storage. This sampler hands TPE a view of the study whose
    `direction` is that curve's; everything else is the study's own. Complete trials are still ranked on
    every objective (TPE's non-dominated split)."""

    def __init__(self, sampler, direction: str) -> None:
        import optuna

        self.sampler = sampler
        self.direction = optuna.study.StudyDirection.MAXIMIZE if direction == "maximize" else optuna.study.StudyDirection.MINIMIZE

    def _view(self, study):
        return _StudyWithDirection(study, self.direction) if len(study.directions) > 1 else study

    def infer_relative_search_space(self, study, trial):
        return self.sampler.infer_relative_search_space(self._view(study), trial)

    def sample_relative(self, study, trial, search_space):
        return self.sampler.sample_relative(self._view(study), trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.sampler.sample_independent(self._view(study), trial, param_name, param_distribution)

    def before_trial(self, study, trial) -> None:
        self.sampler.before_trial(self._view(study), trial)

    def after_trial(self, study, trial, state, values) -> None:
        self.sampler.after_trial(self._view(study), trial, state, values)

    def reseed_rng(self) -> None:
        self.sampler.reseed_rng()


class _StudyWithDirection:
    """`study` with `direction` answered (see `CurveDirection`)."""

    def __init__(self, study, direction) -> None:
        self._study, self.direction = study, direction

    def __getattr__(self, name: str):
        return getattr(self._study, name)


class StudyStorage:
    """The storage a study lives in and the study's id there, held by whoever opened the storage.

    Optuna's public API gives neither back (`Study._storage`, `Study._study_id` and `Trial._trial_id`
    are private), so headsearch keeps the storage object it opened (`open_study`; the simulator's
    in-memory one) and finds ids through the storage's public methods (`BaseStorage.get_study_id_from_name`,
    `get_trial_id_from_study_id_trial_number`: Optuna 4.0 on). Used where `Trial` has no method:
    heartbeats, intermediate values of a multi-objective trial (`Trial.report` refuses them), a trial's
    frozen record right after it was told.
    """

    def __init__(self, storage, study_name: str, leases=None, heartbeat: int | None = None,
                 lock_url: str | None = None) -> None:
        self.storage, self.study_name = storage, study_name
        # The storage URL whose budget lock guards the study; None for a study made in this process (the
        # simulator's, in memory): no other worker to exclude.
        self.lock_url = lock_url
        self.study_id = storage.get_study_id_from_name(study_name)
        self._ids: dict[int, int] = {}  # trial number -> trial id (fixed once the trial exists)
        self.leases = leases  # TrialLeases where the storage's row keeps leases (a journal, grpc://), or None
        self.heartbeat = heartbeat  # seconds between a running trial's heartbeats or lease renewals (None: none)

    @property
    def heartbeats(self) -> bool:
        """Whether the storage records heartbeats: Optuna's RDBStorage, which a row of liveness "heartbeats" opens
        (`open_rdb_storage`), with `--heartbeat` on (journal and in-memory storages have none)."""
        return hasattr(self.storage, "record_heartbeat") and bool(self.storage.get_heartbeat_interval())

    @property
    def tells_dead_workers(self) -> bool:
        """Whether a dead worker's RUNNING trial is found and retried on this storage: heartbeats on a database,
        leases on a journal (a waiting worker waits for them; without, it stops when only running trials are left)."""
        return self.heartbeats or (self.leases is not None and bool(self.heartbeat))

    def beat(self, number: int) -> None:
        """A sign of life for running trial `number`: its heartbeat, or its lease renewed."""
        if self.heartbeats:
            self.storage.record_heartbeat(self.trial_id(number))
        elif self.leases is not None and self.heartbeat:
            self.leases.renew(number)

    def ended(self, number: int) -> None:
        """Trial `number` is over (told, or given up): its lease goes."""
        if self.leases is not None:
            self.leases.release(number)

    def trial_id(self, number: int) -> int:
        if number not in self._ids:
            self._ids[number] = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)
        return self._ids[number]

    def frozen_trial(self, number: int):
        """The trial numbered `number` as the storage holds it now (a `FrozenTrial`)."""
        return self.storage.get_trial(self.trial_id(number))

    def set_intermediate_value(self, number: int, step: int, value: float) -> None:
        """What `Trial.report` writes, for a multi-objective trial (where `Trial.report` refuses)."""
        self.storage.set_trial_intermediate_value(self.trial_id(number), step, value)

    def system_attrs(self) -> dict[str, Any]:
        return self.storage.get_study_system_attrs(self.study_id)


def open_study(storage_url: str, heartbeat: int | None, study_name: str, *, metric_names: Sequence[str],
               directions: Sequence[str], attrs: Mapping[str, Any], sampler, pruner, patience: float | None = None):
    """Create the study, or load it and check it is the same search (`attrs`: its `headsearch` attributes).
    Returns (the study, its `StudyStorage`). For an RDB storage the study reads through Optuna's cache of
    finished trials around the same `RDBStorage`; writes go straight to the database either way. The storage
    is patient (headsearch.search.liveness): an unreachable storage is waited for up to `patience` seconds, and so
    is a database that refuses this worker's connection for having too many when it is opened."""
    import optuna

    storage = patient(open_patiently(storage_url, heartbeat, patience), storage_url, patience)
    study = optuna.create_study(storage=storage, study_name=study_name, directions=list(directions),
                                sampler=sampler, pruner=pruner, load_if_exists=True)
    stored = study.user_attrs.get("headsearch")
    if stored is None:
        study.set_user_attr("headsearch", dict(attrs))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*set_metric_names")
            study.set_metric_names(list(metric_names))
    else:
        check_same_search(stored, attrs, study_name, storage_url)
    leases = trial_leases(storage_url, study_name, storage)
    return study, StudyStorage(storage, study_name, leases=leases, heartbeat=heartbeat, lock_url=storage_url)


class StudyHandle:
    """This process's one study: the storage it was opened on (`store`, set by `Search.open` or `Search.adopt`),
    handed to the units that read or write where Optuna's `Trial` has no method (`StudyStorage`)."""

    def __init__(self) -> None:
        self.store: StudyStorage | None = None

    def store_of(self, study) -> StudyStorage:
        if self.store is None or self.store.study_name != study.study_name:
            raise RuntimeError(f"study {study.study_name} was not opened by this search: use Search.open(),"
                               " or Search.adopt(study, storage) for a study made elsewhere")
        return self.store


def check_same_search(stored: Mapping[str, Any], mine: Mapping[str, Any], study_name: str, storage_url: str) -> None:
    for key in COMPARED:
        if _comparable(key, stored[key]) != _comparable(key, mine[key]):
            raise HeadsearchError(
                f"study {study_name} exists in {storage_url} with a different {key}:"
                f" pass another --study to start a new search (or the original settings to resume)"
            )


def _comparable(key: str, value: Any) -> str:
    if key == "base_config" and isinstance(value, dict):
        value = {section: ({k: v for k, v in fields.items() if k not in EXECUTION_ONLY.get(section, ())}
                           if isinstance(fields, dict) else fields) for section, fields in value.items()}
    return stable_key(value)
