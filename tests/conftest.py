"""Shared fixtures. Tests run on the CPU on small slices of the real data in ../shared/data.

A resource a test needs that is missing (the data, PostgreSQL, psycopg2, optuna-dashboard) fails the
test in CI (the CI environment variable set, as CI services set CI=true) and skips it elsewhere, with
the reason either way: CI must run every test.
"""
from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator, NoReturn

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
WIDE = {"COLUMNS": "240"}  # Rich wraps its tables at 80 columns when the output is not a terminal
PG_URL = os.environ.get("HEADSEARCH_TEST_PG", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")

# The translation model, data and steps that make a trial take a fraction of a second on one CPU thread.
TINY_TRANSLATION = {
    "arch": {"d_model": 32, "enc_layers": 2, "dec_layers": 1, "dec_heads": 2, "d_ff": 64},
    "train": {"epochs": 1, "max_steps_per_epoch": 5},
    "data": {"train_limit": 1000, "val_size": 40, "test_size": 40, "max_len": 16, "vocab_size": 1000},
}


def pytest_configure(config):
    # A suite started in the background of a non-interactive shell (`bash .ci/run &`, a CI runner) inherits
    # SIGINT ignored, and so would every process a test starts: a test's Ctrl-C would then stop nothing.
    # Put back Python's own handler, so the suite behaves the same however it was launched.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Under pytest-xdist (`make test` runs two test processes on two cores) each process, and every process
    # its tests start, computes on one thread: two processes of two threads each on two cores make the tiny
    # models here several times slower.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        # Two test processes are not one search's workers: each gets its own device locks, so that a long
        # training in one does not hold the other's fair clock waiting (the processes a test starts share its).
        os.environ.setdefault("HEADSEARCH_DEVICE_LOCKS", str(Path(tempfile.gettempdir()) /
                                                             f"headsearch-devices-{os.getuid()}-{os.environ['PYTEST_XDIST_WORKER']}"))

    _watch_for_processes()


# ------------------------------------------------------------------------------------------ tiers
# docs/testing.md: `make test-fast` runs every test marked with none of these; `make test` runs them all.
TIERS = ("slow", "serial", "server", "processes", "browser")
FIXTURE_TIERS = {"processes": "processes"}  # a fixture whose tests are in a tier by what the fixture does
UNMARKED_SECONDS = float(os.environ.get("HEADSEARCH_UNMARKED_SECONDS", "10"))
_started: list[str] = []  # the processes the running test started (its setup included)


def _watch_for_processes() -> None:
    """Note every process a test starts (subprocess, multiprocessing's spawn and forkserver, a fork), so the
    tier guard can tell a test that starts one but is not marked `processes`."""
    import multiprocessing.util

    execute_child, spawnv_passfds = subprocess.Popen._execute_child, multiprocessing.util.spawnv_passfds

    def noted_execute_child(self, args, *rest, **kwargs):
        _note(str(args if isinstance(args, str) else args[0]))
        return execute_child(self, args, *rest, **kwargs)

    def noted_spawnv_passfds(path, args, passfds):
        _note(f"{path} (multiprocessing)")
        return spawnv_passfds(path, args, passfds)

    subprocess.Popen._execute_child = noted_execute_child
    multiprocessing.util.spawnv_passfds = noted_spawnv_passfds
    os.register_at_fork(before=lambda: _note("a fork"))


# Code whose processes are the test's: a library's own (ctypes looking for a shared object with ldconfig, a
# compiler's g++ on a cold cache) depends on what ran before in the same test process, so it is not counted.
_OURS = tuple(str(REPO / d) + os.sep for d in ("tests", "headsearch", "benchmarks", "examples"))
_PLUMBING = ("subprocess", "multiprocessing", "os", "concurrent", __name__)


def _note(what: str) -> None:
    """Note `what` when the code that asked for it (past the process plumbing) is the project's or a test's."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _PLUMBING:
        frame = frame.f_back
    if frame is not None and frame.f_code.co_filename.startswith(_OURS):
        _started.append(what)


def pytest_collection_modifyitems(items):
    for item in items:
        for fixture in set(item.fixturenames) & FIXTURE_TIERS.keys():
            item.add_marker(FIXTURE_TIERS[fixture])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _started.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The tier guard: a test that passed fails when it started a process unmarked `processes`, or took more
    than UNMARKED_SECONDS (setup and call) marked with no tier, so the fast tier stays fast and its markers true."""
    report = (yield).get_result()
    item.tier_seconds = getattr(item, "tier_seconds", 0.0) + call.duration
    if call.when != "call" or not report.passed:
        return
    tiers = {m.name for m in item.iter_markers()} & set(TIERS)
    wrong = []
    if _started and "processes" not in tiers:
        wrong.append(f"it started a process ({_started[0]}) but is not marked processes")
    if not tiers and item.tier_seconds > UNMARKED_SECONDS:
        wrong.append(f"it took {item.tier_seconds:.1f} s (over {UNMARKED_SECONDS:g}) but is marked with none of {', '.join(TIERS)}")
    if wrong:
        report.outcome = "failed"
        report.longrepr = "tier guard (docs/testing.md): " + "; ".join(wrong)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str) -> NoReturn:
    """A resource this test needs is missing: fail in CI, skip elsewhere, saying which."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set: tests may not skip for a missing resource)", pytrace=False)
    pytest.skip(reason)


# ------------------------------------------------------------------------------------------ data


def _shared_data() -> Path:
    return Path(os.environ.get("HEADSEARCH_TEST_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def cifar_dir() -> Path:
    d = _shared_data() / "cifar10"
    if not (d / "test.npz").exists():
        unavailable(f"real CIFAR-10 npz shards not found at {d} (set HEADSEARCH_TEST_DATA)")
    return d


@pytest.fixture(scope="session")
def spa_file() -> Path:
    f = _shared_data() / "spa-eng" / "spa.txt"
    if not f.exists():
        unavailable(f"English-Spanish corpus not found at {f} (set HEADSEARCH_TEST_DATA)")
    return f


@pytest.fixture(scope="module")
def cifar_arrays(cifar_dir):
    """The real CIFAR-10 arrays, read from disk once per test module."""
    from headsearch.tasks import cifar_data

    return cifar_data.load_cifar10(cifar_dir)


@pytest.fixture
def cifar(monkeypatch, cifar_dir, cifar_arrays):
    """A DataSource whose loads return the module's real CIFAR-10 arrays without re-reading the shards."""
    from headsearch.tasks import DataSource, cifar_data

    def load(data_dir, *args, **kwargs):
        assert Path(data_dir) == Path(cifar_dir)
        return cifar_arrays

    monkeypatch.setattr(cifar_data, "load_cifar10", load)
    return DataSource(data_dir=cifar_dir)


