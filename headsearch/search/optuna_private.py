"""Optuna's (and optuna-dashboard's) private names, in this one module: what headsearch reads that their public
API does not give, each behind a function saying why. tests/test_optuna_private.py runs every one on the
declared floor (`make test-oldest`) and the newest release, and checks that no other module names them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

# What Optuna's cache in front of a database storage calls (private, Optuna 4.0 to 5.0), and its stale-heartbeat
# query: the storage calls `liveness.patient` retries besides the public ones.
PRIVATE_STORAGE_CALLS = ("_get_stale_trial_ids", "_create_new_trial", "_get_best_trial_id", "_get_trials",
                         "_set_trial_param")


def trial_id(trial) -> int:
    """A trial's id (a `Trial`'s or a `FrozenTrial`'s): the storage's order of creation, which the budget's
    fence compares (two trials created at once without the lock could share a number, never an id)."""
    return trial._trial_id


def stale_trial_ids(storage, study_id: int) -> list[int]:
    """Optuna's own test of a heartbeat older than its grace period (`fail_stale_trials`' query), without
    failing the trials, so that headsearch records why."""
    return storage._get_stale_trial_ids(study_id)


def inner_backend(storage):
    """The backend a storage wraps (a journal's file or Redis backend; the RDB storage inside Optuna's cache in
    front of a database), or None."""
    return getattr(storage, "_backend", None)


def running_without_heartbeat(storage, study_id: int) -> list[int]:
    """Ids of the study's RUNNING trials with no heartbeat record in Optuna's tables (an RDB storage, or the
    cache in front of one): a worker killed between `ask` and its first heartbeat leaves one."""
    import sqlalchemy as sa

    engine = getattr(storage, "engine", None) or getattr(inner_backend(storage), "engine", None)
    if engine is None:
        return []
    query = sa.text("SELECT t.trial_id FROM trials t LEFT JOIN trial_heartbeats h ON h.trial_id = t.trial_id"
                    " WHERE t.study_id = :s AND t.state = 'RUNNING' AND h.trial_id IS NULL")
    with engine.connect() as conn:
        return [row[0] for row in conn.execute(query, {"s": study_id})]


def study_storage(study) -> tuple[Any, int]:
    """(the storage, the study's id) of an `optuna.Study`: what `optuna_dashboard.save_note` reads of it."""
    return study._storage, study._study_id


@dataclass
class TrialNoteTarget:
    """What `optuna_dashboard.save_note` reads of an `optuna.Trial` (its storage, study and trial id), for a
    finished trial: making it an `optuna.Trial` again would run the sampler's `before_trial` on it."""

    storage: Any
    study: Any
    _trial_id: int


def note_body(system_attrs: dict, trial_id: int | None) -> str:
    """The dashboard note's text stored in `system_attrs` for a trial (or the study: None)."""
    from optuna_dashboard._note import get_note_from_system_attrs

    return get_note_from_system_attrs(system_attrs, trial_id)["body"]


def compute_hypervolume(points: Sequence[Sequence[float]], reference: Sequence[float]) -> float:
    """Optuna's hypervolume (`optuna._hypervolume`; its WFG class before 4.1) of minimised points."""
    import numpy as np

    points, reference = np.asarray(points, dtype=float), np.asarray(reference, dtype=float)
    try:
        from optuna._hypervolume import compute_hypervolume as optuna_hypervolume
    except ImportError:  # Optuna before 4.1
        from optuna._hypervolume import WFG

        return float(WFG().compute(points, reference))
    return float(optuna_hypervolume(points, reference))
