"""Optuna storages for headsearch: URLs, heartbeats, and a lock that makes a trial budget exact.

- `sqlite:///headsearch.db` (default): one machine; optuna-dashboard reads it as is.
- `postgresql://user@host/db`, `mysql://...`: many workers on many machines.
- `journal:PATH` or a path ending in `.log`: Optuna's JournalStorage on a file; `redis://host:port`
  for a journal in Redis. Journal storages have no heartbeats in Optuna, so a killed worker's trial
  stays RUNNING there: use an RDB storage when workers may die.

RDB storages get heartbeats: a worker records one every `heartbeat` seconds while a trial runs, and
a trial silent for 3 x `heartbeat` is failed by the next worker that starts a trial, which then
re-enqueues it (Optuna's RetryFailedTrialCallback), so the trial is retried and counts once.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import threading
import time
import warnings
import zlib
from pathlib import Path
from typing import Iterator

from headsearch.errors import HeadsearchError

DEFAULT_STORAGE = "sqlite:///headsearch.db"


def absolute_url(url: str) -> str:
    """The same storage from any working directory (sqlite and journal paths made absolute)."""
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(url[len("sqlite:///"):]).resolve())
    if (path := journal_path(url)) is not None:
        return f"journal:{path.resolve()}"
    return url


def normalize_url(url: str) -> str:
    """`postgresql://` means psycopg (v3) to SQLAlchemy 2.1, `mysql://` means mysqlclient (MySQLdb): use
    psycopg2 or PyMySQL instead when that is what is installed."""
    import importlib.util

    scheme, sep, rest = url.partition("://")
    if scheme in ("postgresql", "postgres") and sep:
        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            return f"postgresql+psycopg2://{rest}"
        return f"postgresql://{rest}"
    if scheme == "mysql" and sep:
        if importlib.util.find_spec("MySQLdb") is None and importlib.util.find_spec("pymysql") is not None:
            return f"mysql+pymysql://{rest}"
    return url


_DRIVERS = {"postgresql": "pip install 'headsearch[postgres]' (psycopg2)", "mysql": "pip install pymysql",
            "redis": "pip install 'headsearch[redis]' (redis)"}


def is_rdb(url: str) -> bool:
    return url.split(":", 1)[0].split("+", 1)[0] in ("sqlite", "postgresql", "postgres", "mysql")


def journal_path(url: str) -> Path | None:
    if url.startswith("journal:"):
        return Path(url[len("journal:"):].removeprefix("//"))
    if url.endswith(".log") and "://" not in url:
        return Path(url)
    return None


def sqlite_path(url: str) -> Path | None:
    """The database file of a `sqlite:///FILE` URL (None for other URLs and in-memory databases)."""
    if not url.startswith("sqlite:///"):
        return None
    rest = url[len("sqlite:///"):].split("?", 1)[0]
    return None if rest in ("", ":memory:") else Path(rest)


SQLITE_MAGIC = b"SQLite format 3\x00"


def check_sqlite_file(url: str, db: Path) -> None:
    """The file of a sqlite:/// storage, when it exists, must be a SQLite database (or empty, which
    SQLite starts as a new one): a folder, an unreadable file or another file's bytes get one line."""
    if db.is_dir():
        raise HeadsearchError(f"storage {url}: {db} is a folder, not a database file: pass sqlite:///FILE.db")
    if not db.exists():
        return
    try:
        with open(db, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as e:
        raise HeadsearchError(f"storage {url}: cannot read {db} ({e.strerror}): check its permissions") from None
    if head and head != SQLITE_MAGIC:
        raise HeadsearchError(f"storage {url}: {db} is not a SQLite database: pass another file (or a new name to create one)")


def check_journal_file(url: str, path: Path) -> None:
    """The file of a journal: storage, when it exists, must be an Optuna journal: one JSON object a
    line (Optuna replays the whole file when it opens it, so reading it here costs no more)."""
    if path.is_dir():
        raise HeadsearchError(f"storage {url}: {path} is a folder, not a journal file: pass journal:FILE.log")
    if not path.exists():
        return
    try:
        data = path.read_bytes()
    except OSError as e:
        raise HeadsearchError(f"storage {url}: cannot read {path} ({e.strerror}): check its permissions") from None
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            ok = isinstance(json.loads(line), dict)
        except ValueError:  # not JSON, or not UTF-8
            ok = False
        if not ok:
            raise HeadsearchError(f"storage {url}: {path} is not an Optuna journal (line {lineno} is not a JSON record):"
                                  " pass another file (or a new name to create one)")


def open_storage(url: str, heartbeat: int | None = 30, max_retry: int = 2):
    """An Optuna storage for `url`, with heartbeats and retries for RDB URLs."""
    import optuna
    import inspect

    from optuna.storages import RDBStorage
    from optuna.storages.journal import JournalFileBackend, JournalRedisBackend, JournalStorage

    url = normalize_url(url)
    try:
        if (path := journal_path(url)) is not None:
            check_journal_file(url, path)
            path.parent.mkdir(parents=True, exist_ok=True)
            return JournalStorage(JournalFileBackend(str(path)))
        if url.startswith("redis://"):
            import redis  # noqa: F401  (Optuna's backend and the budget lock need it; missing: one line, below)

            return JournalStorage(JournalRedisBackend(url))
        if not is_rdb(url):
            raise HeadsearchError(
                f"storage {url!r} is not a storage URL: use sqlite:///FILE.db, postgresql://USER@HOST/DB, journal:FILE.log or redis://HOST:PORT"
            )
        if url.startswith("sqlite:///"):
            db = Path(url[len("sqlite:///"):])
            if db.parent and not db.parent.exists():
                raise HeadsearchError(f"storage {url}: the folder {db.parent} does not exist")
            check_sqlite_file(url, db)
        kwargs = {}
        if heartbeat:
            kwargs = dict(heartbeat_interval=heartbeat, grace_period=3 * heartbeat)
            if "heartbeat_stale_trial_callback" in inspect.signature(RDBStorage.__init__).parameters:
                from optuna.storages import RetryHeartbeatStaleTrialCallback  # Optuna >= 4.9

                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
                    kwargs["heartbeat_stale_trial_callback"] = RetryHeartbeatStaleTrialCallback(max_retry=max_retry)
            else:
                from optuna.storages import RetryFailedTrialCallback

                with warnings.catch_warnings():  # "experimental" up to Optuna 4.0
                    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
                    kwargs["failed_trial_callback"] = RetryFailedTrialCallback(max_retry=max_retry)
        with warnings.catch_warnings(), _schema_lock(url):
            # Heartbeats are "experimental" in Optuna's words; we rely on them knowingly.
            warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
            return RDBStorage(url, **kwargs)
    except HeadsearchError:
        raise
    except (ImportError, ModuleNotFoundError):
        scheme = url.split(":", 1)[0].split("+", 1)[0]
        scheme = "postgresql" if scheme == "postgres" else scheme
        hint = _DRIVERS.get(scheme, "install the database driver for it")
        raise HeadsearchError(f"storage {url}: the {scheme} driver is not installed: {hint}") from None
    except Exception as e:  # SQLAlchemy/Redis connection errors come in many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = re.sub(r"^\([\w.]+\) ", "", first)  # SQLAlchemy's "(sqlite3.DatabaseError) " prefix
        if "malformed" in first:
            raise HeadsearchError(f"storage {url}: the database is truncated or corrupt ({first}): restore it or pass another --storage") from None
        raise HeadsearchError(f"cannot open storage {url}: {first}") from None
    finally:
        optuna.logging.set_verbosity(optuna.logging.WARNING)


@contextlib.contextmanager
def _schema_lock(url: str) -> Iterator[None]:
    """Serialise opening an RDB storage across processes. Workers starting together on an empty database
    (a Slurm array's nodes, `--workers N`, a new CI machine) would race to create Optuna's tables and its
    version row: on MySQL/MariaDB the losers fail with "Table ... already exists". PostgreSQL: an advisory
    lock; MySQL: GET_LOCK (both session locks: a killed opener's lock goes with its connection); SQLite: an
    flock on the file beside the database that the budget lock uses."""
    scheme = url.split(":", 1)[0].split("+", 1)[0]
    if url.startswith("sqlite:///") and (db := sqlite_path(url)) is not None:
        with _flock(db):
            yield
        return
    if scheme not in ("postgresql", "postgres", "mysql"):
        yield
        return
    import sqlalchemy as sa

    key = zlib.crc32(b"headsearch:schema")
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if scheme == "mysql":
                # GET_LOCK returns 0 when its wait times out: ask again rather than go on without the lock.
                while conn.execute(sa.text("SELECT GET_LOCK(:k, 60)"), {"k": f"headsearch:schema:{key}"}).scalar() != 1:
                    pass
                unlock, params = "SELECT RELEASE_LOCK(:k)", {"k": f"headsearch:schema:{key}"}
            else:
                conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": key})
                unlock, params = "SELECT pg_advisory_unlock(:k)", {"k": key}
            try:
                yield
            finally:
                with contextlib.suppress(Exception):  # a lost connection released the lock with it
                    conn.execute(sa.text(unlock), params)
    finally:
        engine.dispose()


LOCK_SILENCE = 30  # seconds: a budget lock not renewed for this long belongs to a dead worker and is broken
LOCK_RENEW = 5  # seconds between a live holder's renewals


@contextlib.contextmanager
def budget_lock(url: str, study_name: str) -> Iterator[None]:
    """Serialise "count the trials, then start one" across workers, so a budget of N is exact.

    - SQLite: an flock on a file beside the database (one machine: SQLite itself is not for NFS).
    - Journal files: a lock file `FILE.budget.lock` created with O_EXCL (Optuna's JournalFileOpenLock
      mechanism, which NFSv3+ honours, where flock is unreliable on many NFS setups).
    - Redis journals: a Redis lock (`SET NX` with an expiry) on `headsearch:budget:STUDY` in the same
      Redis.
    - PostgreSQL: an advisory lock; MySQL: GET_LOCK (the database releases both when a worker dies).
    A file or Redis lock is renewed every LOCK_RENEW seconds while held and broken after LOCK_SILENCE
    seconds without renewal, so a killed worker stalls the others for at most that long.
    """
    key = zlib.crc32(f"headsearch:{study_name}".encode())
    url = normalize_url(url)
    if url.startswith("sqlite:///"):
        with _flock(Path(url[len("sqlite:///"):].split("?", 1)[0])):
            yield
        return
    if (path := journal_path(url)) is not None:
        with _journal_file_lock(path):
            yield
        return
    if url.startswith("redis://"):
        with _redis_lock(url, f"headsearch:budget:{study_name}"):
            yield
        return
    scheme = url.split(":", 1)[0].split("+", 1)[0]
    if scheme in ("postgresql", "postgres", "mysql"):
        import sqlalchemy as sa

        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            if scheme == "mysql":
                # GET_LOCK returns 0 when its wait times out: ask again rather than go on without the lock.
                while conn.execute(sa.text("SELECT GET_LOCK(:k, 60)"), {"k": str(key)}).scalar() != 1:
                    pass
            else:
                conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": key})
            try:
                yield
            finally:
                unlock = "SELECT RELEASE_LOCK(:k)" if scheme == "mysql" else "SELECT pg_advisory_unlock(:k)"
                conn.execute(sa.text(unlock), {"k": str(key) if scheme == "mysql" else key})
        engine.dispose()
        return
    yield  # an in-memory SQLite database: one process, nothing to share


@contextlib.contextmanager
def _flock(target: Path) -> Iterator[None]:
    with open(target.with_name(target.name + ".budget.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _journal_file_lock(journal: Path) -> Iterator[None]:
    """A lock file beside a journal, taken by creating it with O_EXCL and released by removing it: the
    mechanism of Optuna's JournalFileOpenLock, which NFSv3 and later honour. Written out here because Optuna
    4.0's class cannot break the lock of a dead holder: the holder touches the file every LOCK_RENEW seconds,
    and a waiter removes one whose modification time has not changed for LOCK_SILENCE seconds."""
    lock_file = Path(str(journal) + ".budget.lock")
    seen, since = None, time.monotonic()
    while True:
        try:
            os.close(os.open(lock_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            try:
                mtime = lock_file.stat().st_mtime_ns
            except FileNotFoundError:  # released between the two calls
                continue
            if mtime != seen:
                seen, since = mtime, time.monotonic()
            elif time.monotonic() - since > LOCK_SILENCE:
                with contextlib.suppress(FileNotFoundError):
                    lock_file.unlink()
                continue
            time.sleep(0.005)
    try:
        with _renewing(lambda: os.utime(lock_file)):
            yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock_file.unlink()


@contextlib.contextmanager
def _redis_lock(url: str, name: str) -> Iterator[None]:
    """A Redis lock in the journal's own Redis: it expires LOCK_SILENCE seconds after its last renewal."""
    import redis

    client = redis.Redis.from_url(url)
    # thread_local=False: the renewing thread must see the token the acquiring thread got.
    lock = client.lock(name, timeout=LOCK_SILENCE, sleep=0.01, thread_local=False)
    lock.acquire(blocking=True)
    try:
        with _renewing(lock.reacquire):
            yield
    finally:
        try:
            lock.release()
        except redis.exceptions.LockError:  # expired while held (a pause beyond LOCK_SILENCE): nothing to release
            pass
        client.close()


@contextlib.contextmanager
def _renewing(renew) -> Iterator[None]:
    """Call `renew()` every LOCK_RENEW seconds, from a daemon thread, until the block ends."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(LOCK_RENEW):
            try:
                renew()
            except Exception:  # a failed renewal is retried; the lock only lapses after LOCK_SILENCE
                pass

    thread = threading.Thread(target=loop, daemon=True, name="headsearch-budget-lock")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=LOCK_RENEW + 1)


class Heartbeat:
    """Record a heartbeat for a running trial every `interval` seconds, from a daemon thread."""

    def __init__(self, storage, trial_id: int, interval: int | None):
        self.storage, self.trial_id, self.interval = storage, trial_id, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Heartbeat":
        if self.interval and hasattr(self.storage, "record_heartbeat"):
            self.storage.record_heartbeat(self.trial_id)
            self._thread = threading.Thread(target=self._beat, daemon=True, name="headsearch-heartbeat")
            self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception:  # a transient storage error must not kill training; the next beat retries
                pass

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
