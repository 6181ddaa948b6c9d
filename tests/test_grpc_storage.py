"""`--storage grpc://HOST:PORT` through `headsearch storage-server` (Optuna's gRPC proxy in front of a database),
keeping every promise the other storages keep (issue 50): an exact budget without a lock (the fence), a killed
worker's trial retried (leases stored in the trials: no heartbeat passes the proxy), a proxy outage waited out or
ended in one line, the study readable by report, export and dashboard; and a database that refuses a connection
for having too many, waited out like an outage.

Cheap by design: the planted-token task (test_custom_task.py), a storage server on SQLite in a process of its own.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from test_budget_faults import (one_line_exit_2, outage_run, planted, resumed_exactly, settings,  # noqa: F401
                                start_worker, wait_for)
from test_report_export import _get_json, _studies_once_up
from test_search import load

from headsearch.search.liveness import StorageUnavailable, TrialLeases, open_patiently, unavailable
from headsearch.search.runner import Search
from headsearch.search.snapshot import trial_state
from headsearch.search.storage import budget_lock, proxy, storage_scheme

# Optuna calls its gRPC proxy experimental; headsearch uses it knowingly (its row and storage-server silence it too).
pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
ROOT = Path(__file__).resolve().parents[1]
HAS_PROXY = hasattr(optuna.storages, "GrpcStorageProxy")  # Optuna >= 4.2
needs_proxy = pytest.mark.skipif(not HAS_PROXY, reason="Optuna's gRPC proxy is Optuna >= 4.2")
LIGHT_TABLE = ROOT / "benchmarks" / "tables" / "vit-cifar10-deep-head-tiny.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


class StorageServer:
    """`headsearch storage-server` in a process of its own, on a port that stays the same across restarts."""

    def __init__(self, processes, db_url: str):
        self.processes, self.db_url, self.port, self.proc = processes, db_url, free_port(), None

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def start(self, patience: float = 120) -> str:
        """Start it; returns the line it printed on stdout."""
        self.proc = self.processes.start([sys.executable, "-m", "headsearch", "storage-server", "--storage", self.db_url,
                                          "--port", str(self.port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, env={**env(), "HEADSEARCH_STORAGE_PATIENCE": str(patience)})
        line = self.proc.stdout.readline()
        assert line, self.proc.communicate(timeout=30)
        return line.strip()

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=20)


@pytest.fixture
def grpc_server(processes, tmp_path):
    if not HAS_PROXY:
        pytest.skip("Optuna's gRPC proxy is Optuna >= 4.2")
    server = StorageServer(processes, f"sqlite:///{tmp_path / 'behind.db'}")
    server.start()
    return server


# ------------------------------------------------------------------------------------------ bad input


def test_a_grpc_url_without_a_port_is_one_line(cli, tmp_path):
    result = cli(["report", "--storage", "grpc://somewhere", "--study", "s"])
    cli.error_line(result, "grpc://somewhere", "write grpc://HOST:PORT")


@pytest.mark.floor
def test_a_grpc_url_needs_optuna_4_2_or_an_answering_server(cli, monkeypatch, tmp_path):
    """On Optuna < 4.2 (the floor is 4.0) a grpc:// URL is refused in one line saying to upgrade; from 4.2 on, a
    server that does not answer is one line too, not a worker waiting for ever."""
    monkeypatch.setattr(proxy, "GRPC_READY", 1.0)
    monkeypatch.chdir(tmp_path)
    url = f"grpc://127.0.0.1:{free_port()}"
    result = cli(["report", "--storage", url, "--study", "s"])
    if HAS_PROXY:
        cli.error_line(result, url, "no storage server answered", "headsearch storage-server")
    else:
        cli.error_line(result, "needs optuna >= 4.2", f"installed: {optuna.__version__}", "pip install -U")
    if not HAS_PROXY:
        result = cli(["storage-server", "--storage", "sqlite:///x.db", "--port", str(free_port())])
        cli.error_line(result, "headsearch storage-server needs optuna >= 4.2")


def test_an_optuna_without_the_proxy_refuses_grpc_in_one_line_saying_to_upgrade(cli, monkeypatch, tmp_path):
    """The floor's Optuna (4.0) has no gRPC proxy (the floor run of the test above meets the real one); here an
    Optuna without it, on any installed version: `run`, `report` and `storage-server` say to upgrade."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delattr(optuna.storages, "GrpcStorageProxy", raising=False)
    monkeypatch.setattr(optuna, "__version__", "4.1.0")
    result = cli(["report", "--storage", "grpc://127.0.0.1:13000", "--study", "s"])
    cli.error_line(result, "storage grpc://127.0.0.1:13000 needs optuna >= 4.2 (installed: 4.1.0)", "pip install -U")
    result = cli(["storage-server", "--storage", "sqlite:///x.db", "--port", str(free_port())])
    cli.error_line(result, "headsearch storage-server needs optuna >= 4.2 (installed: 4.1.0)")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("url, kind", [("journal:x.log", "journal"), ("redis://127.0.0.1:6379", "redis"),
                                       ("grpc://127.0.0.1:13000", "grpc")])