@pytest.fixture(scope="session")
def tokenizer_cache(tmp_path_factory) -> Path:
    """One HEADSEARCH_CACHE for the session: runs on the same training pairs share their tokenizers."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session", autouse=True)
def private_cache(tokenizer_cache):
    """Every test (and every process a test starts) uses the session's cache, never the user's: a
    `headsearch bench` measurement saved in ~/.cache/headsearch would change the plans tests check."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HEADSEARCH_CACHE", str(tokenizer_cache))
        yield tokenizer_cache


@pytest.fixture
def cache_env(monkeypatch, tokenizer_cache) -> Path:
    monkeypatch.setenv("HEADSEARCH_CACHE", str(tokenizer_cache))
    return tokenizer_cache


@pytest.fixture(scope="session")
def tiny_translation() -> dict[str, Any]:
    """TINY_TRANSLATION (arch, train and data sections), shared by the session: copy it before changing it."""
    return copy.deepcopy(TINY_TRANSLATION)


@pytest.fixture
def one_thread():
    """Torch on one thread: on a 2-core machine shared with other work, two threads make the tiny
    models here ~10x slower than one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_yaml(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(name="write_yaml")
def write_yaml_fixture():
    """`write_yaml(path, data) -> path`: data as YAML, keys in their order."""
    return write_yaml


# ------------------------------------------------------------------------------------------ the CLI


class Cli:
    """`headsearch` in-process through Typer's CliRunner (stdout and stderr kept apart, 240 columns)."""

    def __call__(self, args, **kwargs):
        from typer.testing import CliRunner

        from headsearch.cli.main import app

        return CliRunner().invoke(app, [str(a) for a in args], env=WIDE, **kwargs)

    @staticmethod
    def error_line(result, *fragments: str, code: int = 2) -> str:
        """Assert the command failed as bad input does: exit `code` (not an uncaught exception), no
        traceback, and stderr exactly one line "error: ..." holding every fragment. Returns the line."""
        assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
        assert isinstance(result.exception, SystemExit), result.exception
        assert "Traceback" not in result.output
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        for f in fragments:
            assert f in lines[0], lines[0]
        return lines[0]


@pytest.fixture
def cli() -> Cli:
    """`cli(args) -> result`: headsearch in-process; `cli.error_line(result, *fragments)` checks a bad-input exit."""
    return Cli()


@pytest.fixture
def invoke(cli) -> Cli:
    """The same as `cli` (`invoke(args) -> result`)."""
    return cli


# ------------------------------------------------------------------------------------------ storages


def delete_study_if_present(name: str, storage) -> None:
    import optuna

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optuna.delete_study(study_name=name, storage=storage)
    except KeyError:
        pass


