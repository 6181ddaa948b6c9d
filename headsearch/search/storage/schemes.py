"""The storages headsearch accepts, one row per URL scheme in one table (`SCHEMES`). A row says how to recognise
its URLs, normalise them and make them absolute, check one before opening it, open the Optuna storage, how a
dead worker's trial is found there (`liveness`), take the schema lock and the budget lock, and where its file
(and so the study's artifacts) is. The functions every other module calls (`open_storage`, `budget_lock`,
`normalize_url`, `absolute_url`, `journal_path`, `sqlite_path`, `artifact_dir`) look the URL up in the table;
a URL no row claims is refused in one line, never served by a default. Adding a storage is one
`register_storage` call, which another package may make (tests/test_storage_schemes.py adds a toy one)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

from headsearch.errors import ConfigError, HeadsearchError
from headsearch.search.storage.locks import LockHold, _flock, _journal_file_lock, _JournalAppendLock
from headsearch.search.storage.server_locks import _db_lock, _redis_lock, redis_url_with_timeouts

DEFAULT_STORAGE = "sqlite:///headsearch.db"


def _same(url: str) -> str:
    return url


def _nothing(url: str) -> None:
    """No check to make (`StorageScheme.check`), no file (`StorageScheme.file`)."""
    return None


# How a dead worker's RUNNING trial is found on a storage, and so failed and retried (`StorageScheme.liveness`).
LIVENESS = {
    "heartbeats": "`open` gives Optuna's RDBStorage (`open_rdb_storage`), whose running trials record heartbeats",
    "leases": "headsearch keeps a lease per running trial (`liveness.TrialLeases`): in a folder beside the row's"
              " `file(url)`, or in the Redis of a URL normalised to redis://",
    "stored leases": "headsearch keeps a lease per running trial in the storage itself, a system attribute of the"
                     " trial (`liveness.TrialLeases`), for a storage through which nothing but Optuna's calls passes"
                     " (Optuna's gRPC proxy: no heartbeats)",
    "none": "nothing: a killed worker's trial stays RUNNING and holds its place in the budget; a worker (a resumed"
            " search too) stops when only running trials are left, rather than wait for them",
}


@dataclass(frozen=True)
class StorageScheme:
    """One row of `SCHEMES`: a kind of storage URL. `claims` and `normalize` see a URL as the user gave it; the
    other functions get it as `normalize` returned it.

    - `claims(url)`: whether the URL is this scheme's. The first row (in registration order) that claims a URL
      serves it.
    - `open(url, heartbeat, max_retry)`: the Optuna storage. `heartbeat`: seconds between a running trial's
      heartbeats, None for none; `max_retry`: how often a dead worker's trial is retried. Storages without
      heartbeats ignore both.
    - `liveness`: how a dead worker's trial is found there: one key of `LIVENESS`, which says what each needs.
    - `budget_lock(url, study_name)`: a context manager yielding a `LockHold`, held while a worker counts the
      study's trials and starts one; the budget is exact because every worker of the study takes the same lock.
    - `schema_lock(url)`: held while `open` runs, so that workers opening a new storage together do not race to
      create it; none by default.
    - `normalize(url)`: the URL as Optuna and SQLAlchemy should get it (the driver that is installed);
      `absolute(url)`: the same storage from any working directory (it goes into a trial's study.json); both
      unchanged by default.
    - `check(url)`: one HeadsearchError line, before opening, for what can be told without opening.
    - `file(url)`: the storage's file when it is one: the study's artifacts go beside it (`artifact_dir`).
    - `driver`: how to install what `open` could not import.
    - `example`: the form of its URLs, listed when a URL is refused."""

    name: str
    example: str
    claims: Callable[[str], bool]
    open: Callable[[str, int | None, int], Any]
    liveness: str
    budget_lock: Callable[[str, str], ContextManager[LockHold]]
    schema_lock: Callable[[str], ContextManager[Any]] = contextlib.nullcontext
    normalize: Callable[[str], str] = _same
    absolute: Callable[[str], str] = _same
    check: Callable[[str], None] = _nothing
    file: Callable[[str], Path | None] = _nothing
    driver: str = "install the database driver for it"

    def artifact_dir(self, url: str) -> Path:
        """Beside the storage's file (sqlite:///runs/x.db -> runs/x-artifacts), where `headsearch dashboard` looks;
        ./headsearch-artifacts for a storage on a server."""
        path = self.file(url)
        return path.with_name(f"{path.stem}-artifacts") if path is not None else Path("headsearch-artifacts")


SCHEMES: dict[str, StorageScheme] = {}


def register_storage(scheme: StorageScheme, *, replace: bool = False) -> StorageScheme:
    """Add `scheme` to `SCHEMES` (for this process): `--storage` and every function of this package reach its URLs
    from then on. A name taken is refused unless `replace`, and so is a scheme whose example URL an earlier row
    claims (no URL of that form would ever reach it), and one whose liveness is unknown or has nowhere to live."""
    if not isinstance(scheme, StorageScheme):
        raise ConfigError(f"register_storage() takes a StorageScheme, not {type(scheme).__name__}")
    _check_liveness(scheme)
    if scheme.name in SCHEMES and not replace:
        raise ConfigError(f"a storage scheme named {scheme.name!r} is registered already")
    if not scheme.claims(scheme.example):
        raise ConfigError(f"storage scheme {scheme.name!r}: its example {scheme.example!r} is not one of its URLs")
    earlier = find_scheme(scheme.example)
    if earlier is not None and earlier.name != scheme.name:
        raise ConfigError(f"storage scheme {scheme.name!r}: the scheme {earlier.name!r} claims its URLs"
                          f" ({scheme.example}) already")
    SCHEMES[scheme.name] = scheme
    return scheme


def _check_liveness(scheme: StorageScheme) -> None:
    """One ConfigError line for a liveness not in `LIVENESS`, or for leases with nowhere to go (no file, no Redis)."""
    if scheme.liveness not in LIVENESS:
        raise ConfigError(f"storage scheme {scheme.name!r}: unknown liveness {scheme.liveness!r}: use one of"
                          f" {', '.join(LIVENESS)}")
    url = scheme.normalize(scheme.example)
    if scheme.liveness == "leases" and scheme.file(url) is None and not url.startswith("redis://"):
        raise ConfigError(f"storage scheme {scheme.name!r}: its leases go beside its file or in its Redis, and its"
                          " URLs have neither: give it a file(url), or liveness 'none'")


def find_scheme(url: str) -> StorageScheme | None:
    """The row serving `url`, or None when no row claims it."""
    return next((scheme for scheme in SCHEMES.values() if scheme.claims(url)), None)


def storage_scheme(url: str) -> StorageScheme:
    """The row serving `url`; one ConfigError line listing the known URL forms when no row claims it."""
    scheme = find_scheme(url)
    if scheme is None:
        raise ConfigError(f"storage {url!r} is not a storage URL: use {known_urls()}")
    return scheme


def known_urls() -> str:
    """'sqlite:///FILE.db, ... or redis://HOST:PORT': the URL forms of the registered schemes."""
    examples = [scheme.example for scheme in SCHEMES.values()]
    return examples[0] if len(examples) == 1 else f"{', '.join(examples[:-1])} or {examples[-1]}"


# -- what the rest of headsearch calls: lookups in the table ----------------------------------------------


def open_storage(url: str, heartbeat: int | None = 30, max_retry: int = 2):
    """An Optuna storage for `url`, opened by its row (checked first, under the row's schema lock), with
    heartbeats and retries where the storage has them. Whatever fails is one HeadsearchError line."""
    import optuna

    scheme = storage_scheme(url)
    url = scheme.normalize(url)
    try:
        scheme.check(url)
        with scheme.schema_lock(url):
            return scheme.open(url, heartbeat, max_retry)
    except HeadsearchError:
        raise
    except ImportError:
        raise HeadsearchError(f"storage {url}: the {scheme.name} driver is not installed: {scheme.driver}") from None
    except Exception as e:  # SQLAlchemy/Redis connection errors come in many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = re.sub(r"^\([\w.]+\) ", "", first)  # SQLAlchemy's "(sqlite3.DatabaseError) " prefix
        if "malformed" in first:
            raise HeadsearchError(f"storage {url}: the database is truncated or corrupt ({first}): restore it or"
                                  " pass another --storage") from None
        raise HeadsearchError(f"cannot open storage {url}: {first}") from None
    finally:
        optuna.logging.set_verbosity(optuna.logging.WARNING)


def budget_lock(url: str, study_name: str) -> ContextManager[LockHold]:
    """Serialise "count the trials, then start one" across workers, so a budget of N is exact: the budget lock of
    `url`'s row, a context manager yielding a `LockHold` (whose `lost` says afterwards whether the lock was taken
    from this worker meanwhile). A URL no row claims is refused here, never served without a lock.

    - SQLite: an flock on a file beside the database (one machine: SQLite itself is not for NFS).
    - Journal files: a lock file `FILE.budget.lock` created with O_EXCL (Optuna's JournalFileOpenLock
      mechanism, which NFSv3+ honours, where flock is unreliable on many NFS setups); `locks._journal_file_lock`.
    - Redis journals: a Redis lock (`SET NX` with an expiry) on `headsearch:budget:STUDY` in the same Redis.
    - PostgreSQL: an advisory lock; MySQL: GET_LOCK (the database releases both when a worker dies), each on
      a connection of its own that no session timeout ends (`server_locks._db_lock`).
    A file or Redis lock is renewed every LOCK_RENEW seconds while held and broken after LOCK_SILENCE
    seconds without renewal, so a killed worker stalls the others for at most that long.
    The lock files are named after the real path of the database or journal, so a symlink to the same file
    takes the same lock. A lock that cannot be taken (a lock file that cannot be created, a database that
    does not answer) is one HeadsearchError line.
    """
    scheme = storage_scheme(url)
    return scheme.budget_lock(scheme.normalize(url), study_name)


def normalize_url(url: str) -> str:
    """`url` as its row normalises it (unchanged when no row claims it: opening it says so)."""
    scheme = find_scheme(url)
    return scheme.normalize(url) if scheme is not None else url


def absolute_url(url: str) -> str:
    """The same storage from any working directory (sqlite and journal paths made absolute)."""
    scheme = find_scheme(url)
    return scheme.absolute(url) if scheme is not None else url


def artifact_dir(url: str) -> Path:
    """Where the artifacts of a study in `url` go (`StorageScheme.artifact_dir`)."""
    scheme = find_scheme(url)
    return scheme.artifact_dir(url) if scheme is not None else Path("headsearch-artifacts")


def journal_path(url: str) -> Path | None:
    """The journal file of a `journal:FILE` URL (or a bare path ending in .log); None for other URLs."""
    scheme = find_scheme(url)
    return _journal_file(url) if scheme is not None and scheme.name == "journal" else None


def sqlite_path(url: str) -> Path | None:
    """The database file of a `sqlite:///FILE` URL (None for other URLs and in-memory databases)."""
    scheme = find_scheme(url)
    return _sqlite_file(url) if scheme is not None and scheme.name == "sqlite" else None


# -- SQLite, PostgreSQL, MySQL: Optuna's RDBStorage ---------------------------------------------------------


def _base_scheme(url: str) -> str:
    """'postgresql' for postgresql+psycopg2://...: the part before the driver, when there is a ':'."""
    return url.split(":", 1)[0].split("+", 1)[0] if ":" in url else ""


def is_mysql(url: str) -> bool:
    """Whether `url` is a MySQL (or MariaDB) database's, whatever its driver: the one test of it (row, locks)."""
    return _base_scheme(url) == "mysql"


def open_rdb_storage(url: str, heartbeat: int | None, max_retry: int):
    """Optuna's RDBStorage on `url`. With `heartbeat` seconds: a worker records one every `heartbeat` seconds
    while a trial runs, and a trial silent for 3 x `heartbeat` is failed by the next worker that starts a trial,
    which then re-enqueues it (up to `max_retry` times), so the trial is retried and counts once."""
    import inspect

    import optuna
    from optuna.storages import RDBStorage

    with warnings.catch_warnings():
        # Heartbeats are "experimental" in Optuna's words; we rely on them knowingly.
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        kwargs = {}
        if heartbeat:
            kwargs = dict(heartbeat_interval=heartbeat, grace_period=3 * heartbeat)
            if not url.startswith("sqlite"):
                from headsearch.search.storage.pool import worker_pool

                kwargs["engine_kwargs"] = worker_pool()
            if "heartbeat_stale_trial_callback" in inspect.signature(RDBStorage.__init__).parameters:
                from optuna.storages import RetryHeartbeatStaleTrialCallback  # Optuna >= 4.9

                kwargs["heartbeat_stale_trial_callback"] = RetryHeartbeatStaleTrialCallback(max_retry=max_retry)
            else:
                from optuna.storages import RetryFailedTrialCallback  # "experimental" up to Optuna 4.0

                kwargs["failed_trial_callback"] = RetryFailedTrialCallback(max_retry=max_retry)
        return RDBStorage(url, **kwargs)


def _db_budget_lock(url: str, study_name: str) -> ContextManager[LockHold]:
    return _db_lock(url, zlib.crc32(f"headsearch:{study_name}".encode()), is_mysql(url))


# The schema lock's key: PostgreSQL's advisory lock takes it as is; MySQL's GET_LOCK named str(key), like the budget's.
SCHEMA_LOCK_KEY = zlib.crc32(b"headsearch:schema")


def _db_open_lock(url: str) -> ContextManager[LockHold]:
    """Serialise opening a PostgreSQL or MySQL storage across processes: workers starting together on an empty
    database (a Slurm array's nodes, `--workers N`, a new CI machine) would race to create Optuna's tables and its
    version row (on MySQL/MariaDB the losers fail with "Table ... already exists"). The budget's session lock with
    a key of its own; not patient: a database that does not answer fails the opening at once."""
    return _db_lock(url, SCHEMA_LOCK_KEY, is_mysql(url), kind="schema lock", patient=False)


def _sqlite_file(url: str) -> Path | None:
    if not url.startswith("sqlite:///"):
        return None
    rest = url[len("sqlite:///"):].split("?", 1)[0]
    return None if rest in ("", ":memory:") else Path(rest)


def _sqlite_absolute(url: str) -> str:
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(url[len("sqlite:///"):]).resolve())
    return url


