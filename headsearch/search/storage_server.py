"""`headsearch storage-server`: Optuna's gRPC proxy server in front of a database, which workers anywhere reach
with `--storage grpc://HOST:PORT` (the row in `headsearch.search.storage.proxy`). A database outage behind the
proxy is waited out here (a patient storage), and past its patience reaches the workers as its one line, which
they count as an outage (`liveness.unavailable`).
"""
from __future__ import annotations

import socket
import threading
import warnings
from typing import Callable

from headsearch.errors import ConfigError, HeadsearchError
from headsearch.io import hide_passwords
from headsearch.search.liveness import patient
from headsearch.search.storage import open_storage, storage_scheme
from headsearch.search.storage.proxy import check_grpc_optuna

DEFAULT_PORT = 13000  # Optuna's default for its proxy


def worker_url(host: str, port: int) -> str:
    """The grpc:// URL workers on other machines give as --storage: this machine's name for a wildcard host."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"grpc://{f'[{host}]' if ':' in host else host}:{port}"


def open_served_storage(url: str):
    """The database storage the proxy serves: a row that opens Optuna's RDBStorage (liveness "heartbeats": SQLite,
    PostgreSQL, MySQL), behind Optuna's cache of finished trials (`optuna.storages.get_storage`, as Optuna's own
    docs for the proxy advise). A journal, a Redis journal or a grpc:// URL is one line: the proxy serves a
    database only (Optuna's proxy does not serve a JournalStorage).

    Patient (`liveness.patient`, HEADSEARCH_STORAGE_PATIENCE): a database outage is waited out here, each worker's
    call waiting with it. Optuna's RDBStorage reports a lost database as a StorageInternalError ("... invalid
    data in the commit ...") that a worker could not tell from a bug; past the patience, the worker gets this
    storage's StorageUnavailable line instead, which it counts as an outage (`liveness.unavailable`)."""
    import optuna

    scheme = storage_scheme(url)
    if scheme.liveness != "heartbeats":
        raise ConfigError(f"storage-server serves a database (sqlite:///FILE.db, postgresql://USER@HOST/DB or"
                          f" mysql://USER@HOST/DB), not {scheme.name} storage {hide_passwords(url)}: pass a database URL")
    return patient(optuna.storages.get_storage(open_storage(url, heartbeat=None)), hide_passwords(url))


def _when_serving(host: str, port: int, on_ready: Callable[[str], None]) -> None:
    """`on_ready(url)` once the server answers on host:port (Optuna's server binds and serves in one blocking call):
    a worker given the URL from then on finds it there. Nothing if it never answers (the bind failed: said so)."""
    import grpc

    local = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    with grpc.insecure_channel(f"{f'[{local}]' if ':' in local else local}:{port}") as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=60)
        except grpc.FutureTimeoutError:
            return
    on_ready(worker_url(host, port))


def serve_storage(url: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                  on_ready: Callable[[str], None] | None = None) -> None:
    """Serve the database `url` through Optuna's gRPC proxy on host:port until interrupted (KeyboardInterrupt:
    the caller's SIGINT or SIGTERM). `on_ready(grpc_url)`, from another thread, once it answers: the URL to give
    workers. Bad input (an Optuna without the proxy, a URL that is not a database's, one that cannot be opened,
    an address that cannot be bound) is one HeadsearchError line before anything is served."""
    check_grpc_optuna("headsearch storage-server")
    storage = open_served_storage(url)
    try:
        import grpc  # noqa: F401  (Optuna imports it lazily: missing, say so now)
        from google import protobuf  # noqa: F401
    except ImportError:
        raise HeadsearchError("storage-server needs grpcio and protobuf: pip install 'headsearch[grpc]'") from None
    import optuna
    from optuna.storages import run_grpc_proxy_server

    if on_ready is not None:
        threading.Thread(target=_when_serving, args=(host, port, on_ready), daemon=True).start()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        try:
            run_grpc_proxy_server(storage, host=host, port=port)
        except RuntimeError as e:  # grpc's "Failed to bind to address ..."
            raise HeadsearchError(f"cannot serve on {host}:{port}: {str(e).splitlines()[0]}") from None
