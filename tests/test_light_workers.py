"""Light workers (headsearch.search.light): a search's own loop on a real storage, trials looked up in a table, no
torch; several at once keep the search's promises. benchmarks/cluster.py runs them by the dozen."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_grpc_storage import HAS_PROXY, StorageServer
from test_search import shared_storage

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "benchmarks" / "tables" / "vit-cifar10-deep-head-tiny.json"


def start_light_workers(processes, storage: str, study: str, n: int, trials: int, folder: Path) -> list[dict]:
    """`n` light workers on `storage`, run to the end; each one's report (every one must exit 0)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [processes.start([sys.executable, "-m", "headsearch.search.light", "--table", str(TABLE), "--storage", storage,
                              "--study", study, "--trials", str(trials), "--scale", "0.002", "--seed", str(i),
                              "--heartbeat", "2", "--run-root", str(folder / "runs"),
                              "--report", str(folder / f"w{i}.json")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(n)]
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
    return [json.loads((folder / f"w{i}.json").read_text()) for i in range(n)]


def assert_promises_kept(storage: str, study: str, trials: int) -> None:
    """The budget exact, no architecture held twice, no trial left RUNNING."""
    import optuna

    from headsearch.search.record import config_key, counts_toward_budget, holds_architecture
    from headsearch.search.storage import open_storage

    stored = optuna.load_study(study_name=study, storage=open_storage(storage, heartbeat=None)).get_trials()
    assert sum(counts_toward_budget(t) for t in stored) == trials
    held = [config_key(t.user_attrs["config"]) for t in stored if holds_architecture(t)]
    assert len(held) == len(set(held)) == trials
    assert not [t.number for t in stored if t.state.name == "RUNNING"]


@pytest.mark.processes
def test_a_light_worker_runs_a_search_on_a_journal_without_torch(processes, tmp_path):
    storage = f"journal:{tmp_path / 'j.log'}"
    [report] = start_light_workers(processes, storage, "one", 1, 4, tmp_path)
    assert report["torch"] is False
    assert report["epochs"] >= 4 and report["slept"] > 0
    assert len(report["lock_waits"]) >= 4  # one budget-lock wait timed per ask
    assert_promises_kept(storage, "one", 4)


@pytest.mark.processes
def test_four_light_workers_on_a_journal_keep_the_budget_and_train_no_architecture_twice(processes, tmp_path):
    storage = f"journal:{tmp_path / 'j.log'}"
    start_light_workers(processes, storage, "four", 4, 10, tmp_path)
    assert_promises_kept(storage, "four", 10)


@pytest.mark.server
@pytest.mark.processes
@pytest.mark.floor  # each database's budget lock and Optuna's storage of it
@pytest.mark.parametrize("kind", ["postgresql", "mysql", "redis"])
def test_four_light_workers_on_a_shared_database_keep_the_budget_and_train_no_architecture_twice(kind, request,
                                                                                                processes, tmp_path):
    """Four processes on each shared storage, each behind its own budget lock (an advisory lock, GET_LOCK, a Redis
    lock): the search's own loop, so what `--workers` runs (test_search.py runs it on SQLite and PostgreSQL)."""
    url, study = shared_storage(kind, request, tmp_path)
    start_light_workers(processes, url, study, 4, 10, tmp_path)
    assert_promises_kept(url, study, 10)


@pytest.mark.server
@pytest.mark.processes
@pytest.mark.skipif(not HAS_PROXY, reason="Optuna's gRPC proxy is Optuna >= 4.2")
def test_four_light_workers_on_grpc_train_no_architecture_twice_without_a_lock(processes, tmp_path):
    """grpc:// has no budget lock (the fence alone): two workers asking at once sampled the same architecture and
    both trained it (15 of 24 trials with 8 light workers) until each looked again after writing its config."""
    server = StorageServer(processes, f"sqlite:///{tmp_path / 'behind.db'}")
    server.start()
    start_light_workers(processes, server.url, "grpc", 4, 10, tmp_path)
    assert_promises_kept(server.url, "grpc", 10)


@pytest.mark.server
def test_a_workers_database_pool_keeps_one_connection_and_the_servers_keeps_sqlalchemys(pg_url):
    """A worker's storage (heartbeats on) is used by its loop and its heartbeat thread only: 1 kept + 1 at need."""
    from headsearch.search.storage import open_storage

    worker, served = open_storage(pg_url, heartbeat=5), open_storage(pg_url, heartbeat=None)
    try:
        assert (worker.engine.pool.size(), worker.engine.pool._max_overflow) == (1, 1)
        assert served.engine.pool.size() == 5  # the gRPC proxy's: every worker's calls go through it
    finally:
        worker.engine.dispose()
        served.engine.dispose()


def test_a_bad_worker_pool_is_one_line(monkeypatch):
    from headsearch.environment import env_value
    from headsearch.errors import HeadsearchError

    monkeypatch.setenv("HEADSEARCH_WORKER_POOL", "0+1")
    with pytest.raises(HeadsearchError, match=r"^HEADSEARCH_WORKER_POOL='0\+1': give .*KEPT\+EXTRA"):
        env_value("HEADSEARCH_WORKER_POOL")
    monkeypatch.setenv("HEADSEARCH_WORKER_POOL", "2+0")
    assert env_value("HEADSEARCH_WORKER_POOL") == (2, 0)


# --------------------------------------------------------------- asking with no lock (grpc://): racing workers


def _scheduler_on_a_table(racing: bool):
    """A search's scheduler on the tiny table, its study in memory (the simulator's), asking as if no lock held."""
    import optuna

    from headsearch.search.simulate import simulation_search
    from headsearch.search.table import load_table

    table = load_table(TABLE)
    search = simulation_search(table, space=table["space"]["name"], trials=5, sampler="random", pruner="none")
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, directions=search.directions)
    search.adopt(study, storage)
    search.scheduler.racing = racing
    return search.scheduler, study


def test_without_a_lock_each_worker_seeds_its_proposals_apart_and_with_one_by_the_count_alone():
    """Seeded by the trials counted alone, workers that read one count at once propose one architecture: 64 light
    workers on grpc:// made 629 duplicate proposals for 192 trials (49 with a stride of their own). Under a lock
    the count is the seed, so a search replays the same way."""
    from headsearch.search.scheduler import RACING_STRIDE

    locked, _ = _scheduler_on_a_table(racing=False)
    assert locked._seed_index(7) == 7
    racing, _ = _scheduler_on_a_table(racing=True)
    offset = racing._seed_index(7) - 7
    assert offset > 0 and offset % RACING_STRIDE == 0
    assert racing._seed_index(8) - 8 == offset  # one stride per worker: its own proposals still follow its count


def test_a_worker_that_lost_every_race_asks_again_later_instead_of_stopping():
    """With no lock, other workers may take each architecture this one proposes, the unheld one it falls back on
    included. It used to return `done` then (None before any trial ran: the worker stopped, 53 of 64 at the start
    of a grpc:// search); the space has architectures left, so it waits and asks again."""
    import optuna

    from headsearch.search.scheduler import WAIT

    scheduler, study = _scheduler_on_a_table(racing=True)
    lost = []

    def taken_meanwhile(study, trial):  # another worker holds it by the time this one looks
        lost.append(trial.number)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return None

    scheduler._unless_held = taken_meanwhile
    assert scheduler._ask_unheld(study, [], None) is WAIT
    assert len(lost) == 6  # DUPLICATE_ASKS proposals, then the unheld point