SQLITE_MAGIC = b"SQLite format 3\x00"


def _read_file(url: str, path: Path, kind: str, size: int = -1) -> bytes:
    """The first `size` bytes (-1: all) of the file of storage `url`; b"" while there is none. A folder or an
    unreadable file is one HeadsearchError line (`kind`: what the file should be, and how to pass one)."""
    if path.is_dir():
        raise HeadsearchError(f"storage {url}: {path} is a folder, not a {kind}")
    if not path.exists():
        return b""
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError as e:
        raise HeadsearchError(f"storage {url}: cannot read {path} ({e.strerror}): check its permissions") from None


def check_sqlite_file(url: str, db: Path) -> None:
    """The file of a sqlite:/// storage, when it exists, must be a SQLite database (or empty, which
    SQLite starts as a new one): a folder, an unreadable file or another file's bytes get one line."""
    head = _read_file(url, db, "database file: pass sqlite:///FILE.db", len(SQLITE_MAGIC))
    if head and head != SQLITE_MAGIC:
        raise HeadsearchError(f"storage {url}: {db} is not a SQLite database: pass another file (or a new name to"
                              " create one)")


def _check_sqlite(url: str) -> None:
    if url.startswith("sqlite:///"):
        db = Path(url[len("sqlite:///"):])
        if db.parent and not db.parent.exists():
            raise HeadsearchError(f"storage {url}: the folder {db.parent} does not exist")
        check_sqlite_file(url, db)


