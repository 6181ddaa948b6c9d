"""Optuna storages for headsearch: URLs, heartbeats, and a lock that makes a trial budget exact.

- `sqlite:///headsearch.db` (default): one machine; optuna-dashboard reads it as is.
- `postgresql://user@host/db`, `mysql://...`: many workers on many machines.
- `journal:PATH` or a path ending in `.log`: Optuna's JournalStorage on a file; `redis://host:port`
  for a journal in Redis.
- `grpc://host:port`: Optuna's gRPC proxy (Optuna >= 4.2) in front of one of the databases above, served by
  `headsearch storage-server` (`headsearch.search.storage_server`): thousands of workers on one database's
  few connections.

Each row declares how a dead worker's trial is found (`LIVENESS`): heartbeats on the RDB storages (a trial
silent for 3 x `heartbeat` is failed by the next worker that starts a trial, which re-enqueues it, so it is
retried and counts once), headsearch's leases on the journals (Optuna keeps no heartbeats there), leases kept in
the trials themselves on grpc:// (no heartbeat passes the proxy; no budget lock either: the fence alone keeps the
budget, `proxy._fence_only`), or none.

Modules: `schemes` (the table of storage schemes, `SCHEMES`: one `StorageScheme` row per URL scheme, and the
lookups every other module calls; `register_storage` adds a row), `locks` (the lock files of SQLite and journal
files, Optuna's journal append lock), `server_locks` (the Redis lock, PostgreSQL's and MySQL's session locks),
`proxy` (the grpc:// row: Optuna's gRPC proxy, registered after the built-in rows), `timings` (LOCK_SILENCE,
LOCK_RENEW, ...: read from there at each use, so setting `timings.LOCK_SILENCE` (a test, a worker script) reaches
every lock). A URL no row claims is refused in one line by `open_storage` and `budget_lock`.
"""
from headsearch.search.storage.locks import LockHold
from headsearch.search.storage.schemes import (DEFAULT_STORAGE, LIVENESS, SCHEMES, SQLITE_MAGIC, StorageScheme,
                                               absolute_url, artifact_dir, budget_lock, check_journal_file,
                                               check_sqlite_file, find_scheme, journal_path, known_urls,
                                               normalize_url, open_rdb_storage, open_storage, register_storage,
                                               sqlite_path, storage_scheme)
from headsearch.search.storage.server_locks import redis_url_with_timeouts
from headsearch.search.storage import proxy  # noqa: E402,F401  (registers the grpc:// row, after the built-in ones)

__all__ = [
    "DEFAULT_STORAGE", "LIVENESS", "SCHEMES", "SQLITE_MAGIC", "LockHold", "StorageScheme", "absolute_url",
    "artifact_dir", "budget_lock", "check_journal_file", "check_sqlite_file", "find_scheme", "journal_path",
    "known_urls", "normalize_url", "open_rdb_storage", "open_storage", "redis_url_with_timeouts", "register_storage",
    "sqlite_path", "storage_scheme",
]
