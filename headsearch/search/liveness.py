"""Whether the storage is there, and whether each running trial's worker is alive.

- **A patient storage** (`patient`): an Optuna storage whose calls, when the storage cannot be reached (a
  database restarting, a Redis stall, a dropped connection), are tried again for up to `patience` seconds
  with a line on stderr, then raise `StorageUnavailable` (one line: what to do). Nothing is recorded as
  failed for good: the running trial's heartbeat or lease stops, and a resumed search retries it.
- **Leases** (`TrialLeases`): Optuna records heartbeats on database storages only (its journal-heartbeat
  proposal was closed unmerged), so on a journal file or a Redis journal a killed worker's trial would stay
  RUNNING and hold a budget place forever. headsearch keeps a lease per running trial on a storage whose row
  declares `liveness="leases"` (search/storage/schemes.py `LIVENESS`), renewed with the heartbeat: a file per
  trial in `FILE.leases/` beside the storage's file, a key per trial in a Redis journal; on a grpc:// storage
  (`liveness="stored leases"`: Optuna's gRPC proxy passes no heartbeat) a system attribute of the trial.
- **Silence** (`SilenceWatch`): a lease, or a database trial that never recorded a heartbeat, is judged by
  what this worker saw of it on its own monotonic clock: unchanged for `silence` seconds means its worker
  is gone. No clocks of two machines are compared (a journal's NFS mtimes, a skewed node).
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
import uuid
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable

from headsearch.environment import env_value
from headsearch.errors import HeadsearchError, cause_chain
from headsearch.io import hide_passwords
from headsearch.search.optuna_private import PRIVATE_STORAGE_CALLS, inner_backend
from headsearch.search.storage import open_storage, storage_scheme
from headsearch.search.storage.locks import Silence


# What StorageUnavailable says after why (a grpc:// worker finds it in its proxy's error, `_grpc_unavailable`).
_STOPPED = (": the search stopped; finished trials are kept, and the same command resumes once the storage is back"
            " (the running trial is retried)")


class StorageUnavailable(HeadsearchError):
    """The storage could not be reached for `patience` seconds: the search stops; resuming retries its trials."""


# The driver errors that mean the server is not there, or not now (not a bad query, not a constraint).
_GONE = ("OperationalError", "InterfaceError", "DisconnectionError", "ConnectionError", "TimeoutError",
         "BusyLoadingError", "ConnectionRefusedError", "ConnectionResetError", "BrokenPipeError")
_DRIVERS = ("sqlalchemy", "redis", "psycopg", "pymysql", "MySQLdb", "sqlite3", "builtins")


def unavailable(e: BaseException) -> str | None:
    """The first line of why the storage could not be reached when `e` (or what caused it) says so; None
    for any other error (a bug, a finished trial updated, a constraint), which is not retried. A server that
    refuses a connection for being full (PostgreSQL's "too many clients", a role's connection limit, MySQL's
    "Too many connections") is a driver's OperationalError like an outage, and is waited out the same way."""
    for err in cause_chain(e, suppressed=True):
        kind = type(err)
        if kind.__name__ in _GONE and (kind.__module__ or "").startswith(_DRIVERS):
            text = str(err).strip()
            first = text.splitlines()[0] if text else kind.__name__
            return re.sub(r"^\([\w.]+\) ", "", first)[:200]
        if (why := _grpc_unavailable(err)) is not None:
            return why
    return None


