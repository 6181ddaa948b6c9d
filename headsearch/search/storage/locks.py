"""The lock files of the storages on a file: the budget lock of a SQLite database (an flock) and of a journal
file (a lock file created with O_EXCL, renewed while held, broken after LOCK_SILENCE seconds of silence),
Optuna's own lock on journal appends (`_JournalAppendLock`), and what every budget lock yields (`LockHold`) and
how a held one is renewed (`_renewing`). The locks on servers (Redis, PostgreSQL, MySQL) are in
`server_locks`."""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

# The timings (LOCK_SILENCE, LOCK_RENEW, ...) are read at each use, never copied: a test or worker script sets them.
import headsearch.search.storage.timings as timings
from headsearch.errors import HeadsearchError
from headsearch.io import hide_passwords

_log = logging.getLogger(__name__)


class LockHold:
    """What `budget_lock` yields. `lost` turns True when the holder learns that the lock was taken from it: a
    waiter broke a file lock this worker had not renewed for LOCK_SILENCE seconds (it was paused or hung), a
    Redis lock expired, the database ended the session that held an advisory lock. Another worker may then
    have been inside at the same time. The holder goes on (it never removes a lock that is not its own) and
    a warning says so once; `reason` says how it was lost. `kind`: the schema lock of a database yields one too.
    `what` names the lock and where it is, a URL's password hidden (it is said in warnings). `exclusive`: False
    where no lock is taken at all (grpc://: the fence alone), so that workers' asks are in no one order."""

    def __init__(self, what: str, kind: str = "budget lock", exclusive: bool = True):
        self.what, self.kind, self.lost, self.reason = hide_passwords(what), kind, False, ""
        self.exclusive = exclusive

    def lose(self, reason: str) -> None:
        if not self.lost:
            self.lost, self.reason = True, reason
            _log.warning("headsearch: the %s %s was lost while held: %s", self.kind, self.what, reason)

def _lock_file_error(path: str, e: OSError) -> HeadsearchError:
    folder = os.path.dirname(path) or "."
    return HeadsearchError(
        f"cannot write the lock file {path} ({e.strerror or e}): every worker must be able to create and remove"
        f" files in {folder} (if another user left {os.path.basename(path)} there, remove it), or pass another --storage")


@contextlib.contextmanager
def _flock(target: Path) -> Iterator[LockHold]:
    """An flock on `REAL.budget.lock`, REAL the real path of `target` (a symlink to the database takes the
    same lock). flock needs no write access: a lock file that cannot be opened for writing (another user's)
    is locked through a read-only descriptor; one that can be neither opened nor created is one line."""
    lock_file = os.path.realpath(target) + ".budget.lock"
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        try:
            fd = os.open(lock_file, os.O_RDONLY)
        except OSError:
            raise _lock_file_error(lock_file, e) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # ENOLCK: a file system without locks
            raise HeadsearchError(f"cannot lock {lock_file} ({e.strerror}): put the database on a local disk,"
                                  " or pass another --storage") from None
        yield LockHold(lock_file)
    finally:
        os.close(fd)  # which releases the flock

# -- lock files (the journal's budget lock, Optuna's lock on journal appends) ----------------------------


def _lock_token() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"