def test_storage_server_refuses_what_is_not_a_database(url, kind, cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if not HAS_PROXY:
        pytest.skip("Optuna's gRPC proxy is Optuna >= 4.2")
    result = cli(["storage-server", "--storage", url, "--port", str(free_port())])
    cli.error_line(result, "storage-server serves a database", f"not {kind} storage")
    assert not any(tmp_path.iterdir())  # nothing half-made


@needs_proxy
def test_storage_server_on_a_port_in_use_or_a_bad_database_is_one_line(cli, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = cli(["storage-server", "--storage", f"sqlite:///{tmp_path / 'h.db'}", "--port", str(port)])
        cli.error_line(result, f"cannot serve on 127.0.0.1:{port}", "in use")
    result = cli(["storage-server", "--storage", f"sqlite:///{tmp_path / 'no' / 'h.db'}", "--port", str(free_port())])
    cli.error_line(result, "does not exist")


@needs_proxy
def test_a_grpc_url_without_grpcio_is_the_rows_driver_line(cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "grpc", None)  # what `import grpc` meets where grpcio is not installed
    result = cli(["report", "--storage", "grpc://127.0.0.1:13000", "--study", "s"])
    cli.error_line(result, "the grpc driver is not installed", "pip install 'headsearch[grpc]' (grpcio, protobuf)")


def test_the_grpc_row_takes_no_lock_and_says_the_fence_keeps_the_budget():
    """The database behind the proxy is out of the workers' reach: the row's budget lock is a hold that says so,
    and its trials' liveness is a lease kept in the storage itself."""
    with budget_lock("grpc://127.0.0.1:13000", "s") as hold:
        assert "the fence alone" in hold.what and not hold.lost
    assert storage_scheme("grpc://127.0.0.1:13000").liveness == "stored leases"


@needs_proxy
def test_unavailable_counts_a_proxy_that_does_not_answer():
    """A gRPC UNAVAILABLE error (the proxy stopped or restarting) is an outage to wait out, as a database's is."""
    from optuna.storages import GrpcStorageProxy

    with pytest.raises(Exception) as got:
        GrpcStorageProxy(host="127.0.0.1", port=free_port()).get_all_studies()
    assert unavailable(got.value).startswith("the storage server does not answer")
    assert unavailable(KeyError("trial 3")) is None


# ------------------------------------------------------------------------------------------ the server


@pytest.mark.server
@pytest.mark.processes
@needs_proxy
def test_storage_server_prints_the_url_for_workers_hides_the_password_and_stops_on_sigterm(processes, pg_url):
    with_password = pg_url.replace("postgres@", "postgres:s3cret@")  # trust auth: the password is not checked
    server = StorageServer(processes, with_password)
    line = server.start()
    assert line.endswith(f"workers pass --storage grpc://127.0.0.1:{server.port}"), line
    assert "s3cret" not in line and "postgres:***@" in line
    os.killpg(server.proc.pid, signal.SIGTERM)
    out, err = server.proc.communicate(timeout=30)
    assert server.proc.returncode == 0, err
    assert "s3cret" not in out + err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "storage server stopped"


@pytest.mark.server
@pytest.mark.processes
@pytest.mark.slow
def test_two_run_processes_on_grpc_fill_the_budget_exactly(grpc_server, tmp_path):
    """No budget lock reaches the database behind the proxy: two `headsearch run` processes ask at once, and
    the fence alone keeps the budget (a trial asked past it is told FAIL as over-budget, never trained)."""
    procs = [outage_run(grpc_server.processes, tmp_path, grpc_server.url, trials=5, patience=60) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
    got = [trial_state(t) for t in load(grpc_server.url, "s").get_trials(deepcopy=False)]
    assert got.count("complete") == 5, got
    assert "running" not in got and "waiting" not in got and "failed" not in got, got


@pytest.mark.server
@pytest.mark.processes
@pytest.mark.floor  # the retry callback differs between Optuna 4.x and 5
def test_a_killed_workers_trial_on_grpc_is_failed_and_retried(grpc_server, tmp_path, planted):
    """No heartbeat passes the proxy: the trial's lease is its own system attribute, renewed with the heartbeat.
    A worker killed (SIGKILL) with its trial RUNNING leaves the lease unchanged; the next worker sees it silent
    for 3 heartbeats on its own clock, fails the trial as interrupted and trains its retry."""
    url = grpc_server.url
    s = settings(tmp_path, url, "s", trials=2)
    dead = start_worker(grpc_server.processes, s, die=True)
    out, err = dead.communicate(timeout=60)
    assert dead.returncode == -signal.SIGKILL and out.strip() == "got 0", err[-2000:]
    assert load(url, "s").trials[0].system_attrs[TrialLeases.LEASE_ATTR]  # the lease was written before it died
    start = time.monotonic()
    Search(dataclasses.replace(s, timeout=90)).run_worker()
    assert 3 <= time.monotonic() - start < 60  # silence is 3 heartbeats of 1 s
    trials = load(url, "s").get_trials(deepcopy=False)
    assert [trial_state(t) for t in trials].count("complete") == 2
    assert trials[0].state == TrialState.FAIL
    assert trials[0].user_attrs["fail_reason"] == "interrupted (its worker stopped renewing its lease)"
    retried = [t for t in trials if t.system_attrs.get("failed_trial") == 0]
    assert len(retried) == 1 and retried[0].state == TrialState.COMPLETE


@pytest.mark.server
@pytest.mark.processes
@pytest.mark.slow
def test_a_proxy_restart_is_waited_out_and_a_longer_outage_stops_in_one_line_then_resumes(grpc_server, tmp_path):
    server = grpc_server
    proc = outage_run(server.processes, tmp_path, server.url, trials=2, patience=60)
    wait_for(lambda: _mid_trial(server.url) or proc.poll() is not None, "a trial mid-run", 120)
    server.kill()
    time.sleep(3)
    server.start()
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "unreachable (the storage server does not answer" in err
    assert [trial_state(t) for t in load(server.url, "s").get_trials(deepcopy=False)].count("complete") == 2

    proc = outage_run(server.processes, tmp_path, server.url, trials=4, patience=3)
    wait_for(lambda: _mid_trial(server.url) or proc.poll() is not None, "a trial mid-run", 120)
    server.kill()
    one_line_exit_2(proc, f"storage {server.url} unreachable", "the same command resumes")
    server.start()
    resumed_exactly(server.processes, tmp_path, server.url, trials=4)


def _mid_trial(url: str) -> bool:
    try:
        trials = load(url, "s").get_trials(deepcopy=False)
    except Exception:
        return False
    return any(t.state == TrialState.RUNNING and t.intermediate_values for t in trials)


@pytest.mark.server
@pytest.mark.processes
@pytest.mark.slow
def test_report_export_and_dashboard_read_a_study_through_grpc(grpc_server, optuna_dashboard, cli, tmp_path):
    """A study written through the proxy by a search's own loop (a light worker: trials looked up in a table, so
    the test pays for reading, not training) is read through it by report, export and the dashboard."""
    from headsearch.search.light import light_search, run_light_worker
    from headsearch.search.table import load_table

    url = grpc_server.url
    table = load_table(LIGHT_TABLE)
    run_light_worker(light_search(table, storage=url, study="s", trials=2, run_root=str(tmp_path / "runs")), table,
                     scale=0.0)
    result = cli(["report", "--storage", url, "--study", "s", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert '"complete": 2' in result.stdout
    result = cli(["export", "--storage", url, "--study", "s", "--pareto", "--out", tmp_path / "configs"])
    assert result.exit_code == 0, result.output
    assert list((tmp_path / "configs").glob("trial-*.yaml"))
    port = free_port()
    proc = grpc_server.processes.start([sys.executable, "-m", "headsearch", "dashboard", "--storage", url, "--port",
                                        str(port), "--study", "s"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=env())
    base = f"http://127.0.0.1:{port}"
    (summary,) = [s for s in _studies_once_up(proc, base)["study_summaries"] if s["study_name"] == "s"]
    detail = _get_json(f"{base}/api/studies/{summary['study_id']}")
    assert sum(t["state"] == "Complete" for t in detail["trials"]) == 2
    grpc_server.processes.stop(proc)


@pytest.mark.server
@pytest.mark.processes
@needs_proxy
def test_a_database_that_refuses_the_proxy_is_an_outage_to_the_workers(pg_url, processes):
    """The database behind the proxy goes away for it (its sessions ended, every connection its role may have
    taken). Optuna reports that as a StorageInternalError about invalid data, which a worker would take for a bug;
    the proxy waits it out for its patience (2 s here), then its error is one a worker counts as an outage to
    wait out. Once the database takes connections again, the same call goes through."""
    import sqlalchemy as sa
    from optuna.storages import GrpcStorageProxy

    with limited_role(pg_url, 4) as url:
        server = StorageServer(processes, url)
        server.start(patience=2)
        proxy = GrpcStorageProxy(host="127.0.0.1", port=server.port)
        assert proxy.get_all_studies() == []
        name = url.rsplit("/", 1)[1]
        admin = sa.create_engine(pg_url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}'"))
        wait_for(lambda: _connections(admin, name) == 0, "the proxy's sessions to end", 30)
        held = _hold(url, 4)
        with pytest.raises(Exception) as got:
            proxy.get_all_studies()
        why = unavailable(got.value)
        assert why is not None and why.startswith("the database behind the storage server: "), got.value
        assert "too many connections for role" in why
        for conn in held:
            conn.close()
        wait_for(lambda: _answers(proxy), "the proxy to reach the database again", 30)
        admin.dispose()


def _connections(admin, role: str) -> int:
    import sqlalchemy as sa

    with admin.connect() as conn:
        return conn.execute(sa.text(f"SELECT count(*) FROM pg_stat_activity WHERE usename = '{role}'")).scalar()


def _answers(proxy) -> bool:
    try:
        return proxy.get_all_studies() == []
    except Exception:
        return False


# ------------------------------------------------------------------- a database full of connections (item 3)


@contextlib.contextmanager
def limited_role(pg_url: str, limit: int):
    """A PostgreSQL role of its own, allowed `limit` connections, owning a database of its own: yields the
    URL that connects as it. Both are dropped at the end."""
    import sqlalchemy as sa

    name = f"hs_limited_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE ROLE {name} LOGIN CONNECTION LIMIT {limit}"))
        conn.execute(sa.text(f"CREATE DATABASE {name} OWNER {name}"))
    try:
        yield sa.engine.make_url(pg_url).set(username=name, database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}'"))
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
            conn.execute(sa.text(f"DROP ROLE IF EXISTS {name}"))
        admin.dispose()


def _hold(url: str, n: int) -> list:
    import sqlalchemy as sa

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    return [engine.connect() for _ in range(n)]


@pytest.mark.server
def test_a_database_full_of_connections_is_waited_out_when_opened(pg_url):
    """PostgreSQL refuses a connection past a role's limit ("too many connections for role", the same family as
    "sorry, too many clients already" and MySQL's "Too many connections"). Opening the storage used to fail at
    once with that line; now it is waited out like an outage: one line after the patience, or the storage once a
    connection is free."""
    with limited_role(pg_url, 3) as url:  # opening takes three: the schema lock's, two of the storage's pool
        held = _hold(url, 3)
        start = time.monotonic()
        with pytest.raises(StorageUnavailable) as got:
            open_patiently(url, None, patience=2)
        assert time.monotonic() - start >= 2
        assert "too many connections for role" in str(got.value) and "the same command resumes" in str(got.value)
        for conn in held:
            conn.close()
        storage = open_patiently(url, None, patience=20)  # a closed connection's backend takes a moment to go
        assert storage.get_all_studies() == []
        storage.engine.dispose()


def pymysql(url: str) -> str:
    """`url` through PyMySQL, the driver headsearch opens mysql:// with (SQLAlchemy's default is MySQLdb)."""
    import sqlalchemy as sa

    return sa.engine.make_url(url).set(drivername="mysql+pymysql").render_as_string(hide_password=False)


@contextlib.contextmanager
def limited_mysql_user(mysql_url: str, limit: int):
    """A MySQL/MariaDB user of its own, allowed `limit` connections (MAX_USER_CONNECTIONS) to the test database:
    yields the URL that connects as it; dropped at the end."""
    import sqlalchemy as sa

    name = f"hs_limited_{uuid.uuid4().hex[:8]}"
    database = sa.engine.make_url(mysql_url).database
    admin = sa.create_engine(pymysql(mysql_url), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    hosts = ("%", "localhost")  # a user at '%' does not cover localhost where an anonymous user exists
    with admin.connect() as conn:
        for host in hosts:
            conn.execute(sa.text(f"CREATE USER '{name}'@'{host}' WITH MAX_USER_CONNECTIONS {limit}"))
            conn.execute(sa.text(f"GRANT ALL ON `{database}`.* TO '{name}'@'{host}'"))
    try:
        yield sa.engine.make_url(mysql_url).set(username=name, password=None).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            for host in hosts:
                conn.execute(sa.text(f"DROP USER IF EXISTS '{name}'@'{host}'"))
        admin.dispose()


@pytest.mark.server
def test_a_mysql_user_at_its_connection_limit_is_waited_out_when_opened(mysql_url):
    """MySQL's per-user limit says "has exceeded the 'max_user_connections' resource" (error 1226), not "too many
    connections": PostgreSQL's per-role limit was waited out and MySQL's failed at once. Now both wait."""
    with limited_mysql_user(mysql_url, 3) as url:  # opening takes three, as on PostgreSQL
        held = _hold(pymysql(url), 3)
        with pytest.raises(StorageUnavailable) as got:
            open_patiently(url, None, patience=1)
        assert "max_user_connections" in str(got.value) and "the same command resumes" in str(got.value)
        for conn in held:
            conn.close()
        storage = open_patiently(url, None, patience=20)
        assert storage.get_all_studies() is not None
        storage.engine.dispose()


@pytest.mark.server
@pytest.mark.processes
@pytest.mark.slow
def test_connections_one_worker_holds_and_a_full_database_mid_search(pg_url, processes, tmp_path):
    """How many connections one `headsearch run` worker holds on PostgreSQL (read from pg_stat_activity while it
    runs; docs/searching.md states it), and a worker that cannot open the storage while the role's every
    connection is taken: it waits, and runs once one is free."""
    import sqlalchemy as sa

    with limited_role(pg_url, 10) as url:
        proc = outage_run(processes, tmp_path, url, trials=3, patience=60)
        # Autocommit: pg_stat_activity is read once per transaction.
        admin = sa.create_engine(pg_url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
        most = 0
        name = url.rsplit("/", 1)[1]
        while proc.poll() is None:
            with admin.connect() as conn:
                most = max(most, conn.execute(sa.text(
                    f"SELECT count(*) FROM pg_stat_activity WHERE usename = '{name}'")).scalar())
            time.sleep(0.2)
        out, err = proc.communicate()
        assert proc.returncode == 0, err[-3000:]
        print(f"connections one worker held at most: {most}")
        # The worker's pool (HEADSEARCH_WORKER_POOL, 1 kept + 1 at need) and the budget lock's own while it is held:
        # 3 at most (docs/searching.md). Sampled every 0.2 s, the lock's short holds are caught now and then only;
        # the loop's connection beside the lock's (or the heartbeat's) always is.
        assert 2 <= most <= 3, most

        held = _hold(url, 10)  # every connection the role may have
        proc = outage_run(processes, tmp_path, url, trials=4, patience=60)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        wait_for(lambda: any("too many connections for role" in line for line in lines) or proc.poll() is not None,
                 "the worker to meet the full database", 120)
        assert proc.poll() is None, lines  # waiting, not failed
        for conn in held:
            conn.close()
        assert proc.wait(timeout=240) == 0, "".join(lines)[-3000:]
        admin.dispose()
