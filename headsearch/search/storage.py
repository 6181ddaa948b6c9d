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
import logging
import os
import re
import socket
import stat
import threading
import time
import uuid
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
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                # Optuna's lock on appends, broken when a worker died during one (`_JournalAppendLock`), named
                # after the real path: a symlink to the same journal takes the same lock.
                backend = JournalFileBackend(str(path), lock_obj=_JournalAppendLock(os.path.realpath(path) + ".lock"))
            except OSError as e:
                raise HeadsearchError(f"storage {url}: cannot write {path} ({e.strerror or e}): check the permissions"
                                      " of the file and its folder, or pass another --storage") from None
            return JournalStorage(backend)
        if url.startswith("redis://"):
            import redis  # noqa: F401  (Optuna's backend and the budget lock need it; missing: one line, below)

            # Socket timeouts in the URL (redis-py has none by default): a frozen Redis fails, not hangs.
            return JournalStorage(JournalRedisBackend(redis_url_with_timeouts(url)))
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
        if db.exists() and db.stat().st_size > 0:  # made already: readers (report, dashboard) leave no lock file
            yield
            return
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
LOCK_RECONNECT = 60  # seconds a worker keeps trying to reach the database of its budget lock again
LOCK_LOSSES = 5  # database sessions one wait for the budget lock may lose (then the worker stops with one line)
REDIS_TIMEOUT = 30  # seconds: a Redis command unanswered this long fails (a frozen server) instead of hanging
REDIS_CONNECT_TIMEOUT = 10  # seconds to open a connection to Redis
# TCP keepalives of a database lock connection (libpq's parameters; the same timings for PyMySQL's socket): a
# peer gone silent is noticed within about a minute, and an idle lock connection is not dropped unseen.
LOCK_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}

_log = logging.getLogger(__name__)


class LockHold:
    """What `budget_lock` yields. `lost` turns True when the holder learns that the lock was taken from it: a
    waiter broke a file lock this worker had not renewed for LOCK_SILENCE seconds (it was paused or hung), a
    Redis lock expired, the database ended the session that held an advisory lock. Another worker may then
    have been inside at the same time. The holder goes on (it never removes a lock that is not its own) and
    a warning says so once; `reason` says how it was lost."""

    def __init__(self, what: str):
        self.what, self.lost, self.reason = what, False, ""

    def lose(self, reason: str) -> None:
        if not self.lost:
            self.lost, self.reason = True, reason
            _log.warning("headsearch: the budget lock %s was lost while held: %s", self.what, reason)


@contextlib.contextmanager
def budget_lock(url: str, study_name: str) -> Iterator[LockHold]:
    """Serialise "count the trials, then start one" across workers, so a budget of N is exact. Yields a
    `LockHold`, whose `lost` says afterwards whether the lock was taken from this worker meanwhile.

    - SQLite: an flock on a file beside the database (one machine: SQLite itself is not for NFS).
    - Journal files: a lock file `FILE.budget.lock` created with O_EXCL (Optuna's JournalFileOpenLock
      mechanism, which NFSv3+ honours, where flock is unreliable on many NFS setups); `_journal_file_lock`.
    - Redis journals: a Redis lock (`SET NX` with an expiry) on `headsearch:budget:STUDY` in the same
      Redis.
    - PostgreSQL: an advisory lock; MySQL: GET_LOCK (the database releases both when a worker dies), each on
      a connection of its own that no session timeout ends (`_db_lock`).
    A file or Redis lock is renewed every LOCK_RENEW seconds while held and broken after LOCK_SILENCE
    seconds without renewal, so a killed worker stalls the others for at most that long.
    The lock files are named after the real path of the database or journal, so a symlink to the same file
    takes the same lock. A lock that cannot be taken (a lock file that cannot be created, a database that
    does not answer) is one HeadsearchError line.
    """
    key = zlib.crc32(f"headsearch:{study_name}".encode())
    url = normalize_url(url)
    if url.startswith("sqlite:///") and (db := sqlite_path(url)) is not None:
        with _flock(db) as hold:
            yield hold
        return
    if (path := journal_path(url)) is not None:
        with _journal_file_lock(path) as hold:
            yield hold
        return
    if url.startswith("redis://"):
        with _redis_lock(url, f"headsearch:budget:{study_name}") as hold:
            yield hold
        return
    if url.split(":", 1)[0].split("+", 1)[0] in ("postgresql", "postgres", "mysql"):
        with _db_lock(url, key) as hold:
            yield hold
        return
    yield LockHold("in memory")  # an in-memory SQLite database: one process, nothing to share