def reachable(service: str, url: str, env: str, module: str, connect) -> str:
    """`url` once `module` (its driver) imports and `connect()` succeeds; otherwise `unavailable`, saying which."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        unavailable(f"{module} is not installed (pip install -e '.[dev]')")
    try:
        connect()
    except Exception as e:
        unavailable(f"{service} not reachable at {url} (set {env}): {str(e).splitlines()[0]}")
    return url


def _select_1(url: str) -> None:
    import sqlalchemy as sa

    from headsearch.search.storage import normalize_url

    engine = sa.create_engine(normalize_url(url), poolclass=sa.pool.NullPool, connect_args={"connect_timeout": 3})
    with engine.connect() as conn:
        conn.execute(sa.text("select 1"))


def unique_study(url: str) -> Iterator[str]:
    """A study name unique to this test run, for a fixture to yield; the study is deleted from `url` at the end."""
    from headsearch.search.storage import open_storage

    name = f"headsearch-test-{uuid.uuid4().hex[:12]}"
    yield name
    delete_study_if_present(name, open_storage(url, heartbeat=None))


@pytest.fixture(scope="session")
def pg_url() -> str:
    """A reachable PostgreSQL ($HEADSEARCH_TEST_PG) with Optuna's tables already there (the race of
    creating them from several workers at once on a fresh database has its own test)."""
    import optuna

    reachable("PostgreSQL", PG_URL, "HEADSEARCH_TEST_PG", "psycopg2", lambda: _select_1(PG_URL))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optuna.storages.RDBStorage(PG_URL)
    return PG_URL


@pytest.fixture(scope="session")
def pg_study_names(pg_url):
    """`new()` -> a study name unique to this test run; every such study is deleted at the end."""
    names: list[str] = []

    def new() -> str:
        names.append(f"headsearch-test-{uuid.uuid4().hex[:12]}")
        return names[-1]

    yield new
    for name in names:
        delete_study_if_present(name, pg_url)


@pytest.fixture
def pg_study(pg_study_names) -> str:
    """A study name unique to this test; the study is deleted at the end of the session."""
    return pg_study_names()


MYSQL_URL = os.environ.get("HEADSEARCH_TEST_MYSQL", "mysql://root@127.0.0.1:3306/test")
REDIS_URL = os.environ.get("HEADSEARCH_TEST_REDIS", "redis://127.0.0.1:6379/15")


@pytest.fixture(scope="session")
def mysql_url() -> str:
    """A reachable MySQL or MariaDB ($HEADSEARCH_TEST_MYSQL) through PyMySQL."""
    return reachable("MySQL", MYSQL_URL, "HEADSEARCH_TEST_MYSQL", "pymysql", lambda: _select_1(MYSQL_URL))


@pytest.fixture
def mysql_study(mysql_url) -> Iterator[str]:
    """A study name unique to this test in the MySQL database; the study is deleted at the end."""
    yield from unique_study(mysql_url)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """A reachable Redis ($HEADSEARCH_TEST_REDIS; database 15 by default) for Redis-journal storages."""
    def ping() -> None:
        import redis

        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).ping()

    return reachable("Redis", REDIS_URL, "HEADSEARCH_TEST_REDIS", "redis", ping)


@pytest.fixture
def redis_study(redis_url) -> Iterator[str]:
    """A study name unique to this test in the Redis journal; the study is deleted at the end."""
    yield from unique_study(redis_url)


@pytest.fixture(scope="session")
def optuna_dashboard() -> None:
    import importlib.util

    if importlib.util.find_spec("optuna_dashboard") is None:
        unavailable("optuna-dashboard is not installed (pip install -e '.[dev]')")


@pytest.fixture(scope="session")
def tensorboard_package() -> None:
    """The `tensorboard` extra (`--tensorboard` writes through it; the tests read its event files back)."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        unavailable("tensorboard is not installed (pip install -e '.[dev]')")


# ------------------------------------------------------------------------------------------ processes


# Popen's way to a child leading a process group of its own (one signal reaches it and its workers) in this session
# (Linux's autogroup scheduler shares the CPU equally between sessions: test_fairtime.py's crowd must share this
# one). Not a preexec_fn where Python can do without (3.11: process_group): with one, Popen forks rather than
# vforks, and in a test process that has used gRPC (the grpc:// tests) grpcio's fork handlers then crashed the
# child before its exec now and then (SIGABRT after "Epoll1Poller ... epoll_wait error: Bad file descriptor").
# Ctrl-C needs nothing more: this suite runs with Python's SIGINT handler (above), which exec resets to the default.
OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Processes:
    """Processes a test starts, each leading its own process group. `stop(p)` sends the group Ctrl-C and
    kills it if it has not ended within `grace` seconds; at the test's end every group still alive is
    killed, whatever happened in the test, so no search is left running beside the rest of the suite."""

    def __init__(self):
        self.started: list[subprocess.Popen] = []

    def start(self, cmd, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, **OWN_GROUP, **kwargs)
        self.started.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, grace: float = 60.0) -> tuple:
        """Ctrl-C to the process group, then SIGKILL after `grace` s: (stdout, stderr) as communicate gives them."""
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        try:
            return proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            return proc.communicate()

    def end_all(self) -> None:
        for proc in self.started:
            kill_group(proc.pid)  # the leader may have ended and left members of its group behind
            if proc.poll() is None:
                proc.wait()


@pytest.fixture
def processes():
    """`processes.start(cmd, **popen_kwargs)`, `processes.stop(proc)`: see Processes."""
    procs = Processes()
    try:
        yield procs
    finally:
        procs.end_all()
