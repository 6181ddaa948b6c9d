"""Many workers on one storage: light workers (no torch, trials looked up in a table) on PostgreSQL, the gRPC proxy, a journal file, Redis.

Each row starts N light workers (`headsearch.search.light`: a search's own loop, its budget lock, fence,
scheduler, heartbeats or leases and telling, on a real storage; each trial's epochs sleep the table's epoch
seconds x a scale instead of training), lets them open the study, starts their loops together and waits for
them to spend a budget of `--trials-per-worker` x N trials. Per row: asks per second (trials created, duplicates
and fenced ones included, over the span until the last trial ended), the budget lock's wait in the workers
(median, 99th percentile), the most database connections held at once (sampled from pg_stat_activity), the
share of the workers' busy seconds spent outside (looked-up) training, and the promises: the budget exact, no
architecture trained twice, nothing lost (no trial left RUNNING, every worker exited 0). The reference is the
8-worker PostgreSQL row of the same regime, run first.

The table is `--table` (benchmarks/tables/) widened for many workers: its space x `LEARNING_RATES` learning rates,
each (architecture, learning rate) taking its architecture's curves and seconds (a cluster measures coordination,
not search quality). Two regimes: short trials (`--short-scale`: asks are frequent) and long ones (`--long-scale`:
trials of minutes on a GPU make asks rare).

    python benchmarks/cluster.py --quick                      # 8 workers, every storage, short trials
    python benchmarks/cluster.py --workers 8,32,64 --storages postgresql,grpc,journal,redis
    python benchmarks/cluster.py --workers 8,32 --storages postgresql --pool 5+10,1+1   # a worker's connections

Direct PostgreSQL rows need about 3 connections a worker: a row past the server's max_connections (less 20 left to
its other clients) is not run but reported. 64 workers need a server started with max_connections of 212 or
more, e.g. a throwaway cluster of your own (initdb, then `pg_ctl -o "-p 5499 -c max_connections=300" start`)
given as `--pg postgresql+psycopg2://postgres@127.0.0.1:5499/headsearch_cluster`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import yaml

from common import ROOT, markdown_table, parser, report

DEFAULT_TABLE = ROOT / "benchmarks" / "tables" / "vit-cifar10-deep-head-tiny.json"
PG = "postgresql+psycopg2://postgres@127.0.0.1:5432/headsearch_cluster"
REDIS = "redis://127.0.0.1:6379/14"
LEARNING_RATES = 20  # the widened space: every architecture of the table at this many learning rates
READY_SECONDS = 600  # workers given to import and open the study (64 processes on 2 cores take a while)
STORAGES = ("postgresql", "grpc", "journal", "redis")
# Connections a worker on PostgreSQL may hold at once (measured here: 2.75 with a 1+1 pool, 3.25 with 5+10, a waiter
# for the budget lock holding its own), and those
# left to other clients of the server: a row that would pass max_connections is not run (the server's other users
# would be refused) but reported as the knee it is.
CONNECTIONS_PER_WORKER = 3
HEADROOM = 20


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workers", default="8,32,64", help="comma list of worker counts")
    p.add_argument("--storages", default=",".join(STORAGES), help="comma list of: " + ", ".join(STORAGES))
    p.add_argument("--regimes", default="short,long", help="comma list of: short, long")
    p.add_argument("--short-scale", type=float, default=0.01, help="real seconds per table second, short trials")
    p.add_argument("--long-scale", type=float, default=0.1, help="real seconds per table second, long trials")
    p.add_argument("--trials-per-worker", type=int, default=3)
    p.add_argument("--pool", default="1+1", help="comma list of a PostgreSQL worker's pools, KEPT+EXTRA connections"
                   " ($HEADSEARCH_WORKER_POOL; 1+1 is headsearch's, 5+10 SQLAlchemy's and headsearch's before)")
    p.add_argument("--table", type=Path, default=DEFAULT_TABLE)
    p.add_argument("--pg", default=PG, help="a PostgreSQL URL (its database is created if missing)")
    p.add_argument("--redis", default=REDIS)
    args = p.parse_args()
    if args.quick:
        args.workers, args.regimes = "8", "short"
    storages = args.storages.split(",")
    if unknown := set(storages) - set(STORAGES):
        sys.exit(f"--storages: {', '.join(sorted(unknown))} is not one of {', '.join(STORAGES)}")
    if "postgresql" in storages or "grpc" in storages:
        create_database(args.pg)
    work = Path(tempfile.mkdtemp(prefix="headsearch-cluster-"))
    try:
        table_path, space_path = widened_table(args.table, work)
        rows, reference = [], {}
        for regime in args.regimes.split(","):
            scale = args.short_scale if regime == "short" else args.long_scale
            for n in map(int, args.workers.split(",")):
                for storage in storages:
                    for pool in args.pool.split(",") if storage == "postgresql" else ["1+1"]:
                        if storage == "postgresql" and (why := too_many_connections(args.pg, n)):
                            rows.append([f"{regime} ({scale:g})", f"postgresql (pool {pool})", n, why] + [""] * 10)
                            print(" | ".join(map(str, rows[-1])), flush=True)
                            continue
                        r = run_row(args, work, table_path, space_path, storage, n, scale, pool)
                        reference.setdefault(regime, r)
                        rows.append(table_row(regime, scale, storage, pool, n, r, reference[regime]))
                        print(" | ".join(map(str, rows[-1])), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    headers = ["regime (scale)", "storage", "workers", "trials", "asks/s", "vs reference", "lock wait ms (median, p99)",
               "lock held ms (median)", "connections (max, per worker)", "outside training", "RSS MiB/worker",
               "budget exact", "no arch twice", "nothing lost"]
    notes = [f"light workers (headsearch.search.light, no torch) on {os.cpu_count()} cores; table {args.table.name} x"
             f" {LEARNING_RATES} learning rates; the search's defaults (NSGA-II, pareto pruner, heartbeat 30 s)",
             "reference: the first row of each regime (8 workers on PostgreSQL); asks/s = trials created (duplicates and"
             " fenced ones included) / seconds from the start of the loops to the end of the last trial",
             "outside training: 1 - slept / busy seconds (a worker's start to its first ask after its last trial)"]
    if "postgresql" in storages or "grpc" in storages:
        notes.append(f"PostgreSQL: {postgres_line(args.pg)}")
    report("Cluster: light workers against each storage", markdown_table(headers, rows), None, args, notes,
           machine=machine_line())


def machine_line() -> str:
    from common import cpu_model

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"CPU: {cpu_model()}, {os.cpu_count()} cores, {memory:.0f} GiB (shared with other jobs)"


def table_row(regime, scale, storage, pool, n, r, ref) -> list:
    name = storage + (f" (pool {pool})" if storage == "postgresql" else "")
    conns = f"{r['connections']}, {r['connections'] / n:.2f}" if r["connections"] is not None else "-"
    return [f"{regime} ({scale:g})", name, n, r["trials"], f"{r['asks_per_s']:.1f}",
            f"{r['asks_per_s'] / ref['asks_per_s']:.2f}x", f"{r['wait_median']:.1f}, {r['wait_p99']:.0f}",
            f"{r['hold_median']:.1f}", conns, f"{100 * r['outside']:.0f}%", f"{r['rss']:.0f}",
            yes(r["counted"] == r["trials"], f"{r['counted']} of {r['trials']}"), yes(not r["twice"], r["twice"]),
            yes(not r["lost"], r["lost"])]


def yes(ok: bool, otherwise) -> str:
    return "yes" if ok else f"NO: {otherwise}"


# -- the widened table -----------------------------------------------------------------------------------------


def widened_table(path: Path, work: Path) -> tuple[Path, Path]:
    """The table at `path` over its space x LEARNING_RATES learning rates (a space file and a table, in `work`):
    enough architectures that 128 workers x a few trials never exhaust the space."""
    from optuna.trial import FixedTrial

    from headsearch.search.light import light_search
    from headsearch.search.table import arch_key, load_table, overrides_of, write_table

    table = load_table(path)
    base = table["base_config"]
    lr = base["train"]["lr"]
    space = {k: table["space"][k] for k in ("schedule", "skip", "fusion")}
    space["description"] = f"{table['space']['name']} x {LEARNING_RATES} learning rates (benchmarks/cluster.py)"
    space["ranges"] = {"lr": [float(f"{lr * 1.1 ** (k - LEARNING_RATES // 2):.4g}") for k in range(LEARNING_RATES)]}
    space_path = work / "cluster-space.yaml"
    space_path.write_text(yaml.safe_dump(space))
    search = light_search(table, storage=f"journal:{work / 'unused.log'}", study="unused", trials=1,
                          space=str(space_path))
    rows = {arch_key(a["overrides"]): a for a in table["architectures"]}
    archs = []
    for params in search.archs.listing().values():
        cfg = search.archs.sample_config(FixedTrial(params), search.device)
        overrides = overrides_of(cfg.to_dict(), base)
        plain = {k: v for k, v in overrides.items() if k != "train"}
        if rest := {k: v for k, v in overrides.get("train", {}).items() if k != "lr"}:
            plain["train"] = rest
        row = rows[arch_key(plain)]
        archs.append({**row, "arch": f"{row['arch']} lr={cfg.train.lr:g}", "overrides": overrides})
    wide = {**table, "space": search.space.summary(), "architectures_in_space": len(archs), "architectures": archs}
    return write_table(wide, work / "cluster-table.json"), space_path


# -- one row ------------------------------------------------------------------------------------------------------


def run_row(args, work: Path, table: Path, space: Path, storage: str, n: int, scale: float, pool: str) -> dict:
    study = f"cluster-{uuid.uuid4().hex[:10]}"
    trials = n * args.trials_per_worker
    folder = work / study
    folder.mkdir()
    server = None
    try:
        if storage == "grpc":
            server, url = start_server(args.pg, folder)
        else:
            url = {"postgresql": args.pg, "journal": f"journal:{folder / 'journal.log'}", "redis": args.redis}[storage]
        sampler = ConnectionSampler(args.pg) if storage in ("postgresql", "grpc") else None
        codes, reports = run_workers(url, study, table, space, n, trials, scale, pool, folder)
        connections = sampler.stop() if sampler else None
        return measure(url if storage != "grpc" else args.pg, study, trials, codes, reports, connections)
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
        drop_study(args.pg if storage == "grpc" else url, study)


def worker_env(pool: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HEADSEARCH_WORKER_POOL": pool}


def run_workers(url, study, table, space, n, trials, scale, pool, folder: Path) -> tuple[list[int], list[dict]]:
    """Start `n` light workers, start their loops together once every one has opened the study, wait for them."""
    procs = []
    for i in range(n):
        cmd = [sys.executable, "-m", "headsearch.search.light", "--table", str(table), "--space", str(space),
               "--storage", url, "--study", study, "--trials", str(trials), "--scale", str(scale), "--seed", str(i),
               "--run-root", str(folder / "runs"), "--barrier", str(folder), "--report", str(folder / f"w{i}.json")]
        with open(folder / f"w{i}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=worker_env(pool)))
    deadline = time.monotonic() + READY_SECONDS
    while len(list(folder.glob("ready.*"))) < n:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.1)
    (folder / "go").touch()
    try:
        codes = [p.wait() for p in procs]
    finally:  # interrupted: no worker left behind
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, code in enumerate(codes):
        if code:
            print(f"worker {i} exited {code}: {(folder / f'w{i}.log').read_text()[-600:]}", file=sys.stderr)
    reports = [json.loads(r.read_text()) for r in sorted(folder.glob("w*.json"))]
    return codes, reports


def measure(url: str, study: str, trials: int, codes: list[int], reports: list[dict], connections) -> dict:
    """The row's figures from the workers' reports and the study as the storage holds it."""
    import optuna
    from optuna.trial import TrialState

    from headsearch.search.record import config_key, counts_toward_budget, holds_architecture
    from headsearch.search.storage import open_storage

    stored = optuna.load_study(study_name=study, storage=open_storage(url, heartbeat=None)).get_trials(deepcopy=False)
    held = [config_key(t.user_attrs.get("config")) for t in stored if holds_architecture(t)]
    started = min(r["started"] for r in reports)
    span = max((e for r in reports for e in r["trial_ends"]), default=started) - started
    waits = sorted(1000 * w for r in reports for w in r["lock_waits"]) or [0.0]
    holds = [1000 * h for r in reports for h in r["lock_holds"]] or [0.0]
    slept, busy = 0.0, 0.0
    for r in reports:
        if r["trial_ends"]:
            after = [s for s in r["ask_starts"] if s > r["trial_ends"][-1]]
            busy += (min(after) if after else r["ended"]) - r["started"]
            slept += r["slept"]
    running = sum(t.state == TrialState.RUNNING for t in stored)
    failed_workers = sum(1 for c in codes if c)
    lost = ", ".join(x for x in (f"{running} RUNNING" if running else "",
                                 f"{failed_workers} workers failed" if failed_workers else "",
                                 "torch imported" if any(r["torch"] for r in reports) else "") if x)
    return {"trials": trials, "asks_per_s": len(stored) / max(span, 1e-9), "wait_median": statistics.median(waits),
            "wait_p99": waits[min(len(waits) - 1, int(0.99 * len(waits)))], "hold_median": statistics.median(holds),
            "connections": connections, "outside": 1 - slept / busy if busy else float("nan"),
            "rss": statistics.median(r["max_rss_mib"] for r in reports) if reports else float("nan"),
            "counted": sum(1 for t in stored if counts_toward_budget(t)), "twice": len(held) - len(set(held)),
            "lost": lost}


# -- the storages ---------------------------------------------------------------------------------------------------


def too_many_connections(url: str, n: int) -> str | None:
    """Why `n` workers are not run directly on PostgreSQL (the connections they need), or None."""
    most = int(server_settings(url, "max_connections")[0])
    need = CONNECTIONS_PER_WORKER * n
    if need <= most - HEADROOM:
        return None
    return f"not run: {n} workers need {need} connections or more, max_connections is {most}"


def postgres_line(url: str) -> str:
    """The server's version and max_connections, the password hidden: where the PostgreSQL rows ran."""
    import sqlalchemy as sa

    version, most = server_settings(url, "server_version", "max_connections")
    return f"{sa.engine.make_url(url).render_as_string(hide_password=True)} (server {version}, max_connections {most})"


