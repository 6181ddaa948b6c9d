"""Optuna's private names are read in one module (headsearch/search/optuna_private.py); each use works on the
installed release, the floor's included (`make test-oldest`), on real storages."""
import re
import time
import warnings
from pathlib import Path

import optuna
import pytest

from headsearch.search import optuna_private as private

pytestmark = pytest.mark.floor
PACKAGE = Path(__file__).resolve().parents[1] / "headsearch"
PRIVATE = re.compile(r"\._trial_id\b|_get_stale_trial_ids|\._storage\b|\._study_id\b|[\"']_backend[\"']|optuna\._(?!_)"
                     r"|optuna_dashboard\._(?!_)|trial_heartbeats")


def test_no_other_module_names_optunas_private_parts():
    found = [f"{p.relative_to(PACKAGE)}:{n}" for p in sorted(PACKAGE.rglob("*.py")) if p.name != "optuna_private.py"
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if PRIVATE.search(line) and not line.lstrip().startswith(("#", "Optuna's public API"))]
    assert found == []


def _rdb_study(tmp_path, heartbeat=None):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'p.db'}", heartbeat_interval=heartbeat,
                                             grace_period=1 if heartbeat else None)
    return storage, optuna.create_study(storage=storage, study_name="p")


def test_trial_ids_and_the_study_storage(tmp_path):
    storage, study = _rdb_study(tmp_path)
    first, second = study.ask(), study.ask()
    got, study_id = private.study_storage(study)
    assert private.inner_backend(got) is storage  # Optuna's cache in front of the database
    assert study_id == storage.get_study_id_from_name("p")
    for trial in (first, second, *study.get_trials(deepcopy=False)):
        assert private.trial_id(trial) == storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
    assert private.trial_id(first) < private.trial_id(second)


def test_running_trials_without_a_heartbeat_behind_optunas_cache(tmp_path):
    storage, study = _rdb_study(tmp_path, heartbeat=60)
    cached = optuna.load_study(study_name="p", storage=f"sqlite:///{tmp_path / 'p.db'}")._storage
    assert private.inner_backend(storage) is None and private.inner_backend(cached) is not None
    silent, beating = study.ask(), study.ask()
    storage.record_heartbeat(private.trial_id(beating))
    for s in (storage, cached):
        assert private.running_without_heartbeat(s, 1) == [private.trial_id(silent)]
    assert private.stale_trial_ids(storage, 1) == []


@pytest.mark.slow
def test_a_stale_heartbeat_is_found_without_failing_the_trial(tmp_path):
    storage, study = _rdb_study(tmp_path, heartbeat=1)
    trial = study.ask()
    storage.record_heartbeat(private.trial_id(trial))
    time.sleep(2.5)  # past the grace period of 1 s (SQLite stamps heartbeats in whole seconds)
    assert private.stale_trial_ids(storage, 1) == [private.trial_id(trial)]
    assert study.trials[0].state == optuna.trial.TrialState.RUNNING


def test_a_journals_backend_is_found(tmp_path):
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    backend = JournalFileBackend(str(tmp_path / "j.log"))
    assert private.inner_backend(JournalStorage(backend)) is backend


def test_a_dashboard_note_on_a_finished_trial(tmp_path):
    pytest.importorskip("optuna_dashboard")
    from optuna_dashboard import save_note

    storage, study = _rdb_study(tmp_path)
    study.tell(study.ask(), 1.0)
    trial_id = private.trial_id(study.trials[0])
    save_note(private.TrialNoteTarget(storage, study, trial_id), "pruned at epoch 2")
    assert private.note_body(storage.get_study_system_attrs(1), trial_id) == "pruned at epoch 2"
    assert private.note_body(storage.get_study_system_attrs(1), None) == ""


def test_optunas_hypervolume_by_hand():
    # (1, 2) and (2, 1) up to (3, 3): 2 + 2 - the 1 x 1 square both cover
    assert private.compute_hypervolume([[1, 2], [2, 1]], [3, 3]) == pytest.approx(3.0)
    assert private.compute_hypervolume([[0, 0]], [1, 2]) == pytest.approx(2.0)