def _grpc_unavailable(err: BaseException) -> str | None:
    """Why a call through Optuna's gRPC proxy (a grpc:// storage) found no storage: the proxy does not answer
    (status UNAVAILABLE: stopped, restarting, unreachable), or the database behind it stayed away for the
    proxy's own patience (`headsearch storage-server` serves a patient storage: its StorageUnavailable line
    comes back as the details of status UNKNOWN). None for any other error."""
    code = getattr(err, "code", None)
    if not (type(err).__module__ or "").startswith("grpc") or not callable(code):
        return None
    details = (err.details() or "").strip() if callable(getattr(err, "details", None)) else ""
    first = details.splitlines()[0] if details else ""
    if code().name == "UNAVAILABLE":
        return f"the storage server does not answer: {first}"[:200]
    behind = re.search(rf"unreachable for \d+ s \((.*)\){re.escape(_STOPPED)}", first)
    if code().name == "UNKNOWN" and behind:
        return f"the database behind the storage server: {behind[1]}"[:200]
    return None


def server_full(e: BaseException) -> bool:
    """Whether `e` is a database refusing a connection for having too many (PostgreSQL's "sorry, too many
    clients already", "too many connections for role ...", MySQL's "Too many connections" and a user's "has
    exceeded the 'max_user_connections' resource"): the one refusal worth waiting for when a storage is opened
    (`open_patiently`), as other workers end and free theirs."""
    why = unavailable(e)
    return why is not None and re.search(r"too many (clients|connections)|exceeded the 'max_user_connections'", why,
                                         re.IGNORECASE) is not None


# The storage calls a search makes (Optuna's BaseStorage, and the heartbeat's): each is retried whole.
RETRIED = ("create_new_study", "delete_study", "set_study_user_attr", "set_study_system_attr", "get_study_id_from_name",
           "get_study_name_from_id", "get_study_directions", "get_study_user_attrs", "get_study_system_attrs",
           "get_all_studies", "create_new_trial", "set_trial_param", "get_trial_id_from_study_id_trial_number",
           "get_trial_number_from_id", "get_trial_param", "set_trial_state_values", "set_trial_intermediate_value",
           "set_trial_user_attr", "set_trial_system_attr", "get_trial", "get_all_trials", "get_n_trials",
           "get_best_trial", "get_trial_params", "get_trial_user_attrs", "get_trial_system_attrs",
           "record_heartbeat", "read_logs", "append_logs", *PRIVATE_STORAGE_CALLS)


class _Notice:
    """At most one line every `every` seconds, whoever calls (the training loop, the heartbeat thread)."""

    def __init__(self, every: float = 10.0):
        self.every, self._last, self._lock = every, 0.0, threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            if time.monotonic() - self._last < self.every:
                return
            self._last = time.monotonic()
        print(line, file=sys.stderr, flush=True)


def patient(storage, url: str, patience: float | None = None):
    """`storage` (an Optuna storage object, changed in place and returned) whose calls are tried again while
    the storage cannot be reached, for up to `patience` seconds (HEADSEARCH_STORAGE_PATIENCE), then raise
    StorageUnavailable. Its class becomes a subclass of its own, so Optuna treats it exactly as before
    (an RDBStorage still gets Optuna's cache, heartbeats still count as heartbeats)."""
    patience = env_value("HEADSEARCH_STORAGE_PATIENCE") if patience is None else patience
    # A journal's calls are retried at its backend's reads and appends (retrying a whole storage call would
    # append its records twice); a database's at each storage call (each is one transaction).
    backend = inner_backend(storage)
    _make_patient(backend if backend is not None else storage, url, patience, _Notice())
    return storage


def open_patiently(url: str, heartbeat: int | None, patience: float | None = None):
    """`open_storage(url, heartbeat)`, tried again for up to `patience` seconds while the database refuses the
    connection for being full (`server_full`), then StorageUnavailable. Any other error opening it (a wrong
    host, password or database name) is its one line at once: waiting would not mend a URL."""
    patience = env_value("HEADSEARCH_STORAGE_PATIENCE") if patience is None else patience
    return _retried(lambda: open_storage(url, heartbeat), url, patience, _Notice(), server_full)