def server_settings(url: str, *names: str) -> list[str]:
    """PostgreSQL's `SHOW name` for each of `names`, on one connection of its own."""
    import sqlalchemy as sa

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        values = [conn.execute(sa.text(f"SHOW {name}")).scalar() for name in names]
    engine.dispose()
    return values


def create_database(url: str) -> None:
    """The benchmark's own database, so that its connection counts are its workers' alone."""
    import sqlalchemy as sa

    u = sa.engine.make_url(url)
    engine = sa.create_engine(u.set(database="postgres"), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        if not conn.execute(sa.text("SELECT 1 FROM pg_database WHERE datname = :d"), {"d": u.database}).scalar():
            conn.execute(sa.text(f'CREATE DATABASE "{u.database}"'))
    engine.dispose()
    import optuna

    optuna.storages.RDBStorage(url)  # Optuna's tables, made once here rather than raced by the first workers


def start_server(pg: str, folder: Path) -> tuple[subprocess.Popen, str]:
    """`headsearch storage-server` over `pg` on a free port; (its process, the grpc:// URL it printed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "headsearch", "storage-server", "--storage", pg, "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=open(folder / "server.log", "w"), text=True,
                            env=worker_env("1+1"))
    line = proc.stdout.readline().strip()
    if not line:
        sys.exit(f"storage-server did not start: {(folder / 'server.log').read_text()[-1000:]}")
    return proc, f"grpc://127.0.0.1:{port}"


class ConnectionSampler:
    """The most connections to the benchmark's database held at once, sampled every 0.1 s in a thread
    (pg_stat_activity; this sampler's own connection left out)."""

    def __init__(self, url: str):
        import sqlalchemy as sa

        self.database = sa.engine.make_url(url).database
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        self.most, self._stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import sqlalchemy as sa

        query = sa.text("SELECT count(*) FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid()")
        with self.engine.connect() as conn:
            while not self._stop.is_set():
                self.most = max(self.most, conn.execute(query, {"d": self.database}).scalar())
                conn.rollback()
                self._stop.wait(0.1)

    def stop(self) -> int:
        self._stop.set()
        self.thread.join()
        self.engine.dispose()
        return self.most


def drop_study(url: str, study: str) -> None:
    import optuna

    from headsearch.search.storage import open_storage

    try:
        optuna.delete_study(study_name=study, storage=open_storage(url, heartbeat=None))
    except KeyError:
        pass


if __name__ == "__main__":
    main()
