"""Optuna storages for headsearch: URLs, heartbeats, and a lock that makes a trial budget exact.

- `sqlite:///headsearch.db` (default): one machine; optuna-dashboard reads it as is.
- `postgresql://user@host/db`, `mysql://...`: many workers on many machines.
- `journal:PATH` or a path ending in `.log`: Optuna's JournalStorage on a file; `redis://host:port`
  for a journal in Redis. Journal storages have no heartbeats in Optuna, so a killed worker's trial
  stays RUNNING there: use an RDB storage when workers may die.

RDB storages get heartbeats: a worker records one every `heartbeat` seconds while a trial runs, and
a trial silent for 3 x `heartbeat` is failed by the next worker that starts a trial, which then
re-enqueues it (Optuna's RetryFailedTrialCallback), so the trial is retried and counts once.

Modules: `schemes` (the table of storage schemes, `SCHEMES`: one `StorageScheme` row per URL scheme, and the
lookups every other module calls; `register_storage` adds a row), `locks` (the lock files of SQLite and journal
files, Optuna's journal append lock), `server_locks` (the Redis lock, PostgreSQL's and MySQL's session locks).
A URL no row claims is refused in one line by `open_storage` and `budget_lock`.

The timings below are read from this module at each use (`locks` and `server_locks` import the package for
them), so setting `headsearch.search.storage.LOCK_SILENCE` (a test, a worker script) reaches every lock.
"""
from __future__ import annotations

# Defined before the submodules are imported: they read these names from this module.
LOCK_SILENCE = 30  # seconds: a budget lock not renewed for this long belongs to a dead worker and is broken
LOCK_RENEW = 5  # seconds between a live holder's renewals
LOCK_RECONNECT = 60  # seconds a worker keeps trying to reach the database of its budget lock again
LOCK_LOSSES = 5  # database sessions one wait for the budget lock may lose (then the worker stops with one line)
REDIS_TIMEOUT = 30  # seconds: a Redis command unanswered this long fails (a frozen server) instead of hanging
REDIS_CONNECT_TIMEOUT = 10  # seconds to open a connection to Redis
# TCP keepalives of a database lock connection (libpq's parameters; the same timings for PyMySQL's socket): a
# peer gone silent is noticed within about a minute, and an idle lock connection is not dropped unseen.
LOCK_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}

from headsearch.search.storage.locks import LockHold  # noqa: E402
from headsearch.search.storage.schemes import (DEFAULT_STORAGE, SCHEMES, SQLITE_MAGIC, StorageScheme,  # noqa: E402
                                               absolute_url, artifact_dir, budget_lock, check_journal_file,
                                               check_sqlite_file, find_scheme, is_rdb, journal_path, known_urls,
                                               normalize_url, open_rdb_storage, open_storage, register_storage,
                                               sqlite_path, storage_scheme)
from headsearch.search.storage.server_locks import redis_url_with_timeouts  # noqa: E402

__all__ = [
    "DEFAULT_STORAGE", "LOCK_KEEPALIVES", "LOCK_LOSSES", "LOCK_RECONNECT", "LOCK_RENEW", "LOCK_SILENCE",
    "REDIS_CONNECT_TIMEOUT", "REDIS_TIMEOUT", "SCHEMES", "SQLITE_MAGIC", "LockHold", "StorageScheme", "absolute_url",
    "artifact_dir", "budget_lock", "check_journal_file", "check_sqlite_file", "find_scheme", "is_rdb", "journal_path",
    "known_urls", "normalize_url", "open_rdb_storage", "open_storage", "redis_url_with_timeouts", "register_storage",
    "sqlite_path", "storage_scheme",
]