def _sqlite_schema_lock(url: str) -> ContextManager[Any]:
    """The flock the budget lock uses, while Optuna creates its tables in a new database file. None once the file
    holds a database (readers such as `report` and the dashboard then leave no lock file), nor in memory."""
    db = _sqlite_file(url)
    if db is None or (db.exists() and db.stat().st_size > 0):
        return contextlib.nullcontext()
    return _flock(db)


def _sqlite_budget_lock(url: str, study_name: str) -> ContextManager[LockHold]:
    db = _sqlite_file(url)
    if db is None:  # an in-memory database: one process, nothing to share
        return contextlib.nullcontext(LockHold("in memory"))
    return _flock(db)


def _driver_url(url: str, schemes: tuple[str, ...], default: str, fallback: str) -> str:
    """`url` under its scheme's first spelling (`schemes`), with the driver `fallback` when that is what is
    installed and the driver SQLAlchemy means by the scheme (the module `default`) is not: `postgresql://` means
    psycopg (v3) to SQLAlchemy 2.1 (psycopg2 instead), `mysql://` mysqlclient (MySQLdb; PyMySQL instead)."""
    import importlib.util

    scheme, sep, rest = url.partition("://")
    if scheme not in schemes or not sep:
        return url
    if importlib.util.find_spec(default) is None and importlib.util.find_spec(fallback) is not None:
        return f"{schemes[0]}+{fallback}://{rest}"
    return f"{schemes[0]}://{rest}"


