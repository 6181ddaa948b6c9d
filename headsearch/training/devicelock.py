"""Workers sharing one device, and measuring alone on it: a readers-writer lock across processes.

Several search workers may train on one GPU at once (`--trials-per-gpu K`). That is what makes the
GPU busy, but it also makes a step time measured by one worker depend on what the others are running,
so a `time` objective measured that way would rank architectures by luck. The scheme:

- a worker does its ordinary training inside `share.shared()`, held for a chunk of work (e.g. one
  epoch) and released at a point where the worker has synchronised its device, so none of its
  kernels still run after the release;
- it measures an architecture's step time inside `share.exclusive()`, during which no other worker
  on that device runs any work.

`DeviceShare` is that lock for one device, built on `fcntl.flock` over two files in a lock folder:

- `<key>.lock` is the lock proper: shared holders take it LOCK_SH, an exclusive holder LOCK_EX;
- `<key>.gate` is a turnstile. flock lets new LOCK_SH requests in while a LOCK_EX request waits, so
  a busy set of shared holders would starve an exclusive one forever. Every request therefore passes
  the gate (LOCK_EX) first: a shared request holds it only for the moment it takes the lock, an
  exclusive request holds it while it waits for the shared holders to drain and while it runs. Once
  an exclusive request waits, new shared requests queue at the gate behind it.

The kernel does not queue flock waiters in order, so requests waiting at the gate together are served
in no fixed order (exclusive requests among themselves too); but a shared request holds the gate only
for two system calls, so an exclusive request finds it free almost at once, and from then on waits only
for the shared holds already in place (tests/test_devicelock.py: plain flock starves it there).

The kernel releases a flock when its file is closed, also when the process dies (SIGKILL included),
so a killed worker never leaves a device locked. Locks belong to open files, not to processes, so:

- **shared() and exclusive() never nest**, in any order, in one thread: the inner request would queue
  at the gate behind an exclusive request that itself waits for the outer hold, a deadlock. Nesting
  raises `LockNestingError` at once instead (also across `DeviceShare` objects for the same device).
- a child started by fork inherits the open lock files of a hold in progress; headsearch starts its
  workers with multiprocessing's spawn, which inherits nothing.

Put the lock folder on a local disk (flock over NFS is not reliable), e.g. `default_lock_dir()`.
Time spent waiting is measured: each hold reports it (`DeviceHold.waited`) and `waited_total` sums it,
so the trainer can keep lock waits out of its timings.
"""
from __future__ import annotations

import contextlib
import fcntl
import re
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

SHARED = "shared"
EXCLUSIVE = "exclusive"


class LockNestingError(RuntimeError):
    """shared() or exclusive() entered while this thread already holds one for the same device."""


@dataclass(frozen=True)
class DeviceHold:
    """One hold of a device: its mode ("shared" or "exclusive") and the seconds spent waiting for it."""

    mode: str
    waited: float


class Share(Protocol):
    """What a worker uses: `DeviceShare` for a device shared with other processes, `NoShare` alone."""

    waited_total: float

    def shared(self) -> contextlib.AbstractContextManager[DeviceHold]: ...

    def exclusive(self) -> contextlib.AbstractContextManager[DeviceHold]: ...


def device_key(gpu: str | None) -> str:
    """The key of a device as a worker is pinned to it: "cpu" for None, else "cuda-" and the GPU's name
    in CUDA_VISIBLE_DEVICES (an index, a UUID "GPU-…" or a MIG ID). Use UUIDs where processes that
    must coordinate may number the GPUs differently."""
    return "cpu" if gpu is None else f"cuda-{gpu}"


def default_lock_dir() -> Path:
    """$HEADSEARCH_DEVICE_LOCKS, else a per-user folder in the system's temporary directory (a local disk on
    every usual setup)."""
    from headsearch.environment import env_value

    return env_value("HEADSEARCH_DEVICE_LOCKS")


