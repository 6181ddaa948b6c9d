"""The table of storage schemes (search/storage/schemes.py `SCHEMES`, issue 40): every row takes a real budget lock
on its real backend and releases it; a URL no row claims is refused in one line by `open_storage`, `budget_lock`
and `headsearch run`, never served without a lock; and a scheme added with `register_storage` runs a real search,
and finds a killed worker's trial as its row's liveness says. The lock's behaviour under faults, row by row, is in
test_storage_locks.py."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from headsearch.errors import HeadsearchError
from headsearch.search import storage
from headsearch.search.storage import (SCHEMES, LockHold, StorageScheme, absolute_url, artifact_dir, budget_lock,
                                       journal_path, normalize_url, open_rdb_storage, open_storage,
                                       register_storage, sqlite_path, storage_scheme)
from test_budget_faults import TESTS, WORKER, settings
from test_custom_task import NAME, SPACE, TASK
from test_search import load, shared_storage

# The backend each built-in row is tested on (test_search.shared_storage: a file in tmp_path, or the local servers).
BACKENDS = {"sqlite", "postgresql", "mysql", "journal", "redis"}
# Rows without a budget lock, by design: the fence alone keeps their budget (test_grpc_storage.py fills one).
FENCE_ONLY = {"grpc"}


def test_every_registered_scheme_is_tested_on_a_backend():
    """A row added to the table without a backend here would go untested by the lock test below."""
    assert set(SCHEMES) == BACKENDS | FENCE_ONLY


@pytest.mark.parametrize("name", sorted(BACKENDS | FENCE_ONLY))
def test_each_rows_example_url_is_its_own(name):
    assert storage_scheme(SCHEMES[name].example) is SCHEMES[name]


class Taker(threading.Thread):
    """Takes the budget lock in a daemon thread and says when it is inside (`entered`)."""

    def __init__(self, url: str, study: str):
        super().__init__(daemon=True)
        self.url, self.study, self.entered, self.error = url, study, threading.Event(), None

    def run(self) -> None:
        try:
            with budget_lock(self.url, self.study):
                self.entered.set()
        except BaseException as e:  # noqa: BLE001  (the test reads it)
            self.error = e


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_each_row_takes_a_real_budget_lock_and_releases_it(name, request, tmp_path):
    """Through the table, on the real backend: the lock excludes a second taker while held (so it is no lock-less
    default), lets it in once released, and leaves nothing held (a third take enters at once). The row also opens
    its storage: an RDBStorage for the RDB rows, a journal otherwise."""
    url, study = shared_storage(name, request, tmp_path)
    study = f"{study}-{uuid.uuid4().hex[:8]}"
    assert storage_scheme(url).name == name
    with budget_lock(url, study) as hold:
        assert isinstance(hold, LockHold) and not hold.lost
        second = Taker(url, study)
        second.start()
        assert not second.entered.wait(0.5), "a second worker got in while the lock was held"
    assert second.entered.wait(15), second.error
    second.join(15)
    assert second.error is None, second.error
    assert not hold.lost
    third = Taker(url, study)
    third.start()
    third.join(15)
    assert third.entered.is_set() and third.error is None, third.error
    if name == "journal":  # the lock file is its holder's, removed at release
        assert not Path(str(tmp_path / "h.log") + ".budget.lock").exists()
    if name == "redis":
        import redis

        assert redis.Redis.from_url(url).get(f"headsearch:budget:{study}") is None
    opened = open_storage(url, heartbeat=None)
    assert isinstance(opened, optuna.storages.RDBStorage) == (storage_scheme(url).liveness == "heartbeats")


def test_the_url_functions_are_the_rows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_url("sqlite:///h.db") == f"sqlite:///{tmp_path / 'h.db'}"
    assert absolute_url("h.log") == absolute_url("journal:h.log") == f"journal:{tmp_path / 'h.log'}"
    assert absolute_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert normalize_url("postgres://u@h/db").startswith("postgresql")
    assert normalize_url("mysql://u@h/db").startswith("mysql")
    assert sqlite_path("sqlite:///runs/h.db") == Path("runs/h.db") and sqlite_path("sqlite://") is None
    assert journal_path("journal:runs/h.log") == Path("runs/h.log") and journal_path("sqlite:///h.db") is None
    assert artifact_dir("sqlite:///runs/h.db") == Path("runs/h-artifacts")
    assert artifact_dir("journal:runs/h.log") == Path("runs/h-artifacts")
    assert artifact_dir("redis://127.0.0.1:6379/0") == Path("headsearch-artifacts")


# -- a URL no row claims --------------------------------------------------------------------------------------


def one_line_refusal(error: BaseException, url: str) -> None:
    message = str(error)
    assert "\n" not in message and repr(url) in message and "is not a storage URL" in message, message
    for scheme in SCHEMES.values():
        assert scheme.example in message, message


@pytest.mark.parametrize("url", ["foo://x", "sqlite", "s3://bucket/h.db", ""])
def test_an_unknown_scheme_is_refused_by_open_storage_and_budget_lock(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HeadsearchError) as opened:
        open_storage(url)
    one_line_refusal(opened.value, url)
    with pytest.raises(HeadsearchError) as locked:
        with budget_lock(url, "s"):
            pytest.fail("entered a budget lock for a URL no scheme claims")
    one_line_refusal(locked.value, url)
    assert list(tmp_path.iterdir()) == []  # no lock file, no database


@pytest.fixture
def planted_task(monkeypatch, tmp_path) -> Path:
    """The test task of test_custom_task.py, registered for this test; its space written to a file."""
    from headsearch.tasks import registry

    monkeypatch.setitem(registry._REGISTRY, NAME, TASK)
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    return space


def test_headsearch_run_refuses_an_unknown_scheme_in_one_line(planted_task, tmp_path, cli, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    result = cli(["run", "--task", NAME, "--space", planted_task, "--storage", "foo://x", "--trials", "2",
                  "--run-root", work / "runs", "--device", "cpu"])
    cli.error_line(result, "foo://x", "is not a storage URL")
    assert list(work.iterdir()) == []


# -- a scheme added with register_storage ----------------------------------------------------------------------


def _memsql_to_sqlite(url: str) -> str:
    return "sqlite:///" + url.removeprefix("memsql:///")


@pytest.fixture
def memsql():
    """A toy scheme, `memsql:///FILE`, that stores in SQLite under another name: each of its functions maps the URL
    and hands it to the sqlite row's (or to `open_rdb_storage`), and counts its calls. Unregistered at the end."""
    sqlite = SCHEMES["sqlite"]
    calls = {"open": 0, "budget_lock": 0, "schema_lock": 0}

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    scheme = register_storage(StorageScheme(
        name="memsql", example="memsql:///FILE.db", claims=lambda url: url.startswith("memsql:///"),
        open=counted("open", lambda url, heartbeat, retry: open_rdb_storage(_memsql_to_sqlite(url), heartbeat, retry)),
        budget_lock=counted("budget_lock", lambda url, study: sqlite.budget_lock(_memsql_to_sqlite(url), study)),
        schema_lock=counted("schema_lock", lambda url: sqlite.schema_lock(_memsql_to_sqlite(url))),
        file=lambda url: sqlite.file(_memsql_to_sqlite(url)), liveness="heartbeats"))
    try:
        yield scheme, calls
    finally:
        SCHEMES.pop(scheme.name, None)