def _lock_file_error(path: str, e: OSError) -> HeadsearchError:
    folder = os.path.dirname(path) or "."
    return HeadsearchError(
        f"cannot write the lock file {path} ({e.strerror or e}): every worker must be able to create and remove"
        f" files in {folder} (if another user left {os.path.basename(path)} there, remove it), or pass another --storage")


@contextlib.contextmanager
def _flock(target: Path) -> Iterator[LockHold]:
    """An flock on `REAL.budget.lock`, REAL the real path of `target` (a symlink to the database takes the
    same lock). flock needs no write access: a lock file that cannot be opened for writing (another user's)
    is locked through a read-only descriptor; one that can be neither opened nor created is one line."""
    lock_file = os.path.realpath(target) + ".budget.lock"
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        try:
            fd = os.open(lock_file, os.O_RDONLY)
        except OSError:
            raise _lock_file_error(lock_file, e) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # ENOLCK: a file system without locks
            raise HeadsearchError(f"cannot lock {lock_file} ({e.strerror}): put the database on a local disk,"
                                  " or pass another --storage") from None
        yield LockHold(lock_file)
    finally:
        os.close(fd)  # which releases the flock


# -- lock files (the journal's budget lock, Optuna's lock on journal appends) ----------------------------


def _lock_token() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"


def _identity(path: str) -> tuple | None:
    """What a waiter watches of a lock file to tell a dead holder's lock from a live one: it changes when the
    holder renews it (the modification time) or when another lock replaces it (the inode, the owner token
    written in it, or a symlink's target: Optuna's default lock); None when there is no lock file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # a folder that cannot be searched, a path through a regular file
        raise _lock_file_error(path, e) from None
    content: bytes | str | None = None
    with contextlib.suppress(OSError):  # gone meanwhile, or unreadable: the rest tells
        if stat.S_ISLNK(st.st_mode):
            content = os.readlink(path)
        else:
            with open(path, "rb") as f:
                content = f.read(256)
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, content


class _Silence:
    """How long a watched lock file has stayed the same, by this process's clock (the clocks of NFS clients
    and server differ, so a file's modification time is compared only with itself)."""

    def __init__(self) -> None:
        self.seen: tuple | None = None
        self.since = 0.0

    def silent_for(self, identity: tuple) -> float:
        now = time.monotonic()
        if identity != self.seen:
            self.seen, self.since = identity, now
        return now - self.since