def lock_file_stem(key: str) -> str:
    """A file name for `key`: its safe characters, plus a checksum of the key when any had to be replaced
    (MIG IDs hold slashes), so two keys never share files."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", key)
    return safe if safe == key and key not in ("", ".", "..") else f"{safe}-{zlib.crc32(key.encode()):08x}"


# The holds of this process, per lock and thread: what the nesting check reads.
_held: dict[tuple[str, int], str] = {}
_held_guard = threading.Lock()


@contextlib.contextmanager
def _no_nesting(lock_id: str, mode: str, describe: str) -> Iterator[None]:
    """Mark this thread as holding `lock_id` for the duration, or raise when it already does."""
    slot = (lock_id, threading.get_ident())
    with _held_guard:
        outer = _held.get(slot)
        if outer is None:
            _held[slot] = mode
    if outer is not None:
        raise LockNestingError(
            f"{mode}() entered inside {outer}() of {describe} in the same thread: holds of one device never"
            f" nest (the inner request would wait behind a waiting exclusive request, which waits for the"
            f" outer hold). Leave the {outer} hold first."
        )
    try:
        yield
    finally:
        with _held_guard:
            del _held[slot]


class DeviceShare:
    """A readers-writer lock on one device (`device_key`) across the processes of this machine, held
    through files in `lock_dir` (created if missing). `shared()` for ordinary work, `exclusive()` to
    measure alone; both yield a `DeviceHold` saying how long the request waited."""

    def __init__(self, lock_dir: Path, device_key: str):
        self.lock_dir, self.device_key = Path(lock_dir), device_key
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        stem = lock_file_stem(device_key)
        self.gate_path = self.lock_dir / f"{stem}.gate"
        self.lock_path = self.lock_dir / f"{stem}.lock"
        self.waited_total = 0.0

    @staticmethod
    def none() -> "NoShare":
        """The same interface for a worker alone on its device: nothing to wait for."""
        return NoShare()

    def __repr__(self) -> str:
        return f"DeviceShare({str(self.lock_dir)!r}, {self.device_key!r})"

    @contextlib.contextmanager
    def shared(self) -> Iterator[DeviceHold]:
        """Hold the device with other shared holders; waits while an exclusive hold runs or waits."""
        with _no_nesting(str(self.lock_path.resolve()), SHARED, repr(self)):
            start = time.monotonic()
            with open(self.gate_path, "a") as gate, open(self.lock_path, "a") as lock:
                fcntl.flock(gate, fcntl.LOCK_EX)  # queue behind any waiting exclusive request
                fcntl.flock(lock, fcntl.LOCK_SH)
                fcntl.flock(gate, fcntl.LOCK_UN)  # let the next request through at once
                yield self._record(SHARED, start)
                # Closing `lock` releases it (also if the body raised, or the process dies).

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[DeviceHold]:
        """Hold the device alone: waits for the current shared holders to finish, and keeps new ones out
        from the moment it starts waiting until it ends."""
        with _no_nesting(str(self.lock_path.resolve()), EXCLUSIVE, repr(self)):
            start = time.monotonic()
            with open(self.gate_path, "a") as gate, open(self.lock_path, "a") as lock:
                fcntl.flock(gate, fcntl.LOCK_EX)  # from here on, new shared requests wait at the gate
                fcntl.flock(lock, fcntl.LOCK_EX)  # the shared holders already in drain
                yield self._record(EXCLUSIVE, start)

    def _record(self, mode: str, start: float) -> DeviceHold:
        waited = time.monotonic() - start
        self.waited_total += waited
        return DeviceHold(mode, waited)


class NoShare:
    """`DeviceShare`'s interface for a worker alone on its device: never waits (it still refuses nesting,
    so code tested alone behaves as it will beside other workers)."""

    device_key = None

    def __init__(self) -> None:
        self.waited_total = 0.0
        self._id = f"no-share-{id(self)}"

    def __repr__(self) -> str:
        return "NoShare()"

    @contextlib.contextmanager
    def shared(self) -> Iterator[DeviceHold]:
        with _no_nesting(self._id, SHARED, repr(self)):
            yield DeviceHold(SHARED, 0.0)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[DeviceHold]:
        with _no_nesting(self._id, EXCLUSIVE, repr(self)):
            yield DeviceHold(EXCLUSIVE, 0.0)