def test_register_storage_refuses_a_taken_name_and_a_shadowed_scheme(memsql):
    from headsearch.errors import ConfigError

    scheme, _ = memsql
    with pytest.raises(ConfigError, match="registered already"):
        register_storage(scheme)
    assert register_storage(scheme, replace=True) is scheme
    import dataclasses

    with pytest.raises(ConfigError, match="'sqlite' claims its URLs"):  # would never be reached
        register_storage(dataclasses.replace(scheme, name="sqlite2", example="sqlite:///FILE.db",
                                             claims=lambda url: url.startswith("sqlite:")))
    with pytest.raises(ConfigError, match="is not one of its URLs"):
        register_storage(dataclasses.replace(scheme, name="odd", example="odd://x"))
    assert "sqlite2" not in SCHEMES and "odd" not in SCHEMES


def test_a_registered_scheme_runs_a_real_search(memsql, planted_task, tmp_path):
    """Two trials of the test task, in process, on the toy scheme: the search opens the storage, takes the budget
    lock and finds the artifacts' folder through the table alone."""
    from headsearch.search.runner import Search, SearchSettings

    scheme, calls = memsql
    url = f"memsql:///{tmp_path / 'toy.db'}"
    assert storage_scheme(url) is scheme and artifact_dir(url) == tmp_path / "toy-artifacts"
    Search(SearchSettings(task=NAME, space=str(planted_task), storage=url, study="s", trials=2, preset="tiny",
                          run_root=str(tmp_path / "runs"), device="cpu", pruner="none", heartbeat=1)).run_worker()
    trials = [t for t in optuna.load_study(study_name="s", storage=open_storage(url, heartbeat=None)).get_trials()
              if "duplicate_of" not in t.user_attrs]
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert calls["open"] >= 2 and calls["schema_lock"] >= 2 and calls["budget_lock"] >= 2, calls
    assert (tmp_path / "toy.db").exists()  # it is SQLite underneath
    assert optuna.get_all_study_names(storage=f"sqlite:///{tmp_path / 'toy.db'}") == ["s"]


