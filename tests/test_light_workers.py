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
def test_four_light_workers_on_postgresql_keep_the_budget_and_train_no_architecture_twice(processes, pg_url, pg_study,
                                                                                          tmp_path):
    start_light_workers(processes, pg_url, pg_study, 4, 10, tmp_path)
    assert_promises_kept(pg_url, pg_study, 10)


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