# -- Optuna's JournalStorage: on a file, in Redis ----------------------------------------------------------


def _journal_file(url: str) -> Path | None:
    if url.startswith("journal:"):
        return Path(url[len("journal:"):].removeprefix("//"))
    if url.endswith(".log") and "://" not in url:
        return Path(url)
    return None


def check_journal_file(url: str, path: Path) -> None:
    """The file of a journal: storage, when it exists, must be an Optuna journal: one JSON object a
    line (Optuna replays the whole file when it opens it, so reading it here costs no more)."""
    data = _read_file(url, path, "journal file: pass journal:FILE.log")
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


def _journal_absolute(url: str) -> str:
    return f"journal:{_journal_file(url).resolve()}"


def _check_journal(url: str) -> None:
    check_journal_file(url, _journal_file(url))


def _journal_budget_lock(url: str, study_name: str) -> ContextManager[LockHold]:
    return _journal_file_lock(_journal_file(url))


def _open_journal_file(url: str, heartbeat: int | None, max_retry: int):
    """Optuna's JournalStorage on a file. Journals have no heartbeats in Optuna, so a killed worker's trial stays
    RUNNING there (headsearch's trial leases, search/liveness.py, find it)."""
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    path = _journal_file(url)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Optuna's lock on appends, broken when a worker died during one (`_JournalAppendLock`), named
        # after the real path: a symlink to the same journal takes the same lock.
        backend = JournalFileBackend(str(path), lock_obj=_JournalAppendLock(os.path.realpath(path) + ".lock"))
    except OSError as e:
        raise HeadsearchError(f"storage {url}: cannot write {path} ({e.strerror or e}): check the permissions"
                              " of the file and its folder, or pass another --storage") from None
    return JournalStorage(backend)