def _identity(path: str) -> tuple | None:
    """What a waiter watches of a lock file to tell a dead holder's lock from a live one: it changes when the
    holder renews it (the modification time) or when another lock replaces it (the inode, the owner token
    written in it, or a symlink's target: Optuna's default lock); None when there is no lock file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # a folder that cannot be searched, a path through a regular file
        raise _lock_file_error(path, e) from None
    content: bytes | str | None = None
    with contextlib.suppress(OSError):  # gone meanwhile, or unreadable: the rest tells
        if stat.S_ISLNK(st.st_mode):
            content = os.readlink(path)
        else:
            with open(path, "rb") as f:
                content = f.read(256)
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, content


class Silence:
    """How long a watched lock file has stayed the same, by this process's clock (the clocks of NFS clients
    and server differ, so a file's modification time is compared only with itself). Also the clock of each
    running trial's sign of life that `liveness.SilenceWatch` judges (`now`: one reading for all its trials)."""

    def __init__(self) -> None:
        self.seen: Any = None
        self.since: float | None = None  # None: nothing seen yet (whatever is seen first, None too, starts it)

    def silent_for(self, identity: Any, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        if self.since is None or identity != self.seen:
            self.seen, self.since = identity, now
        return now - self.since


def _remove_if(path: str, is_it) -> bool:
    """Remove the lock file `path` if `is_it(its identity)`, atomically: rename it to a name of our own (of
    two processes renaming the same file, one succeeds), then judge the renamed file, which nobody else can
    replace any more. A file that turns out to be another (replaced after it was judged) is put back."""
    aside = f"{path}.{uuid.uuid4().hex}.aside"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise _lock_file_error(path, e) from None
    if is_it(_identity(aside)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)
        return True
    try:  # a hard link puts it back only where no new lock file took the place (rename would overwrite one)
        os.link(aside, path, follow_symlinks=False)
    except FileExistsError:
        pass  # its holder learns at its next renewal that its lock is gone
    except OSError:  # a file system without hard links
        if not os.path.lexists(path):
            with contextlib.suppress(OSError):
                os.rename(aside, path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(aside)
    return False


class _LockFile:
    """One holding of a lock file: created with O_EXCL, holding an owner token (host:pid:uuid), renewed by
    touching its own inode through the descriptor kept open (so a renewal never touches a successor's file),
    and removed only if the path still names that inode (the descriptor kept open also stops the inode
    number from being reused by a successor's file while held)."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None
        self.inode: tuple[int, int] | None = None

    def try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            raise _lock_file_error(self.path, e) from None
        with contextlib.suppress(OSError):  # a full disk: the inode still identifies the holding
            os.write(fd, f"{_lock_token()}\n".encode())
        st = os.fstat(fd)
        self.fd, self.inode = fd, (st.st_dev, st.st_ino)
        return True

    def ours(self) -> bool:
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.inode

    def renew(self) -> bool:
        """Touch the lock file if it is still ours; False when it is not (broken by a waiter)."""
        if not self.ours():
            return False
        os.utime(self.fd)
        return True

    def release(self) -> bool:
        """Remove the lock file if it is still ours, never another's; False when it was not ours any more."""
        try:
            return self.ours() and _remove_if(self.path, lambda identity: identity is not None
                                              and identity[:2] == self.inode)
        except HeadsearchError as e:  # the folder became unwritable: the lock is broken after LOCK_SILENCE
            _log.warning("headsearch: %s", e)
            return True
        finally:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


def _break_stale(path: str, seen: tuple, guard_silence: Silence) -> None:
    """Remove the lock file `path`, judged stale as `seen`, if it is still that file. Under a guard file
    `PATH.break` (O_EXCL), so that two waiters who judged the same file stale cannot both remove it: the
    second one to get the guard finds a new file there (the first one's, or a third waiter's) and leaves it.
    A guard left by a waiter that died while breaking (a few microseconds) is removed in turn after
    LOCK_SILENCE seconds."""
    guard = _LockFile(path + ".break")
    if not guard.try_create():
        if (g := _identity(guard.path)) is not None and guard_silence.silent_for(g) > timings.LOCK_SILENCE:
            _remove_if(guard.path, lambda identity: identity == g)
        time.sleep(0.01)
        return
    try:
        if _identity(path) == seen and _remove_if(path, lambda identity: identity == seen):
            _log.warning("headsearch: removed the lock file %s: not renewed for %s s, its worker died or hangs",
                         path, timings.LOCK_SILENCE)
    finally:
        guard.release()


def _acquire_lock_file(path: str) -> _LockFile:
    """Wait for the lock file `path` and take it; break it when it stays the same for LOCK_SILENCE seconds."""
    lock, held, guard = _LockFile(path), Silence(), Silence()
    pause = 0.001
    while not lock.try_create():
        seen = _identity(path)
        if seen is None:
            continue  # released between the two calls
        if held.silent_for(seen) > timings.LOCK_SILENCE:
            _break_stale(path, seen, guard)
            continue
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
    return lock


@contextlib.contextmanager
def _journal_file_lock(journal: Path) -> Iterator[LockHold]:
    """A lock file beside a journal, `REAL.budget.lock` (REAL the journal's real path), taken by creating it
    with O_EXCL: the mechanism of Optuna's JournalFileOpenLock, which NFSv3 and later honour. Written out
    here because Optuna 4.0's class cannot break the lock of a dead holder, and later ones break it
    check-then-release (two waiters can both break it and both enter). Here (`_LockFile`):
    - the holder writes an owner token into the file, touches the file every LOCK_RENEW seconds through its
      own descriptor, and at the end removes it only if the path still names its own file (rename aside,
      check, unlink; a successor's file moved by mistake is put back): a holder whose lock was broken never
      touches or deletes its successor's lock; it learns it lost the lock (`LockHold.lost`, a warning);
    - a waiter breaks a lock file that has not changed (modification time, inode, token) for LOCK_SILENCE
      seconds by its own clock, under a guard file and only if it is still the same file (`_break_stale`),
      then competes for the lock like any waiter: one of two waiters that judged it stale enters."""
    path = os.path.realpath(journal) + ".budget.lock"
    lock = _acquire_lock_file(path)
    hold = LockHold(path)

    def broken() -> bool:
        hold.lose(f"another worker broke it as stale (this one had not renewed it for {timings.LOCK_SILENCE} s:"
                  " paused or hung); its lock file was left in place")
        return False

    try:
        with _renewing(lambda: lock.renew() or broken()):
            yield hold
    finally:
        if not lock.release():
            broken()


class _JournalAppendLock:
    """Optuna's own lock on a journal file, `REAL.lock`, held while a worker appends to the journal, taken
    the way the journal's budget lock is (`_journal_file_lock`): renewed while held, broken after LOCK_SILENCE
    seconds without a change, under a guard, and removed only by its owner. Given to JournalFileBackend on
    every Optuna version: with 4.0's default lock (JournalFileSymlinkLock, no grace period) the lock of a
    worker killed during an append is never broken and every later append waits forever; later versions'
    grace period breaks it check-then-release. A file (or Optuna's symlink) at the same path excludes both
    ways, so a plain Optuna process writing the same journal and a headsearch worker still exclude each
    other."""

    def __init__(self, path: str):
        self.path = path
        self._held: tuple | None = None

    def acquire(self) -> bool:
        lock = _acquire_lock_file(self.path)
        renewing = _renewing(lock.renew)
        renewing.__enter__()
        self._held = (lock, renewing)
        return True

    def release(self) -> None:
        if self._held is None:
            return
        (lock, renewing), self._held = self._held, None
        renewing.__exit__(None, None, None)
        if not lock.release():
            _log.warning("headsearch: the journal lock %s was broken during a write (this worker did not renew it"
                         " for %s s): another worker may have written at the same time", self.path,
                         timings.LOCK_SILENCE)

    def __getstate__(self) -> dict:  # JournalStorage is picklable; a holding is not
        return {"path": self.path, "_held": None}

@contextlib.contextmanager
def _renewing(renew) -> Iterator[None]:
    """Call `renew()` every LOCK_RENEW seconds, from a daemon thread, until the block ends or `renew` returns
    False (the lock is no longer this holder's: renewing it would renew a successor's)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(timings.LOCK_RENEW):
            try:
                if renew() is False:
                    return
            except Exception:  # a failed renewal is retried; the lock only lapses after LOCK_SILENCE
                pass

    thread = threading.Thread(target=loop, daemon=True, name="headsearch-budget-lock")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=timings.LOCK_RENEW + 1)
