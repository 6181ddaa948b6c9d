"""The connection pool of a worker's database storage (`schemes.open_rdb_storage`)."""
from __future__ import annotations


def worker_pool() -> dict[str, int]:
    """A worker's pool on a database server (opened with heartbeats: only workers ask for them): two threads use it,
    the loop and its running trial's heartbeat, so one connection is kept and one more opened only while both talk at
    once, instead of SQLAlchemy's 5 kept (each thread kept its own: 2 a worker, 3 with the budget lock's, measured in
    benchmarks/cluster.py), so a server's max_connections serves more workers. $HEADSEARCH_WORKER_POOL sets another.
    The gRPC proxy, one process for every worker, opens its database without heartbeats: SQLAlchemy's pool."""
    from headsearch.environment import env_value

    kept, extra = env_value("HEADSEARCH_WORKER_POOL")
    return {"pool_size": kept, "max_overflow": extra}