# -- a scheme's liveness: how a dead worker's trial is found, declared by its row --------------------------------


def toyjournal(liveness: str = "leases") -> StorageScheme:
    """A toy scheme, `toyjournal:///FILE.log`: Optuna's journal file under another URL prefix, each function handing
    the URL, as a journal: one, to the journal row's; its liveness as asked. Its worker process registers it too."""
    journal = SCHEMES["journal"]

    def as_journal(url: str) -> str:
        return "journal:" + url.removeprefix("toyjournal://")

    return StorageScheme(
        name="toyjournal", example="toyjournal:///FILE.log", claims=lambda url: url.startswith("toyjournal://"),
        open=lambda url, heartbeat, retry: journal.open(as_journal(url), heartbeat, retry), liveness=liveness,
        budget_lock=lambda url, study: journal.budget_lock(as_journal(url), study),
        file=lambda url: journal.file(as_journal(url)))


@pytest.fixture
def toy_journal():
    """Registers `toyjournal(liveness)` when called; unregistered at the end."""
    yield lambda liveness="leases": register_storage(toyjournal(liveness))
    SCHEMES.pop("toyjournal", None)


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.floor  # the retry callback differs between Optuna 4.0 and 5
def test_a_killed_workers_trial_on_a_registered_leases_scheme_is_retried(toy_journal, planted_task, tmp_path, processes):
    """A worker on the toy scheme (liveness "leases") asks a trial, starts its lease and is killed with SIGKILL. The
    row, not its URL prefix, gave it leases: they live beside the row's file, and a resumed search sees the lease
    unchanged for 3 heartbeats, fails the trial and trains its retry."""
    from headsearch.search.runner import Search

    toy_journal("leases")
    url = f"toyjournal://{tmp_path / 'h.log'}"
    s = settings(tmp_path, url, "s", trials=2)
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r})\nfrom test_storage_schemes import toyjournal\n"
            "from headsearch.search.storage import register_storage\nregister_storage(toyjournal())\n"
            + WORKER.format(tests=str(TESTS), settings=vars(s), pause=False, die=True))
    dead = processes.start([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    out, err = dead.communicate(timeout=60)
    assert dead.returncode == -signal.SIGKILL and out.strip() == "got 0", err[-2000:]
    assert list((tmp_path / "h.log.leases").glob("s-*/0")), "no lease of trial 0 beside the row's file"
    Search(dataclasses.replace(s, timeout=90)).run_worker()
    trials = load(url, "s").get_trials(deepcopy=False)
    assert [t.state for t in trials].count(TrialState.COMPLETE) == 2 and trials[0].state == TrialState.FAIL
    assert trials[0].user_attrs["fail_reason"] == "interrupted (its worker stopped renewing its lease)"
    assert [t.system_attrs.get("failed_trial") for t in trials[1:]].count(0) == 1  # trial 0 retried once


def test_a_scheme_of_liveness_none_is_accepted_and_keeps_no_leases(toy_journal, planted_task, tmp_path):
    """Nothing finds a dead worker's trial there: no leases, and a worker stops rather than wait for running trials."""
    from headsearch.search.runner import Search

    assert toy_journal("none").liveness == "none"
    search = Search(settings(tmp_path, f"toyjournal://{tmp_path / 'h.log'}", "s", trials=2))
    search.open()
    assert search.store.leases is None and not search.store.tells_dead_workers


def test_register_storage_refuses_an_unknown_liveness_and_leases_with_nowhere_to_go():
    from headsearch.errors import ConfigError

    with pytest.raises(ConfigError) as bad:
        register_storage(toyjournal("heartbeat"))
    assert str(bad.value) == ("storage scheme 'toyjournal': unknown liveness 'heartbeat': use one of heartbeats,"
                              " leases, stored leases, none")
    with pytest.raises(ConfigError, match="^storage scheme 'toyjournal': its leases go beside its file or in its"
                                          " Redis, and its URLs have neither: give it a file"):
        register_storage(dataclasses.replace(toyjournal("leases"), file=lambda url: None))
    assert "toyjournal" not in SCHEMES


def test_the_toy_schemes_are_gone_after_their_tests():
    assert "memsql" not in SCHEMES and storage.find_scheme("memsql:///x.db") is None
    assert "toyjournal" not in SCHEMES and storage.find_scheme("toyjournal:///x.log") is None
