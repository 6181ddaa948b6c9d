"""Worker processes on one machine, as the search's plan says (headsearch.machine.plan).

The plan names each worker's GPU; worker i is pinned to it by setting its CUDA_VISIBLE_DEVICES before
torch initialises CUDA, and gets the plan itself (the parent plans once; a worker never plans). Each
process runs `Search.run_worker`; the budget lock makes the trial budget exact across all of them.
`open_search` and `run_search` are what `headsearch run` does: one worker runs in the command's own process.

Imports go one way: plan <- runner <- workers (this module starts workers that run the runner's loop).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from headsearch.errors import HeadsearchError, Terminated, device_fault, sigterm_raises
from headsearch.io import write_atomic
from headsearch.machine.mps import managed_mps
from headsearch.machine.plan import Plan, worker_seat
from headsearch.search.cost_sampler import COST_AWARE
from headsearch.search.costs import ArchCost, CostSummary, stored_costs
from headsearch.search.runner import Search
from headsearch.search.settings import SearchSettings


# A worker stopped by a device fault (`headsearch.errors.device_fault`) exits with this code, its one line
# naming the trial it was running, then DEVICE_FAULT, then the fault's first line.
DEVICE_FAULT_EXIT = 3
DEVICE_FAULT = "device fault, the trial kept for retry by a resumed run: "


@dataclass(frozen=True)
class WorkerFailure:
    """A worker process that ended badly: exit code 2 for bad input (`message` is its one line), else a
    crash or a device fault (`message` names the trial it was running and the error; the traceback is in
    `log`). `device`: its GPU (None: the CPU); `at`: when it wrote its line (the epoch's seconds)."""

    index: int | str  # a worker's index, or COSTS_WORKER
    exit_code: int
    message: str
    log: Path
    device: str | None = None
    at: float | None = None

    @property
    def bad_input(self) -> bool:
        return self.exit_code == 2

    @property
    def device_fault(self) -> str | None:
        """The device fault that stopped it (the error's first line), if one did."""
        return (self.message.partition(DEVICE_FAULT)[2] or None) if self.exit_code == DEVICE_FAULT_EXIT else None


def open_search(search):
    """Open (or resume) the study of `search` (a `Search`). The data is loaded first, so that missing or
    malformed data fails before a study exists: for the trials when they run in this process (one
    worker), else once on the CPU and let go (the workers load their own; a tokenizer trained here is
    cached for them)."""
    if len(search.machine_plan().devices) == 1:
        search.prepare_data()
    else:
        search.check_data()
    return search.open()


def with_space_line(line: str, search) -> str:
    """The plan's line, and what it does when the space holds fewer architectures than --trials."""
    note = search.archs.space_line()
    return f"{line}; {note}" if note else line


@sigterm_raises()  # a cluster's stop, wherever it finds this process (the parent's wait: `interrupt_flag`)
def run_search(search, callbacks: Sequence = (), argv: list[str] | None = None,
               poll: Callable[[], None] | None = None, every: float = 2.0,
               announce: Callable[[str], None] | None = None, on_cost: Callable | None = None) -> list[WorkerFailure]:
    """Run the trials of `search` on this machine as its plan says (headsearch.machine.plan): in this
    process (with `callbacks`) when it has one worker, else in worker processes (`run_workers`), with
    NVIDIA MPS started for them when several share a GPU and it can be (stopped when they end), calling
    `poll()` every `every` seconds until they end. `announce(line)` hears the plan, once, before any trial.
    With the cost-aware sampler every architecture's cost is measured first (`measure_costs_first`;
    `on_cost(done, total, ArchCost)` hears each one) and the plan line says what that took. SIGTERM stops it as
    Ctrl-C does (`sigterm_raises`), raising `Terminated`.
    Returns the worker processes that failed (none in process: errors raise there)."""
    plan = search.machine_plan()
    costs, failures = measure_costs_first(search, poll, every, on_cost)
    if failures:
        return failures
    extra = [costs.line()] if costs is not None else []
    if len(plan.devices) == 1:
        if announce is not None:
            announce("; ".join([with_space_line(plan.describe(), search), *extra]))
        search.run_worker(0, callbacks=callbacks, argv=argv)
        return []
    with managed_mps(plan.mps) as mps:
        if announce is not None:
            announce("; ".join([with_space_line(plan.describe(mps if plan.mps else None), search), *extra]))
        procs = run_workers(search, argv)
        with interrupt_flag() as interrupted:
            try:
                while any(p.is_alive() for p in procs) and not interrupted:
                    time.sleep(every)
                    if poll is not None and not interrupted:
                        poll()
                if interrupted:
                    raise KeyboardInterrupt if interrupted[0] == signal.SIGINT else Terminated(interrupted[0])
            except KeyboardInterrupt as e:
                stop_workers(procs, e)  # before MPS stops, and so that none goes on training alone
                raise
    logs = worker_log_dir(search)
    return [worker_failure(i, p.exitcode, logs, plan.devices[i]) for i, p in enumerate(procs) if p.exitcode]


def measure_costs_first(search, poll: Callable[[], None] | None = None, every: float = 2.0,
                        on_cost: Callable | None = None):
    """With the cost-aware sampler, every architecture's epoch seconds alone, measured before any trial
    (`headsearch.search.costs`): in this process when the plan has one worker, else in one process on the
    first worker's GPU before the workers (and MPS) start, its progress read from the study. Returns
    (`CostSummary` or None for another sampler, [the measuring process's `WorkerFailure`] or [])."""
    if search.sampler_name() != COST_AWARE:
        return None, []
    plan = search.machine_plan()
    study = search.open()
    if len(plan.devices) == 1:
        return search.use_costs(study, on_cost), []
    total = len(search.archs.listing() or {})
    heard = set(stored_costs(study))
    before, measured = len(heard), 0
    proc = mp.get_context("spawn").Process(target=_costs_main, args=(search.settings, plan.devices[0], plan, search.base),
                                           name="headsearch-costs")
    proc.start()
    try:
        while proc.is_alive():
            proc.join(timeout=every)
            for key, c in stored_costs(study).items():
                if key in heard:
                    continue
                heard.add(key)
                cost = ArchCost(c["config_key"], c["arch"], key, c["epoch_seconds_alone"], c["seconds"], c["source"])
                measured += cost.source == "measured"
                if on_cost is not None:
                    on_cost(len(heard) - before, total - before, cost)
            if poll is not None:
                poll()
    except KeyboardInterrupt as e:
        stop_workers([proc], e)
        raise
    if proc.exitcode:
        return None, [worker_failure(COSTS_WORKER, proc.exitcode, worker_log_dir(search), plan.devices[0])]
    return CostSummary(total, measured, sum(float(c["seconds"]) for c in stored_costs(study).values())), []


@contextlib.contextmanager
def interrupt_flag():
    """A list that Ctrl-C (SIGINT) and SIGTERM append their number to while the parent waits for its workers,
    instead of raising KeyboardInterrupt (`Terminated`) wherever the parent happens to be: raised inside a garbage
    collector's weakref callback, Python prints it as "Exception ignored" and drops it, and the workers would
    train on (seen in CI). Off the main thread (where no handler can be set) it stays empty and the signals act
    as they would."""
    flag: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {signum: signal.signal(signum, lambda signum, _: flag.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def failure_line(failures: Sequence[WorkerFailure]) -> str:
    """One line for failed worker processes: the first failure's reason (bad input: as one process says
    it), where its log is, and how many others failed. Workers a device fault stopped are one event, said once
    (`device_fault_line`)."""
    faults = [f for f in failures if f.device_fault is not None]
    first = failures[0]
    if faults:
        line, others = device_fault_line(faults), len(failures) - len(faults)
    elif first.bad_input:
        line, others = first.message, len(failures) - 1
    else:
        who = "the process measuring the costs" if first.index == COSTS_WORKER else f"worker {first.index}"
        line, others = f"{who} failed {first.message} (traceback in {first.log})", len(failures) - 1
    return line + (f"; {others} other worker(s) failed too, logs beside it" if others else "")


def device_fault_line(faults: Sequence[WorkerFailure]) -> str:
    """The workers a device fault stopped, in one line: under NVIDIA MPS a fatal fault in one client reaches every
    client on the GPU, so N workers failing at once are one event, not N architectures' faults."""
    where = ", ".join(dict.fromkeys(f"GPU {f.device}" if f.device is not None else "the CPU" for f in faults))
    times = [f.at for f in faults if f.at is not None]
    within = f" within {max(times) - min(times):.0f} s" if len(times) > 1 else ""
    who = f"{len(faults)} workers stopped{within}" if len(faults) > 1 else f"worker {faults[0].index} stopped"
    return (f"device fault on {where}: {who} ({faults[0].device_fault}); their trials are kept for retry: rerun"
            f" the same command (tracebacks in {faults[0].log.parent})")


# After SIGTERM the workers get this long to tell their trials and exit before they are killed: a worker's stop
# takes a second or two (its epoch interrupted, the trial told FAIL; storage retries at worst ~6 s), and with
# MPS's stop (up to 10 s, `managed_mps`) and the summary the parent exits within Slurm's KillWait (30 s).
TERM_PATIENCE = 12.0


def stop_workers(procs, stop: KeyboardInterrupt, grace: float = 5.0, patience: float = 60.0) -> None:
    """After Ctrl-C: a terminal's Ctrl-C reached the workers too (one process group), so give them `grace`
    seconds to record their running trial as failed and exit; send SIGINT to any still running (the
    parent alone was interrupted, e.g. by `kill -INT`), wait `patience` seconds, then terminate the rest.
    After SIGTERM (`stop` is `Terminated`: a scheduler's stop, with its kill to follow): forward it at once (a
    worker that had it already ignores it, `sigterm_raises`), wait `TERM_PATIENCE` seconds, kill the rest."""
    term = isinstance(stop, Terminated)
    deadline = time.monotonic() + (0.0 if term else grace)
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM if term else signal.SIGINT)
    deadline = time.monotonic() + (TERM_PATIENCE if term else patience)
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            if term:
                p.kill()  # a second SIGTERM would be ignored
            else:
                p.terminate()
            p.join(timeout=5)


def worker_log_dir(search) -> Path:
    return Path(search.settings.run_root) / search.study_name / "workers"


def worker_failure(index: int | str, exit_code: int, log_dir: Path, device: str | None = None) -> WorkerFailure:
    """What worker `index` (on `device`) left in `log_dir` when it failed: its one-line reason and when it wrote
    it, else how it ended."""
    log, failed = log_dir / f"worker-{index}.log", log_dir / f"worker-{index}.failed"
    try:
        message, at = failed.read_text().strip(), failed.stat().st_mtime
    except OSError:
        message, at = "", None
    if not message:
        message = f"killed by signal {-exit_code}" if exit_code < 0 else f"exited with code {exit_code}"
    return WorkerFailure(index, exit_code, message, log, device, at)


def run_workers(search, argv: list[str] | None = None) -> list:
    """Start the worker processes of `search` (a `Search`; its plan's devices), each pinned to its GPU;
    return the processes."""
    plan = search.machine_plan()
    ctx = mp.get_context("spawn")
    procs = []
    for i, gpu in enumerate(plan.devices):
        p = ctx.Process(target=_worker_main, args=(search.settings, i, gpu, len(plan.devices), argv, plan, search.base),
                        name=f"headsearch-worker-{i}")
        p.start()
        procs.append(p)
    return procs


COSTS_WORKER = "costs"  # the log and failure files of the process that measures the costs first


def _worker_main(settings: SearchSettings, index: int, gpu: str | None, n_processes: int, argv,
                 plan: Plan | None = None, base=None) -> None:
    search = _worker_search(settings, gpu, n_processes, plan, base)
    _logged(search, index, lambda: search.run_worker(index, argv=argv))


def _costs_main(settings: SearchSettings, gpu: str | None, plan: Plan, base) -> None:
    """The process that measures every architecture's cost before the workers start (`measure_costs_first`)."""
    search = _worker_search(settings, gpu, 1, plan, base)
    _logged(search, COSTS_WORKER, lambda: search.use_costs(search.open()))


def _worker_search(settings: SearchSettings, gpu: str | None, n_processes: int, plan: Plan | None, base):
    """A worker process's search, on its seat: pinned to `gpu`, given its share of the CPU's threads
    (`headsearch.machine.plan.worker_seat`)."""
    seat = worker_seat(gpu, n_processes, plan.threads if plan is not None else None, settings.device)
    # The parent resolved and checked the config: not again.
    search = Search(settings, resolved_base=base, seat=seat)
    if plan is not None:
        search.use_plan(plan)  # the parent's: a worker sees one GPU and would plan otherwise
    return search


def _logged(search, index, body: Callable[[], object]) -> None:
    """Run `body` with this process's output in worker-INDEX.log (SIGTERM stops it as Ctrl-C does:
    `sigterm_raises`); a failure leaves its one line in worker-INDEX.failed and exits 2 (bad input), 3 (a
    device fault: the device is unusable, so this worker stops; its trial was kept for retry) or 1."""
    log_dir = worker_log_dir(search)
    log_dir.mkdir(parents=True, exist_ok=True)
    failed = log_dir / f"worker-{index}.failed"
    failed.unlink(missing_ok=True)  # a resumed search's worker starts clean
    with open(log_dir / f"worker-{index}.log", "a") as log:
        sys.stdout = sys.stderr = log
        try:
            with sigterm_raises():
                body()
        except KeyboardInterrupt:
            pass
        except HeadsearchError as e:  # bad input: the same one line as in one process
            print(f"error: {e}", flush=True)
            write_atomic(failed, f"{e}\n")
            raise SystemExit(2)
        except BaseException as e:
            traceback.print_exc()
            where = f"in trial {search.current_trial}: " if search.current_trial is not None else "outside a trial: "
            if (fault := device_fault(e)) is not None:
                write_atomic(failed, f"{where}{DEVICE_FAULT}{fault}\n")
                raise SystemExit(DEVICE_FAULT_EXIT)
            reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
            write_atomic(failed, f"{where}{type(e).__name__}{': ' + reason if reason else ''}\n")
            raise SystemExit(1)
