"""NVIDIA MPS for a search that runs several processes per GPU: started and stopped by headsearch.

Without the Multi-Process Service, the kernels of different processes on one GPU take turns (time
slicing): a small model's kernels leave most of the GPU idle, and K of them side by side gain little.
MPS funnels the processes' work through one server so their kernels run concurrently (on an H100,
8 concurrent training processes reach 175,000 samples/s with MPS against 158,000 without).

`managed_mps(wanted)` starts a private MPS control daemon (`nvidia-cuda-mps-control -d`) for the
length of a search when it is wanted (several processes share a GPU, `shares_a_gpu`), the control
binary is installed and nobody else runs MPS here; and it stops it when the search ends, on Ctrl-C
or an exception too. Anything else leaves the search as it was: MPS is a speed-up, never a
requirement, so a daemon that fails to start is reported ("failed") and the search runs without it.

The daemon's pipe and log folders are a fresh temporary folder, named to the daemon and to the
processes through CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY. Both are set in `os.environ`
while the context is open, so the worker processes started inside it (multiprocessing spawn copies
the environment) connect to this daemon when they initialise CUDA. Hence:

- start the workers inside the context, and
- the parent must not have created a CUDA context it keeps using: a process connects to MPS (or
  not) when it initialises CUDA, so a context the parent made before the daemon started stays
  outside MPS, time-slicing against the workers, and one made inside it keeps the daemon from quitting
  until the parent lets it go.

A process killed with SIGKILL cannot stop its daemon: `echo quit | nvidia-cuda-mps-control` with
CUDA_MPS_PIPE_DIRECTORY set to the folder in its environment does (`mps_daemon_pids` lists them).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

CONTROL_BINARY = "nvidia-cuda-mps-control"
SERVER_BINARY = "nvidia-cuda-mps-server"
# The kernel keeps 15 characters of a process name (/proc/PID/comm): both binaries read as this.
TRUNCATED_NAME = "nvidia-cuda-mps"
PIPE_VAR, LOG_VAR = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"

STARTED, ALREADY_RUNNING, UNAVAILABLE, OFF, FAILED = "started", "already running", "unavailable", "off", "failed"


@dataclass(frozen=True)
class MpsStatus:
    """What `managed_mps` did: `state` is one of "started", "already running" (someone else's MPS is in
    use), "unavailable" (no control binary), "off" (not wanted), "failed" (it would not start; the
    search goes on without it); `reason` says why in a few words; `pipe_dir` is the private folder of
    a daemon this process started."""

    state: str
    reason: str
    pipe_dir: Path | None = None

    @property
    def active(self) -> bool:
        """Whether the workers will run under MPS (ours or another one)."""
        return self.state in (STARTED, ALREADY_RUNNING)

    def describe(self) -> str:
        return f"MPS {self.state}: {self.reason}"


def shares_a_gpu(devices: Sequence[str | None]) -> bool:
    """Whether two of the planned worker processes (their CUDA_VISIBLE_DEVICES, None for the CPU) share
    a GPU: what makes MPS worth starting."""
    gpus = [d for d in devices if d is not None]
    return len(gpus) > len(set(gpus))


def control_binary() -> str | None:
    """The path of `nvidia-cuda-mps-control` on PATH, or None."""
    return shutil.which(CONTROL_BINARY)


def mps_available() -> bool:
    """Whether this machine has the MPS control binary (installed with the NVIDIA driver on Linux)."""
    return control_binary() is not None


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:  # the process ended meanwhile, or it is not ours to read
        return None


def _is_mps_process(proc: Path) -> bool:
    """Whether /proc/PID `proc` is a live MPS control daemon or server, by the name it was started under
    (argv[0]), else by its kernel name when its command line cannot be read."""
    stat = _read(proc / "stat")
    if stat is None or stat.rpartition(b")")[2].split()[:1] == [b"Z"]:
        return False  # gone, or a zombie: ended, only not yet reaped
    cmdline = _read(proc / "cmdline")
    if cmdline:
        argv0 = os.path.basename(cmdline.split(b"\0", 1)[0].decode(errors="replace"))
        return argv0 in (CONTROL_BINARY, SERVER_BINARY)
    comm = _read(proc / "comm")
    return comm is not None and comm.strip().decode(errors="replace") == TRUNCATED_NAME


def mps_daemon_pids(pipe_dir: Path | None = None, proc_root: Path = Path("/proc")) -> list[int]:
    """The MPS control daemons and servers running on this machine (as far as /proc shows them), or with
    `pipe_dir` only those whose environment names it as their CUDA_MPS_PIPE_DIRECTORY (ours)."""
    wanted = None if pipe_dir is None else f"{PIPE_VAR}={pipe_dir}".encode()
    pids = []
    for entry in proc_root.iterdir() if proc_root.is_dir() else ():
        if not entry.name.isdigit() or not _is_mps_process(entry):
            continue
        if wanted is not None and wanted not in (_read(entry / "environ") or b"").split(b"\0"):
            continue
        pids.append(int(entry.name))
    return sorted(pids)


def mps_daemon_running() -> bool:
    """Whether an MPS control daemon (or server) already runs on this machine, anyone's."""
    return bool(mps_daemon_pids())