def _open_redis_journal(url: str, heartbeat: int | None, max_retry: int):
    import redis  # noqa: F401  (Optuna's backend and the budget lock need it; missing: the row's driver line)
    from optuna.storages.journal import JournalRedisBackend, JournalStorage

    # Socket timeouts in the URL (redis-py has none by default): a frozen Redis fails, not hangs.
    return JournalStorage(JournalRedisBackend(redis_url_with_timeouts(url)))


# -- the built-in rows, in the order their URLs are tried (and listed) -------------------------------------

register_storage(StorageScheme(
    name="sqlite", example="sqlite:///FILE.db", claims=lambda url: _base_scheme(url) == "sqlite",
    open=open_rdb_storage, budget_lock=_sqlite_budget_lock, schema_lock=_sqlite_schema_lock,
    absolute=_sqlite_absolute, check=_check_sqlite, file=_sqlite_file, liveness="heartbeats"))
register_storage(StorageScheme(
    name="postgresql", example="postgresql://USER@HOST/DB",
    claims=lambda url: _base_scheme(url) in ("postgresql", "postgres"),
    open=open_rdb_storage, budget_lock=_db_budget_lock, schema_lock=_db_open_lock,
    normalize=lambda url: _driver_url(url, ("postgresql", "postgres"), "psycopg", "psycopg2"),
    driver="pip install 'headsearch[postgres]' (psycopg2)", liveness="heartbeats"))
register_storage(StorageScheme(
    name="mysql", example="mysql://USER@HOST/DB", claims=is_mysql,
    open=open_rdb_storage, budget_lock=_db_budget_lock, schema_lock=_db_open_lock,
    normalize=lambda url: _driver_url(url, ("mysql",), "MySQLdb", "pymysql"),
    driver="pip install pymysql", liveness="heartbeats"))
register_storage(StorageScheme(
    name="journal", example="journal:FILE.log", claims=lambda url: _journal_file(url) is not None,
    open=_open_journal_file, budget_lock=_journal_budget_lock, absolute=_journal_absolute, check=_check_journal,
    file=_journal_file, liveness="leases"))
register_storage(StorageScheme(
    name="redis", example="redis://HOST:PORT", claims=lambda url: url.startswith("redis://"),
    open=_open_redis_journal, budget_lock=_redis_lock, driver="pip install 'headsearch[redis]' (redis)",
    liveness="leases"))
