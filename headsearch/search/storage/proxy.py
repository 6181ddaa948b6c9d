"""The row of grpc:// URLs: Optuna's gRPC proxy (Optuna >= 4.2, `GrpcStorageProxy`) in front of a database, so
that thousands of workers reach the study through one process and its few database connections instead of a
pool each. The server they reach is `headsearch storage-server` (`headsearch.search.storage_server`).

What the proxy does not pass, and how headsearch keeps its promises without it: no heartbeats (a running trial's
lease is a system attribute of the trial: liveness "stored leases"), no budget lock (the database is out of the
workers' reach: the fence makes the budget exact, `_fence_only`).
"""
from __future__ import annotations

import contextlib
import warnings

from headsearch.errors import ConfigError, HeadsearchError
from headsearch.search.storage.locks import LockHold
from headsearch.search.storage.schemes import StorageScheme, register_storage

GRPC_OPTUNA = "4.2"  # Optuna's first release with GrpcStorageProxy and run_grpc_proxy_server
GRPC_READY = 10.0  # seconds a grpc:// storage may take to answer when it is opened


def check_grpc_optuna(what: str) -> None:
    """One ConfigError line when the installed Optuna has no gRPC proxy (before 4.2): `what` needs it."""
    import optuna

    if not hasattr(optuna.storages, "GrpcStorageProxy"):
        raise ConfigError(f"{what} needs optuna >= {GRPC_OPTUNA} (installed: {optuna.__version__}): pip install -U"
                          f" 'optuna>={GRPC_OPTUNA}'")


def grpc_address(url: str) -> tuple[str, int]:
    """('HOST', PORT) of grpc://HOST:PORT; one ConfigError line for any other form."""
    rest = url[len("grpc://"):]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in rest:
        raise ConfigError(f"storage {url}: write grpc://HOST:PORT (the address `headsearch storage-server` printed)")
    return host.strip("[]"), int(port)


def _check_grpc(url: str) -> None:
    check_grpc_optuna(f"storage {url}")
    grpc_address(url)


def _open_grpc(url: str, heartbeat: int | None, max_retry: int):
    """Optuna's GrpcStorageProxy on the server `headsearch storage-server` runs, once it answers (within
    GRPC_READY seconds: a wrong address is one line, not a worker waiting). No heartbeat passes through the
    proxy: the row's leases live in the trials themselves ("stored leases")."""
    import grpc  # noqa: F401  (the proxy imports it lazily; missing: the row's driver line now, not at a call)
    from google import protobuf  # noqa: F401
    from optuna.storages import GrpcStorageProxy

    host, port = grpc_address(url)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*GrpcStorageProxy is experimental")
        proxy = GrpcStorageProxy(host=host, port=port)
    try:
        proxy.wait_server_ready(timeout=GRPC_READY)
    except ConnectionError:
        raise HeadsearchError(f"storage {url}: no storage server answered at {host}:{port} within {GRPC_READY:.0f} s:"
                              " start one with `headsearch storage-server --storage DB-URL`, or pass another"
                              " --storage") from None
    return proxy


@contextlib.contextmanager
def _fence_only(url: str, study_name: str):
    """No budget lock on grpc://: the database behind the proxy is out of the workers' reach, and the proxy
    passes Optuna's calls only. The budget is exact through the fence alone (`Scheduler._fence`): every trial
    is created by the one database behind the proxy, whose trial ids give one order of creation that every
    worker reads alike, and a trial asked when the trials created before it fill the budget is told FAIL as
    over-budget before it trains. Without the lock the fence is met more often (two workers asking at once),
    at the cost of an over-budget FAIL record each time, not of a trial. Creations never interleave: Optuna's
    RDBStorage locks the study's row (SELECT ... FOR UPDATE) to create a trial, so ids, numbers and commits
    follow one order. Workers' asks are in no order, though: the hold says so (`exclusive=False`) and the
    scheduler seeds each worker's proposals apart (`scheduler.RACING_STRIDE`)."""
    yield LockHold(f"none on {url}: the fence alone", exclusive=False)


register_storage(StorageScheme(
    name="grpc", example="grpc://HOST:PORT", claims=lambda url: url.startswith("grpc://"),
    open=_open_grpc, budget_lock=_fence_only, check=_check_grpc,
    driver="pip install 'headsearch[grpc]' (grpcio, protobuf)", liveness="stored leases"))