def _remove_if(path: str, is_it) -> bool:
    """Remove the lock file `path` if `is_it(its identity)`, atomically: rename it to a name of our own (of
    two processes renaming the same file, one succeeds), then judge the renamed file, which nobody else can
    replace any more. A file that turns out to be another (replaced after it was judged) is put back."""
    aside = f"{path}.{uuid.uuid4().hex}.aside"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise _lock_file_error(path, e) from None
    if is_it(_identity(aside)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)
        return True
    try:  # a hard link puts it back only where no new lock file took the place (rename would overwrite one)
        os.link(aside, path, follow_symlinks=False)
    except FileExistsError:
        pass  # its holder learns at its next renewal that its lock is gone
    except OSError:  # a file system without hard links
        if not os.path.lexists(path):
            with contextlib.suppress(OSError):
                os.rename(aside, path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(aside)
    return False


class _LockFile:
    """One holding of a lock file: created with O_EXCL, holding an owner token (host:pid:uuid), renewed by
    touching its own inode through the descriptor kept open (so a renewal never touches a successor's file),
    and removed only if the path still names that inode (the descriptor kept open also stops the inode
    number from being reused by a successor's file while held)."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None
        self.inode: tuple[int, int] | None = None

    def try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            raise _lock_file_error(self.path, e) from None
        with contextlib.suppress(OSError):  # a full disk: the inode still identifies the holding
            os.write(fd, f"{_lock_token()}\n".encode())
        st = os.fstat(fd)
        self.fd, self.inode = fd, (st.st_dev, st.st_ino)
        return True

    def ours(self) -> bool:
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.inode

    def renew(self) -> bool:
        """Touch the lock file if it is still ours; False when it is not (broken by a waiter)."""
        if not self.ours():
            return False
        os.utime(self.fd)
        return True

    def release(self) -> bool:
        """Remove the lock file if it is still ours, never another's; False when it was not ours any more."""
        try:
            return self.ours() and _remove_if(self.path, lambda identity: identity is not None
                                              and identity[:2] == self.inode)
        except HeadsearchError as e:  # the folder became unwritable: the lock is broken after LOCK_SILENCE
            _log.warning("headsearch: %s", e)
            return True
        finally:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


def _break_stale(path: str, seen: tuple, guard_silence: _Silence) -> None:
    """Remove the lock file `path`, judged stale as `seen`, if it is still that file. Under a guard file
    `PATH.break` (O_EXCL), so that two waiters who judged the same file stale cannot both remove it: the
    second one to get the guard finds a new file there (the first one's, or a third waiter's) and leaves it.
    A guard left by a waiter that died while breaking (a few microseconds) is removed in turn after
    LOCK_SILENCE seconds."""
    guard = _LockFile(path + ".break")
    if not guard.try_create():
        if (g := _identity(guard.path)) is not None and guard_silence.silent_for(g) > LOCK_SILENCE:
            _remove_if(guard.path, lambda identity: identity == g)
        time.sleep(0.01)
        return
    try:
        if _identity(path) == seen and _remove_if(path, lambda identity: identity == seen):
            _log.warning("headsearch: removed the lock file %s: not renewed for %s s, its worker died or hangs",
                         path, LOCK_SILENCE)
    finally:
        guard.release()


def _acquire_lock_file(path: str) -> _LockFile:
    """Wait for the lock file `path` and take it; break it when it stays the same for LOCK_SILENCE seconds."""
    lock, held, guard = _LockFile(path), _Silence(), _Silence()
    pause = 0.001
    while not lock.try_create():
        seen = _identity(path)
        if seen is None:
            continue  # released between the two calls
        if held.silent_for(seen) > LOCK_SILENCE:
            _break_stale(path, seen, guard)
            continue
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
    return lock


@contextlib.contextmanager
def _journal_file_lock(journal: Path) -> Iterator[LockHold]:
    """A lock file beside a journal, `REAL.budget.lock` (REAL the journal's real path), taken by creating it
    with O_EXCL: the mechanism of Optuna's JournalFileOpenLock, which NFSv3 and later honour. Written out
    here because Optuna 4.0's class cannot break the lock of a dead holder, and later ones break it
    check-then-release (two waiters can both break it and both enter). Here (`_LockFile`):
    - the holder writes an owner token into the file, touches the file every LOCK_RENEW seconds through its
      own descriptor, and at the end removes it only if the path still names its own file (rename aside,
      check, unlink; a successor's file moved by mistake is put back): a holder whose lock was broken never
      touches or deletes its successor's lock; it learns it lost the lock (`LockHold.lost`, a warning);
    - a waiter breaks a lock file that has not changed (modification time, inode, token) for LOCK_SILENCE
      seconds by its own clock, under a guard file and only if it is still the same file (`_break_stale`),
      then competes for the lock like any waiter: one of two waiters that judged it stale enters."""
    path = os.path.realpath(journal) + ".budget.lock"
    lock = _acquire_lock_file(path)
    hold = LockHold(path)

    def renew() -> bool:
        if lock.renew():
            return True
        hold.lose("another worker broke it as stale (this one had not renewed it for"
                  f" {LOCK_SILENCE} s: paused or hung); its lock file was left in place")
        return False

    try:
        with _renewing(renew):
            yield hold
    finally:
        if not lock.release():
            hold.lose(f"another worker broke it as stale (this one had not renewed it for {LOCK_SILENCE} s:"
                      " paused or hung); its lock file was left in place")


class _JournalAppendLock:
    """Optuna's own lock on a journal file, `REAL.lock`, held while a worker appends to the journal, taken
    the way the journal's budget lock is (`_journal_file_lock`): renewed while held, broken after LOCK_SILENCE
    seconds without a change, under a guard, and removed only by its owner. Given to JournalFileBackend on
    every Optuna version: with 4.0's default lock (JournalFileSymlinkLock, no grace period) the lock of a
    worker killed during an append is never broken and every later append waits forever; later versions'
    grace period breaks it check-then-release. A file (or Optuna's symlink) at the same path excludes both
    ways, so a plain Optuna process writing the same journal and a headsearch worker still exclude each
    other."""

    def __init__(self, path: str):
        self.path = path
        self._held: tuple | None = None

    def acquire(self) -> bool:
        lock = _acquire_lock_file(self.path)
        renewing = _renewing(lock.renew)
        renewing.__enter__()
        self._held = (lock, renewing)
        return True

    def release(self) -> None:
        if self._held is None:
            return
        (lock, renewing), self._held = self._held, None
        renewing.__exit__(None, None, None)
        if not lock.release():
            _log.warning("headsearch: the journal lock %s was broken during a write (this worker did not renew it"
                         " for %s s): another worker may have written at the same time", self.path, LOCK_SILENCE)

    def __getstate__(self) -> dict:  # JournalStorage is picklable; a holding is not
        return {"path": self.path, "_held": None}


# -- Redis ----------------------------------------------------------------------------------------------


def redis_url_with_timeouts(url: str) -> str:
    """`url` with socket timeouts and keepalives as query parameters, unless it sets its own: redis-py has no
    socket timeout by default (up to 7 at least), so a frozen Redis would hang a worker in any command.
    Optuna's JournalRedisBackend takes only a URL, and redis-py's `from_url` reads these from it."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    for name, value in (("socket_timeout", REDIS_TIMEOUT), ("socket_connect_timeout", REDIS_CONNECT_TIMEOUT),
                        ("socket_keepalive", "true"), ("health_check_interval", 30)):
        query.setdefault(name, str(value))
    return urlunsplit(parts._replace(query=urlencode(query)))


@contextlib.contextmanager
def _redis_lock(url: str, name: str) -> Iterator[LockHold]:
    """A Redis lock in the journal's own Redis: it expires LOCK_SILENCE seconds after its last renewal. A Redis
    that does not answer within REDIS_TIMEOUT seconds is one HeadsearchError line."""
    import redis

    client = redis.Redis.from_url(redis_url_with_timeouts(url))
    hold = LockHold(f"{name} in {url}")
    # thread_local=False: the renewing thread must see the token the acquiring thread got.
    lock = client.lock(name, timeout=LOCK_SILENCE, sleep=0.01, thread_local=False)
    try:
        try:
            lock.acquire(blocking=True)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            raise HeadsearchError(f"budget lock in Redis {url}: {e or type(e).__name__}: check that the server runs"
                                  f" and answers (each command waits {REDIS_TIMEOUT} s at most)") from None

        def renew() -> bool:
            try:
                lock.reacquire()
            except redis.exceptions.LockNotOwnedError:
                hold.lose(f"it expired (not renewed for {LOCK_SILENCE} s: this worker was paused or Redis"
                          " unreachable) and another worker may hold it")
                return False
            return True

        try:
            with _renewing(renew):
                yield hold
        finally:
            try:
                lock.release()
            except redis.exceptions.LockError:  # expired while held (a pause beyond LOCK_SILENCE)
                hold.lose(f"it expired (not renewed for {LOCK_SILENCE} s) and another worker may hold it")
            except redis.exceptions.RedisError as e:
                _log.warning("headsearch: could not release the budget lock %s in %s (%s): it expires by itself"
                             " after %s s", name, url, e, LOCK_SILENCE)
    finally:
        with contextlib.suppress(Exception):
            client.close()


# -- PostgreSQL and MySQL -----------------------------------------------------------------------------------


def _db_error_line(e: BaseException) -> str:
    text = str(getattr(e, "orig", None) or e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _lock_engine(url: str):
    """An engine for lock connections: autocommit, TCP keepalives (psycopg: libpq's keepalives parameters; PyMySQL: the
    socket's options once connected; mysqlclient has no way to set them, the system's timings apply) and a
    connect timeout, unless the URL sets its own."""
    import sqlalchemy as sa

    u = sa.engine.make_url(url)
    driver = u.get_dialect().driver
    args: dict = {}
    if driver in ("psycopg2", "psycopg"):
        args = {k: v for k, v in {**LOCK_KEEPALIVES, "connect_timeout": 10}.items() if k not in u.query}
    # Autocommit: a session-level lock needs no transaction, and one left open would make the holder's
    # session "idle in transaction" (which idle_in_transaction_session_timeout ends).
    engine = sa.create_engine(u, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT", connect_args=args)
    if driver == "pymysql":
        sa.event.listen(engine, "connect", _pymysql_keepalives)
    return engine


def _pymysql_keepalives(dbapi_connection, _record) -> None:
    """PyMySQL turns SO_KEEPALIVE on with the system's timings (the first probe after two hours on Linux)."""
    sock = getattr(dbapi_connection, "_sock", None)
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", "keepalives_idle"), ("TCP_KEEPINTVL", "keepalives_interval"),
                              ("TCP_KEEPCNT", "keepalives_count")):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), LOCK_KEEPALIVES[value])