def _retried(call: Callable[[], Any], url: str, patience: float, say, waits: Callable[[BaseException], bool]):
    """`call()`, tried again while what it raises `waits` (backing off up to 5 s, a line on stderr now and then)
    for up to `patience` seconds; then StorageUnavailable, one line naming why."""
    start, wait = time.monotonic(), 0.25
    while True:
        try:
            return call()
        except Exception as e:
            if not waits(e):
                raise
            why = unavailable(e)
            waited = time.monotonic() - start
            if waited >= patience:
                raise StorageUnavailable(f"storage {url} unreachable for {waited:.0f} s ({why}){_STOPPED}") from None
            say(f"storage {url} unreachable ({why}); retrying for up to {patience - waited:.0f} s more")
            time.sleep(min(wait, max(0.0, patience - waited)))
            wait = min(wait * 2, 5.0)


def _make_patient(obj, url: str, patience: float, say) -> None:
    cls = type(obj)
    if getattr(cls, "_headsearch_patient", False):
        return
    url = hide_passwords(url)  # only said (on stderr, in worker logs), never opened

    def retrying(name: str, method):
        def call(self, *args, **kwargs):
            return _retried(lambda: method(self, *args, **kwargs), url, patience, say,
                            lambda e: unavailable(e) is not None)

        call.__name__ = name
        return call

    methods = {name: retrying(name, getattr(cls, name)) for name in RETRIED if callable(getattr(cls, name, None))}
    obj.__class__ = type(cls.__name__, (cls,), {**methods, "_headsearch_patient": True, "__module__": cls.__module__})


# ----------------------------------------------------------------------------------------------- leases


class TrialLeases:
    """A lease per running trial on a storage with a file, a journal's (`FILE.leases/STUDY-KEY/NUMBER`, a small
    file rewritten on each renewal), or in a Redis journal (`headsearch:lease:STUDY:NUMBER`, a counter): where
    its row (`storage_scheme(url)`) says its file is, or else in the Redis of its URL. On a row of liveness
    "stored leases" (a grpc:// storage: nothing but Optuna's calls passes through the proxy) the lease is the
    trial's own system attribute `LEASE_ATTR` in the storage (`storage`, the Optuna storage object opened).
    A lease proves its worker alive by changing; `SilenceWatch` judges it."""

    LEASE_ATTR = "headsearch:lease"

    def __init__(self, url: str, study_name: str, storage=None):
        scheme = storage_scheme(url)
        self.url, self.study_name = scheme.normalize(url), study_name
        self.owner = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        path = scheme.file(self.url)
        self.folder = None
        self._redis = None
        self._store = storage if scheme.liveness == "stored leases" else None
        if path is not None:
            safe = re.sub(r"[^\w.-]", "_", study_name)[:60]
            self.folder = Path(os.path.realpath(path)).with_name(Path(path).name + ".leases") / \
                f"{safe}-{zlib.crc32(study_name.encode()):08x}"
        self._counts: dict[int, int] = {}
        self._ids: dict[int, int] = {}  # trial number -> trial id, for leases in the storage

    def _client(self):
        if self._redis is None:
            import redis

            self._redis = redis.Redis.from_url(self.url, socket_timeout=30, socket_connect_timeout=10)
        return self._redis

    def _key(self, number: int) -> str:
        return f"headsearch:lease:{self.study_name}:{number}"

    def _id_of(self, number: int) -> int:
        if number not in self._ids:
            study_id = self._store.get_study_id_from_name(self.study_name)
            self._ids[number] = self._store.get_trial_id_from_study_id_trial_number(study_id, number)
        return self._ids[number]

    def renew(self, number: int) -> None:
        """Start or renew the lease of trial `number` (its worker is alive)."""
        n = self._counts[number] = self._counts.get(number, 0) + 1
        if self._store is not None:
            self._store.set_trial_system_attr(self._id_of(number), self.LEASE_ATTR, f"{self.owner} {n}")
        elif self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.folder / f".{number}.{self.owner.replace(':', '-')}.tmp"
            tmp.write_text(f"{self.owner} {n}\n")
            os.replace(tmp, self.folder / str(number))
        else:
            # The key expires a day after its last renewal: leases of finished trials clean themselves up.
            self._client().set(self._key(number), f"{self.owner} {n}", ex=86_400)

    def release(self, number: int) -> None:
        """The lease of trial `number` goes (it ended). One in the storage stays with the finished trial, which
        is never judged again (and a finished trial's attributes cannot be written)."""
        self._counts.pop(number, None)
        try:
            if self._store is not None:
                self._ids.pop(number, None)
            elif self.folder is not None:
                (self.folder / str(number)).unlink(missing_ok=True)
            else:
                self._client().delete(self._key(number))
        except Exception:  # a lease left behind only costs a file or a key; a finished trial is never judged
            pass

    def read(self, number: int) -> Any:
        """What the lease of trial `number` holds now (None: no lease)."""
        if self._store is not None:
            return self._store.get_trial(self._id_of(number)).system_attrs.get(self.LEASE_ATTR)
        if self.folder is not None:
            try:
                return (self.folder / str(number)).read_text()
            except FileNotFoundError:
                return None
        return self._client().get(self._key(number))


