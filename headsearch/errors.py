"""Errors the user can act on.

Everything the CLI should report as one clear line with exit code 2 derives from `HeadsearchError`.
Anything else is a bug and keeps its traceback, except the environment faults `environment_fault`
recognises (a full disk, an I/O error), which get one line and exit code 1.
"""
import contextlib
import errno
import os
import signal
import threading
from typing import Iterator

from headsearch.io import hide_passwords


class HeadsearchError(Exception):
    """Bad input: the message says what was wrong and what to do. A URL's password in it is shown as `***`
    (`io.hide_passwords`): the message is printed, written to worker logs and recorded as a trial's fail reason,
    and many name the storage URL they met."""

    def __init__(self, *args):
        super().__init__(*(hide_passwords(arg) if isinstance(arg, str) else arg for arg in args))


class ConfigError(HeadsearchError, ValueError):
    """An architecture, training or search configuration that fails validation."""


class DataError(HeadsearchError):
    """Missing or malformed data (the message names the files that were expected)."""


class Diverged(RuntimeError):
    """Training produced a non-finite loss. Not a user error: a search records it as a failed trial."""

    def __init__(self, step: int, epoch: int, loss: float):
        self.step, self.epoch, self.loss = step, epoch, loss
        super().__init__(f"training diverged: non-finite loss ({loss}) at step {step} (epoch {epoch})")


class Terminated(KeyboardInterrupt):
    """A stop signal other than Ctrl-C: SIGTERM, which a cluster sends at its time limit and on preemption
    (Slurm: SIGKILL follows after KillWait, 30 s by default). A KeyboardInterrupt, so that every path that
    ends a run on Ctrl-C (the trainer's record, a cohort's slots, the trial told FAIL as interrupted, the
    CLI's one line) ends it the same way; `signal_name` says which signal it was, `exit_code` is the
    shell's 128 + its number (143 for SIGTERM: what a scheduler reads as "stopped by SIGTERM")."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + int(signum)
        super().__init__(self.signal_name)


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM (a cluster's time limit or preemption) raises `Terminated` in the main thread, as Ctrl-C raises
    KeyboardInterrupt, instead of ending the process at once: a search's running trial is told FAIL as
    `interrupted (SIGTERM)` and retried by the next run (not left RUNNING until a later run waits out 3
    heartbeats), a trained run keeps its finished epochs and says so. Once: a
    second SIGTERM (a scheduler signalling every process of the job, the parent forwarding its own) does not
    interrupt the first one's telling. The handler before it is back afterwards (an API user's); off the main
    thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: list[int] = []

    def raise_once(signum, _frame):
        if not raised:
            raised.append(signum)
            raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, raise_once)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def interruption(e: KeyboardInterrupt) -> str:
    """What stopped a run, as its trial's fail reason says it: `interrupted (Ctrl-C)`, `interrupted (SIGTERM)`."""
    return f"interrupted ({e.signal_name if isinstance(e, Terminated) else 'Ctrl-C'})"


# errno values that mean the machine failed a write, not the input: a full disk or quota, an I/O error,
# a read-only file system, a file over the size limit.
FAULT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})
# The same faults as SQLite reports them (through SQLAlchemy, from an Optuna storage on that disk).
FAULT_MESSAGES = ("database or disk is full", "disk i/o error", "attempt to write a readonly database")


def environment_fault(e: BaseException) -> str | None:
    """One line describing `e` when it (or what caused it) is the environment failing, such as a full disk;
    None when it is anything else. The CLI reports these with exit code 1: not bad input, not a bug.
    Of a chain of faults (a checkpoint meets the full disk, then so does the record of the failure), the
    first one is described."""
    found = None
    # What Python would print as "during handling of ... another exception occurred" / "caused by".
    for err in cause_chain(e, suppressed=False):
        if isinstance(err, OSError) and err.errno in FAULT_ERRNOS:
            where = f" writing {err.filename}" if err.filename else ""
            found = f"{err.strerror or os.strerror(err.errno)}{where}"
        else:
            text = str(err).lower()
            found = next((f"the study's database reports: {m}" for m in FAULT_MESSAGES if m in text), found)
    return found


def cause_chain(e: BaseException, *, suppressed: bool) -> Iterator[BaseException]:
    """`e`, then what caused it (`__cause__`), else what it was raised while handling (`__context__`), and so on,
    each once. `suppressed`: whether a context hidden by `raise ... from None` is followed too. On purpose, not for
    `environment_fault` (the chain a traceback shows: what was re-raised `from None` was replaced by its wrapper),
    but for `liveness.unavailable` (a dropped connection under any re-raise means the storage is away: retried)."""
    seen: set[int] = set()
    err: BaseException | None = e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ if err.__cause__ is not None else (
            None if err.__suppress_context__ and not suppressed else err.__context__)


# What CUDA (and NVIDIA MPS) say of an error that leaves the device unusable for every process on it, not of a
# fault in one model: a sticky error (the CUDA context is lost; under MPS a fatal fault in one client reaches
# every client on the GPU), an uncorrectable ECC error, the MPS server gone, the device taken or lost. Not here,
# on purpose: "device-side assert triggered" (an index out of range in the model: its own trial's fault, for
# good; the other MPS clients see it as one of the errors below) and out of memory (a size, told apart).
DEVICE_FAULTS = ("illegal memory access", "unspecified launch failure", "misaligned address", "illegal instruction",
                 "hardware stack error", "ecc error", "mps client", "mps server", "busy or unavailable",
                 "cudaerrordevicesunavailable", "cudaerrorillegaladdress", "cudaerrorlaunchfailure",
                 "gpu has fallen off the bus")


def device_fault(e: BaseException) -> str | None:
    """The first line of `e` (or of what caused it) when it is a device fault (`DEVICE_FAULTS`): the device is
    unusable, the trial it stopped is not to blame (a search retries it) and the process must stop; else None."""
    for err in cause_chain(e, suppressed=True):
        text = str(err).strip()
        if any(marker in text.lower() for marker in DEVICE_FAULTS):
            return text.splitlines()[0]
    return None