def _lock_session(conn, mysql: bool) -> None:
    """No session or statement timeout on the lock connection, whatever the server's or the user's defaults
    (PGOPTIONS, init_command): a waiter waits, and a holder's idle session is not ended under it."""
    import sqlalchemy as sa

    if mysql:
        # MariaDB has max_statement_time, MySQL max_execution_time: each refuses the other's.
        for setting in ("SET SESSION wait_timeout = 31536000", "SET SESSION max_statement_time = 0",
                        "SET SESSION max_execution_time = 0"):
            with contextlib.suppress(sa.exc.ProgrammingError, sa.exc.OperationalError, sa.exc.InternalError):
                conn.execute(sa.text(setting))
        return
    settings = ["statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout"]
    if (conn.dialect.server_version_info or (0,)) >= (14,):
        settings.append("idle_session_timeout")
    for name in settings:
        conn.execute(sa.text(f"SET {name} = 0"))


def _db_acquire(engine, mysql: bool, key: int, shown: str):
    """A connection holding the lock `key`. A session the server ends during the wait (a restart, a killed
    session, a timeout) is opened again and the wait goes on: up to LOCK_LOSSES sessions, and LOCK_RECONNECT
    seconds to reach the server each time; then one HeadsearchError line."""
    import sqlalchemy as sa

    losses, outage, pause = 0, None, 0.5
    while True:
        try:
            conn = engine.connect()
        except sa.exc.DBAPIError as e:
            outage = outage or time.monotonic()
            if time.monotonic() - outage > LOCK_RECONNECT:
                raise HeadsearchError(f"budget lock on {shown}: cannot reach the database (tried for {LOCK_RECONNECT} s):"
                                      f" {_db_error_line(e)}") from None
            time.sleep(pause)
            pause = min(2 * pause, 5)
            continue
        outage, pause = None, 0.5
        try:
            _lock_session(conn, mysql)
            if mysql:
                # GET_LOCK returns 0 when its wait times out: ask again rather than go on without the lock.
                while conn.execute(sa.text("SELECT GET_LOCK(:k, 60)"), {"k": str(key)}).scalar() != 1:
                    pass
            else:
                conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": key})
            return conn
        except sa.exc.DBAPIError as e:
            with contextlib.suppress(Exception):
                conn.close()
            if not (e.connection_invalidated or isinstance(e, sa.exc.OperationalError)):
                raise HeadsearchError(f"budget lock on {shown}: {_db_error_line(e)}") from None
            losses += 1
            if losses >= LOCK_LOSSES:
                raise HeadsearchError(
                    f"budget lock on {shown}: the database ended this worker's session {losses} times while it"
                    f" waited for the lock (last: {_db_error_line(e)}): check the server (restarts, killed sessions)") from None
            _log.warning("headsearch: the database ended the session waiting for the budget lock on %s (%s):"
                         " waiting again on a new one", shown, _db_error_line(e))
        except BaseException:
            with contextlib.suppress(Exception):
                conn.close()
            raise