def trial_leases(url: str, study_name: str, storage) -> TrialLeases | None:
    """The leases of a study on `url` where its row keeps them ("leases": beside its file or in its Redis;
    "stored leases": in `storage` itself), else None (Optuna's heartbeats, or nothing)."""
    liveness = storage_scheme(url).liveness
    return TrialLeases(url, study_name, storage) if liveness in ("leases", "stored leases") else None


class SilenceWatch:
    """Which running trials have been silent for `silence` seconds, as this worker saw them: a trial is
    silent while what `read(trial)` gives does not change (a lease not renewed, a heartbeat never recorded)."""

    def __init__(self, silence: float):
        self.silence = silence
        self._seen: dict[Any, Silence] = {}  # a clock per trial: the one a waiter keeps on a lock file

    def silent(self, current: dict[Any, Any]) -> list:
        """`current`: {trial: what its sign of life reads now}, for the trials running now. Returns those
        unchanged for `silence` seconds of this worker's clock."""
        now = time.monotonic()
        self._seen = {key: self._seen.get(key) or Silence() for key in current}  # the trials running now only
        # A value first seen (or changed) at this reading (its clock started now) is not silent, whatever `silence`.
        return [key for key, value in current.items()
                if self._seen[key].silent_for(value, now) >= self.silence and self._seen[key].since != now]

    def forget(self, key: Any) -> None:
        self._seen.pop(key, None)


def finished_trial_error() -> type[Exception]:
    """What a storage raises when a finished trial is written to: Optuna's UpdateFinishedTrialError, or, before
    it existed (Optuna 4.0), a RuntimeError ("Trial#N has already finished and can not be updated")."""
    try:
        from optuna.exceptions import UpdateFinishedTrialError

        return UpdateFinishedTrialError
    except ImportError:
        return RuntimeError


def retry_callback(max_retry: int = 2):
    """Optuna's callback that re-enqueues a failed trial as WAITING (at most `max_retry` times)."""
    import optuna

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        try:
            from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry  # Optuna >= 4.9
        except ImportError:
            from optuna.storages import RetryFailedTrialCallback as Retry
        return Retry(max_retry=max_retry)


class Heartbeat:
    """Call `beat()` every `interval` seconds from a daemon thread while a trial runs (its heartbeat on a
    database, its lease on a journal: `StudyStorage.beat`). The first beat is the caller's, under the budget
    lock, right after `ask`: no trial is ever RUNNING without one."""

    def __init__(self, beat: Callable[[], None], interval: int | None):
        self.beat, self.interval = beat, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Heartbeat":
        if self.interval:
            self._thread = threading.Thread(target=self._beat, daemon=True, name="headsearch-heartbeat")
            self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except Exception:  # a transient storage error must not kill training; the next beat retries
                pass

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
