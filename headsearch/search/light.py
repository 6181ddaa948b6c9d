"""Light workers: a search's own worker loop against a real storage, its trials looked up in a table, no torch.

A real worker imports torch (about 680 MB resident with the CUDA build), so a machine holds a few dozen; the
storage's promises for many nodes (the budget lock, the fence, leases and heartbeats, the scheduler's
duplicates) are measured with workers that cost tens of MB instead. A light worker builds the same `Search`
as `headsearch run` and runs the same loop (`Search.run`: asking under the budget lock, sampling, skipping
held architectures, the pruner after each epoch, telling), over `SleepingTable`: a table's backend
(`simulate.TableCohort`) that sleeps each epoch's table seconds times `scale` instead of training. As in
Syne Tune's simulator, the scheduler cannot tell a looked-up trial from a trained one; here the storage
cannot either, and the wall clock is real. `benchmarks/cluster.py` starts many of them.

    python -m headsearch.search.light --table T.json --storage URL --study NAME --trials N [--scale 0.01]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

from headsearch.errors import HeadsearchError
from headsearch.search.simulate import TableCohort


class TableDevice:
    """The device of a looked-up trial: its memory unknown, so the size guard lets every architecture of the
    table through (each fitted where the table was trained)."""

    type = "table"
    index = None

    def __str__(self) -> str:
        return "table"


class TableSeat:
    """A light worker's seat (`machine.fairtime.Seat`'s part the loop uses): no device to share and no fair clock,
    the table's epoch seconds are the time alone already."""

    device = TableDevice()

    def step_mode(self, cfg, task) -> str:
        return "table"

    def clock(self, study, cfg, intended: str, note_key=None) -> None:
        return None


class SleepingTable(TableCohort):
    """One slot (a worker trains one trial at a time) whose epochs take the table's epoch seconds x `scale` of
    real sleep; `slept` adds them up, so the share of the wall clock spent outside training is measured."""

    def __init__(self, table: dict[str, Any], rng: random.Random, scale: float):
        super().__init__(table, 1, rng)
        self.scale, self.slept = scale, 0.0
        self.ends: list[float] = []  # when each trial's last epoch ended (time.time(): comparable across processes)

    def train_epoch(self):
        seconds = (self.events[0][0] - self.now) * self.scale
        time.sleep(seconds)
        self.slept += seconds
        ended = super().train_epoch()
        if ended:
            self.ends.append(time.time())
        return ended


class LockTimes:
    """The budget lock's waits and holds in this worker (`Scheduler.on_lock`), in seconds, and when each ask
    began (time.time())."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.holds: list[float] = []
        self.starts: list[float] = []

    def __call__(self, wait: float, hold: float) -> None:
        self.waits.append(wait)
        self.holds.append(hold)
        self.starts.append(time.time() - wait - hold)


def light_search(table: dict[str, Any], *, storage: str, study: str, trials: int, space: str | None = None,
                 seed: int = 0, heartbeat: int | None = None, run_root: str = "runs", **settings: Any):
    """The `Search` a real worker of `table`'s task, preset and epochs would run on `storage`, seated on a table:
    its base config is the table's (resolved there, not here: no device is looked at, no torch loaded)."""
    from headsearch.search.runner import Search, SearchSettings
    from headsearch.tasks import get_task, resolve_config

    base = resolve_config(get_task(table["task"]), config=table["base_config"])
    extra = {"heartbeat": heartbeat} if heartbeat is not None else {}
    s = SearchSettings(task=table["task"], space=space or table["space"]["name"], trials=trials, seed=seed,
                       preset=table.get("preset"), epochs=table["epochs"], storage=storage, study=study, device="cpu",
                       run_root=run_root, sets=table.get("sets") or None, **extra, **settings)
    return Search(s, resolved_base=base, seat=TableSeat())


def run_light_worker(search, table: dict[str, Any], scale: float, seed: int = 0,
                     ready: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run `search`'s worker loop over a `SleepingTable` until the budget is spent; what it measured. `ready()`
    is called once the study is open, before the first ask (a benchmark starts its workers' loops together)."""
    times = LockTimes()
    search.scheduler.on_lock = times
    study = search.open()
    if ready is not None:
        ready()
    backend = SleepingTable(table, random.Random(seed), scale)
    started = time.time()
    search.run(study, backend)
    return {"started": started, "ended": time.time(), "slept": backend.slept, "epochs": backend.epochs_trained,
            "trial_ends": backend.ends, "ask_starts": times.starts, "lock_waits": times.waits,
            "lock_holds": times.holds, "max_rss_mib": peak_rss_mib(),
            "torch": "torch" in sys.modules}


def peak_rss_mib() -> float:
    """This process's peak resident memory: Linux's VmHWM, which starts again at exec (getrusage's ru_maxrss
    does not: a worker started by a large process would report its starter's size), else ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 / (1024 if sys.platform == "darwin" else 1)


def barrier(folder: Path) -> Callable[[], None]:
    """`ready` for `run_light_worker`: say so in `folder` (a file ready.PID), then wait for the file `go` there; a
    worker whose starter died meanwhile stops rather than wait for ever."""
    parent = os.getppid()

    def ready() -> None:
        (folder / f"ready.{os.getpid()}").touch()
        while not (folder / "go").exists():
            if os.getppid() != parent:
                raise SystemExit(1)
            time.sleep(0.05)
    return ready


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m headsearch.search.light", description=__doc__.splitlines()[0])
    p.add_argument("--table", required=True, type=Path, help="a table written by `headsearch table`")
    p.add_argument("--space", default=None, help="the space the table lists (default: the table's own, by name)")
    p.add_argument("--storage", required=True)
    p.add_argument("--study", required=True)
    p.add_argument("--trials", required=True, type=int)
    p.add_argument("--scale", type=float, default=0.01, help="real seconds slept per table second")
    p.add_argument("--seed", type=int, default=0, help="which of an architecture's seeds each trial takes")
    p.add_argument("--heartbeat", type=int, default=None)
    p.add_argument("--run-root", default="runs")
    p.add_argument("--report", type=Path, default=None, help="write what the worker measured here (JSON)")
    p.add_argument("--barrier", type=Path, default=None,
                   help="a folder: once the study is open, write ready.PID there and wait for the file go")
    args = p.parse_args(argv)
    import optuna

    from headsearch.search.table import load_table

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        table = load_table(args.table)
        search = light_search(table, storage=args.storage, study=args.study, trials=args.trials, space=args.space,
                              heartbeat=args.heartbeat, run_root=args.run_root)
        measured = run_light_worker(search, table, args.scale, args.seed,
                                    barrier(args.barrier) if args.barrier else None)
    except HeadsearchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.report is not None:
        args.report.write_text(json.dumps(measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