def _someone_elses_mps(daemon_running: Callable[[], bool]) -> str | None:
    """Why MPS is already someone else's business here, or None."""
    if os.environ.get(PIPE_VAR):
        return f"{PIPE_VAR} is set ({os.environ[PIPE_VAR]}): the MPS named there is used as it is"
    if daemon_running():
        return "an MPS daemon already runs on this machine: the workers use it as it is"
    return None


def _first_line(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""


def _start_daemon(binary: str, env: dict[str, str], timeout: float) -> str | None:
    """Run `nvidia-cuda-mps-control -d` (it forks the daemon and returns); None on success, else why not."""
    try:
        done = subprocess.run([binary, "-d"], env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{CONTROL_BINARY} -d did not return within {timeout:g} s"
    except OSError as e:
        return f"{CONTROL_BINARY} -d could not run ({e.strerror or e})"
    if done.returncode != 0:
        said = _first_line(done.stderr) or _first_line(done.stdout)
        return f"{CONTROL_BINARY} -d exited with code {done.returncode}" + (f": {said}" if said else "")
    return None


def _stop_daemon(binary: str, env: dict[str, str], pipe_dir: Path, timeout: float) -> None:
    """`echo quit | nvidia-cuda-mps-control`, then wait up to `timeout` s for our daemon to go; a daemon
    still there (its clients hang on) is sent SIGTERM, since its folder is about to be removed."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run([binary], input=b"quit\n", env=env, capture_output=True, timeout=timeout)
    deadline = time.monotonic() + timeout
    while (left := mps_daemon_pids(pipe_dir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set `values` in os.environ for the duration, then put back what was there (or nothing)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def managed_mps(wanted: bool, *, daemon_running: Callable[[], bool] = mps_daemon_running,
                timeout: float = 10.0) -> Iterator[MpsStatus]:
    """Run the body under an MPS control daemon of our own when `wanted`, the control binary is on PATH
    and nobody else runs MPS here (`daemon_running`; CUDA_MPS_PIPE_DIRECTORY set means the user does);
    yield an `MpsStatus` saying what happened. The daemon is stopped, the environment restored and its
    folder removed when the body ends, however it ends. Never raises for MPS's sake."""
    if not wanted:
        yield MpsStatus(OFF, "not wanted for this search")
        return
    if (elsewhere := _someone_elses_mps(daemon_running)) is not None:
        yield MpsStatus(ALREADY_RUNNING, elsewhere)
        return
    binary = control_binary()
    if binary is None:
        yield MpsStatus(UNAVAILABLE, f"{CONTROL_BINARY} is not on PATH: the workers' kernels take turns on each GPU")
        return
    folder = Path(tempfile.mkdtemp(prefix="headsearch-mps-"))
    pipe_dir, log_dir = folder / "pipe", folder / "log"
    pipe_dir.mkdir()
    log_dir.mkdir()
    ours = {PIPE_VAR: str(pipe_dir), LOG_VAR: str(log_dir)}
    env = {**os.environ, **ours}
    try:
        if (failure := _start_daemon(binary, env, timeout)) is not None:
            if mps_daemon_pids(pipe_dir):  # it came up after all (say, after a timeout): stop it
                _stop_daemon(binary, env, pipe_dir, timeout)
            yield MpsStatus(FAILED, f"{failure}; the workers' kernels take turns on each GPU")
            return
        try:
            with _environment(ours):  # what the workers started in the body inherit
                yield MpsStatus(STARTED, f"a daemon of this search's own ({pipe_dir})", pipe_dir)
        finally:
            _stop_daemon(binary, env, pipe_dir, timeout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