@contextlib.contextmanager
def _db_lock(url: str, key: int) -> Iterator[LockHold]:
    """PostgreSQL's advisory lock or MySQL's GET_LOCK on a connection of its own, made to last while held: in
    autocommit (never "idle in transaction"), with no session timeouts (`_lock_session`), TCP keepalives
    (`_lock_engine`). A session the server ends anyway released the lock with it: the holder learns it at
    unlock (`LockHold.lost`, a warning), not as a traceback."""
    import sqlalchemy as sa

    mysql = url.split(":", 1)[0].split("+", 1)[0] == "mysql"
    shown = sa.engine.make_url(url).render_as_string(hide_password=True)
    hold = LockHold(f"on {shown}")
    engine = _lock_engine(url)
    try:
        conn = _db_acquire(engine, mysql, key, shown)
        try:
            yield hold
        finally:
            try:
                if mysql:
                    released = conn.execute(sa.text("SELECT RELEASE_LOCK(:k)"), {"k": str(key)}).scalar()
                else:
                    released = conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key}).scalar()
                if not released:
                    hold.lose("its database session no longer held it")
            except sa.exc.DBAPIError as e:
                hold.lose(f"the database ended its session ({_db_error_line(e)}), which released the lock then")
            finally:
                with contextlib.suppress(Exception):
                    conn.close()
    finally:
        engine.dispose()


@contextlib.contextmanager
def _renewing(renew) -> Iterator[None]:
    """Call `renew()` every LOCK_RENEW seconds, from a daemon thread, until the block ends or `renew` returns
    False (the lock is no longer this holder's: renewing it would renew a successor's)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(LOCK_RENEW):
            try:
                if renew() is False:
                    return
            except Exception:  # a failed renewal is retried; the lock only lapses after LOCK_SILENCE
                pass

    thread = threading.Thread(target=loop, daemon=True, name="headsearch-budget-lock")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=LOCK_RENEW + 1)
