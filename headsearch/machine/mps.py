"""NVIDIA MPS for a search that runs several processes per GPU: started and stopped by headsearch.

Without the Multi-Process Service, the kernels of different processes on one GPU take turns (time
slicing): a small model's kernels leave most of the GPU idle, and K of them side by side gain little.
MPS funnels the processes' work through one server so their kernels run concurrently (on an H100,
8 concurrent training processes reach 175,000 samples/s with MPS against 158,000 without).

`managed_mps(wanted)` starts a private MPS control daemon (`nvidia-cuda-mps-control -d`) for the
length of a search when it is wanted (several processes share a GPU, `shares_a_gpu`), the control
binary is installed and no MPS the workers could use, or that is another's, runs here; and it stops it
when the search ends, on Ctrl-C or an exception too. Anything else leaves the search as it was: MPS is a
speed-up, never a requirement, so every failure is reported as a status ("failed") and the search runs
without it; no MPS error ever raises.

The daemon's pipe and log folders are a fresh temporary folder (`headsearch-mps-*`), named to the daemon
and to the processes through CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY. Both are set in
`os.environ` while the context is open, so the worker processes started inside it (multiprocessing spawn
copies the environment) connect to this daemon when they initialise CUDA. Hence:

- start the workers inside the context, and
- the parent must not have created a CUDA context it keeps using: a process connects to MPS (or
  not) when it initialises CUDA, so a context the parent made before the daemon started stays
  outside MPS, time-slicing against the workers, and one made inside it keeps the daemon from quitting
  until the parent lets it go.

The daemon runs without CUDA_VISIBLE_DEVICES, so that it sees every GPU and a worker's GPU name (the
parent's own name for it, "2" of CUDA_VISIBLE_DEVICES "2,3") means the same GPU under MPS as outside it;
the MPS server renumbers the devices its daemon sees. Before the workers start, a short client process
(`cuda_client_probe`: import torch, compute on one tensor on the GPU) checks that a client gets through
the daemon; if it does not, the daemon is stopped and the search runs without MPS.

Other MPS processes found here (`mps_processes`, from /proc) decide what happens first (`classify`):

- a daemon on the default pipe directory (/tmp/nvidia-mps: no CUDA_MPS_PIPE_DIRECTORY) is what the
  workers connect to untold: "already running", used as it is; likewise one whose environment cannot be
  read (another user's), which most likely is the machine's own on the default directory;
- a daemon headsearch started for a search that is gone (its folder's `owner.pid` missing, or naming no
  live process: the search was killed with SIGKILL, which cannot stop its daemon) is an orphan: stopped
  (`echo quit | nvidia-cuda-mps-control` with its pipe directory, then SIGTERM), its folder removed, and
  our own daemon started;
- a daemon on another pipe directory (another running search's, or anyone's) is one the workers would
  not find: "in use elsewhere", and the search runs without MPS (no second daemon is started).

CUDA_MPS_PIPE_DIRECTORY set by the user means the MPS named there, used as it is.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
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
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"  # where clients look for a daemon when CUDA_MPS_PIPE_DIRECTORY is unset
FOLDER_PREFIX = "headsearch-mps-"  # the temporary folder of a daemon headsearch started
OWNER_FILE = "owner.pid"  # in that folder: "PID START" of the search process that started it
PROC = Path("/proc")
PROBE_TIMEOUT = 60.0  # seconds for the client probe: importing torch and making a CUDA context included
TAKE_TURNS = "the workers' kernels take turns on each GPU"  # what running without MPS means

STARTED, ALREADY_RUNNING, UNAVAILABLE, OFF, FAILED = "started", "already running", "unavailable", "off", "failed"
ELSEWHERE = "in use elsewhere"
# What an MPS process found here is to a search (`classify`).
ORPHAN, DEFAULT, UNKNOWN, PRIVATE = "orphan", "default", "unknown", "private"


@dataclass(frozen=True)
class MpsStatus:
    """What `managed_mps` did: `state` is one of "started", "already running" (an MPS the workers connect
    to is in use), "in use elsewhere" (an MPS daemon the workers would not find runs here: they run
    without MPS), "unavailable" (no control binary), "off" (not wanted), "failed" (it would not start, or
    no client got through it; the search goes on without it); `reason` says why in a few words;
    `pipe_dir` is the private folder of a daemon this process started."""

    state: str
    reason: str
    pipe_dir: Path | None = None

    @property
    def active(self) -> bool:
        """Whether the workers will run under MPS (ours or another one)."""
        return self.state in (STARTED, ALREADY_RUNNING)

    def describe(self) -> str:
        return f"MPS {self.state}: {self.reason}"


@dataclass(frozen=True)
class MpsProcess:
    """A live MPS control daemon or server found in /proc: its `pid` and the CUDA_MPS_PIPE_DIRECTORY of its
    environment (None when unset, i.e. the default /tmp/nvidia-mps). `readable` is False when its
    environment could not be read (another user's process, to anyone but root): its directory is unknown."""

    pid: int
    pipe_dir: str | None
    readable: bool = True


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


def _stat_fields(proc: Path) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses):
    [state, ppid, ...], so field N of proc(5) is at N - 3; None when the process is gone."""
    stat = _read(proc / "stat")
    return None if stat is None else stat.rpartition(b")")[2].split()


def _alive(proc: Path) -> bool:
    """Whether /proc/PID `proc` is a running process: not gone, nor a zombie (ended, only not yet reaped)."""
    fields = _stat_fields(proc)
    return bool(fields) and fields[0] != b"Z"


def _start_time(proc: Path) -> str | None:
    """When the process started (clock ticks after boot, stat field 22): with its PID, what tells it from
    a later process that was given the same PID."""
    fields = _stat_fields(proc)
    return fields[19].decode() if fields is not None and len(fields) > 19 else None


def _is_mps_process(proc: Path) -> bool:
    """Whether /proc/PID `proc` is a live MPS control daemon or server, by the name it was started under
    (argv[0]), else by its kernel name when its command line cannot be read."""
    if not _alive(proc):
        return False
    cmdline = _read(proc / "cmdline")
    if cmdline:
        argv0 = os.path.basename(cmdline.split(b"\0", 1)[0].decode(errors="replace"))
        return argv0 in (CONTROL_BINARY, SERVER_BINARY)
    comm = _read(proc / "comm")
    return comm is not None and comm.strip().decode(errors="replace") == TRUNCATED_NAME


def _environ(proc: Path) -> dict[str, str] | None:
    """The environment /proc/PID `proc` was started with, or None when it cannot be read."""
    raw = _read(proc / "environ")
    if raw is None:
        return None
    pairs = (entry.partition(b"=") for entry in raw.split(b"\0"))
    return {os.fsdecode(name): os.fsdecode(value) for name, eq, value in pairs if eq}


def mps_processes(proc_root: Path = PROC) -> list[MpsProcess]:
    """The MPS control daemons and servers running on this machine, as far as /proc (`proc_root`) shows
    them, each with the pipe directory of its environment, by PID."""
    found = []
    for entry in proc_root.iterdir() if proc_root.is_dir() else ():
        if not entry.name.isdigit() or not _is_mps_process(entry):
            continue
        env = _environ(entry)
        if env is None and not _alive(entry):
            continue  # it ended while we looked, not an environment we may not read
        found.append(MpsProcess(int(entry.name), (env or {}).get(PIPE_VAR) or None, env is not None))
    return sorted(found, key=lambda p: p.pid)


def mps_daemon_pids(pipe_dir: Path | None = None, proc_root: Path = PROC) -> list[int]:
    """The MPS control daemons and servers running on this machine (as far as /proc shows them), or with
    `pipe_dir` only those whose environment names it as their CUDA_MPS_PIPE_DIRECTORY (ours)."""
    return [p.pid for p in mps_processes(proc_root)
            if pipe_dir is None or (p.readable and p.pipe_dir == str(pipe_dir))]


def mps_daemon_running() -> bool:
    """Whether an MPS control daemon (or server) already runs on this machine, anyone's."""
    return bool(mps_daemon_pids())


def headsearch_folder(pipe_dir: str | None) -> Path | None:
    """The temporary folder of a daemon headsearch started, from the daemon's pipe directory
    (`<tmp>/headsearch-mps-*/pipe`); None for any other pipe directory."""
    path = Path(pipe_dir or ".")  # none: not absolute
    ours = path.is_absolute() and path.name == "pipe" and path.parent.name.startswith(FOLDER_PREFIX)
    return path.parent if ours else None


def _write_owner(folder: Path, proc_root: Path = PROC) -> None:
    """Name this process as the owner of the daemon about to start in `folder`: "PID START". A later
    search that finds the daemon and no live owner knows it for an orphan. Written before the daemon
    starts, so that no daemon of ours is ever seen without it."""
    start = _start_time(proc_root / str(os.getpid()))
    (folder / OWNER_FILE).write_text(f"{os.getpid()} {start}\n" if start else f"{os.getpid()}\n")


def owner_gone(folder: Path, proc_root: Path = PROC) -> bool:
    """Whether the search that started the daemon of `folder` has ended: the folder's owner.pid is missing
    (the folder too, or a daemon of a headsearch before owner files), names no live process, or one that
    started at another time (its PID reused since). An owner file that exists but cannot be read counts as
    alive: a daemon is stopped only when its search is surely gone."""
    try:
        fields = (folder / OWNER_FILE).read_text().split()
    except FileNotFoundError:
        return True
    except (OSError, UnicodeDecodeError):
        return False
    if not fields or not fields[0].isdigit():
        return True  # names no process: written only before a daemon starts, so never seen half-written
    proc = proc_root / fields[0]
    if not _alive(proc):
        return True
    return len(fields) > 1 and _start_time(proc) != fields[1]


def classify(process: MpsProcess, proc_root: Path = PROC) -> str:
    """What an MPS process found here is to a search: ORPHAN, a daemon headsearch started for a search
    that is gone (killed: a search that ends otherwise stops its own); DEFAULT, one on the default pipe
    directory, which the workers connect to untold; UNKNOWN, one whose environment cannot be read; PRIVATE,
    one on another pipe directory (another running search's, or anyone's), which the workers would not
    find."""
    if not process.readable:
        return UNKNOWN
    if process.pipe_dir is None or os.path.normpath(process.pipe_dir) == DEFAULT_PIPE_DIR:
        return DEFAULT
    folder = headsearch_folder(process.pipe_dir)
    return ORPHAN if folder is not None and owner_gone(folder, proc_root) else PRIVATE


def _pids(pids: Sequence[int]) -> str:
    return f"pid{'s' * (len(pids) > 1)} {', '.join(map(str, pids))}"


def _by_pipe_dir(processes: Sequence[MpsProcess]) -> dict[str, list[int]]:
    """The PIDs of each daemon (its control process and its servers share its pipe directory)."""
    groups: dict[str, list[int]] = {}
    for p in processes:
        groups.setdefault(p.pipe_dir or DEFAULT_PIPE_DIR, []).append(p.pid)
    return groups


def _someone_elses_mps(kinds: dict[str, list[MpsProcess]]) -> MpsStatus | None:
    """What the MPS processes already here (all but orphans, by `classify`) mean for the workers, or None
    when there are none: a daemon they connect to is used as it is; one they would not find is left alone,
    and they run without MPS rather than beside a second daemon."""
    if kinds[DEFAULT]:
        pids = _pids([p.pid for p in kinds[DEFAULT]])
        return MpsStatus(ALREADY_RUNNING, f"an MPS daemon already runs on this machine ({pids}, the default pipe"
                                          f" directory): the workers use it as it is")
    if kinds[UNKNOWN]:
        pids = _pids([p.pid for p in kinds[UNKNOWN]])
        return MpsStatus(ALREADY_RUNNING, f"an MPS daemon of another user runs on this machine ({pids}; its pipe"
                                          f" directory cannot be read): the workers use it if it serves the default"
                                          f" {DEFAULT_PIPE_DIR}")
    if kinds[PRIVATE]:
        pipe_dir, pids = next(iter(_by_pipe_dir(kinds[PRIVATE]).items()))
        if headsearch_folder(pipe_dir) is not None:  # it stops when that search ends, under our workers too
            return MpsStatus(ELSEWHERE, f"an MPS daemon of another running search is here (pipe directory"
                                        f" {pipe_dir}, {_pids(pids)}): the workers run without MPS")
        return MpsStatus(ELSEWHERE, f"an MPS daemon of another user or program runs here with pipe directory"
                                    f" {pipe_dir} ({_pids(pids)}): the workers run without MPS (set"
                                    f" {PIPE_VAR}={pipe_dir} to use it)")
    return None


def _line(text: str | bytes | None, index: int = 0) -> str:
    """Line `index` of what a process said (0: the first, -1: the last), "" when it said nothing."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = (text or "").strip().splitlines()
    return lines[index] if lines else ""


def _daemon_env(values: dict[str, str]) -> dict[str, str]:
    """The environment to start, ask and stop an MPS control daemon with: this process's, `values` set,
    CUDA_VISIBLE_DEVICES removed. The daemon's CUDA_VISIBLE_DEVICES decides which GPUs its server sees,
    and the server renumbers them: a client's device IDs count within that set (NVIDIA's MPS guide). The
    workers are pinned by this process's own name for their GPU (CUDA_VISIBLE_DEVICES "2,3" gives them
    "2" and "3"), so a daemon that kept "2,3" would leave worker "2" asking a two-GPU server for a third
    GPU. Seeing every GPU, the server numbers them as the machine does, and the names mean what they do
    outside MPS."""
    env = {name: value for name, value in os.environ.items() if name != "CUDA_VISIBLE_DEVICES"}
    return {**env, **values}


def _start_daemon(binary: str, env: dict[str, str], timeout: float) -> str | None:
    """Run `nvidia-cuda-mps-control -d` (it forks the daemon and returns); None on success, else why not."""
    try:
        done = subprocess.run([binary, "-d"], env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{CONTROL_BINARY} -d did not return within {timeout:g} s"
    except OSError as e:
        return f"{CONTROL_BINARY} -d could not run ({e.strerror or e})"
    if done.returncode != 0:
        said = _line(done.stderr) or _line(done.stdout)
        return f"{CONTROL_BINARY} -d exited with code {done.returncode}" + (f": {said}" if said else "")
    return None


def _stop_daemon(binary: str | None, env: dict[str, str], pipe_dir: Path, timeout: float) -> None:
    """`echo quit | nvidia-cuda-mps-control` (its pipe directory in `env`), then wait up to `timeout` s
    for the daemon to go; what is still there (its clients hang on) is sent SIGTERM, since its folder is
    about to be removed. Without the control binary, SIGTERM at once."""
    if binary is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([binary], input=b"quit\n", env=env, capture_output=True, timeout=timeout)
        deadline = time.monotonic() + timeout
        while mps_daemon_pids(pipe_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
    for pid in mps_daemon_pids(pipe_dir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)


def _stop_orphans(binary: str | None, orphans: Sequence[MpsProcess], timeout: float) -> str:
    """Stop the daemons of killed searches and remove their folders: they hold GPU memory and a server
    nobody will ask to quit. Clients still attached (workers that outlived their search) lose it; they
    belong to a search that is gone. Returns what was done, for the status, or "" when nothing was."""
    groups = _by_pipe_dir(orphans)
    for pipe_dir in groups:
        _stop_daemon(binary, _daemon_env({PIPE_VAR: pipe_dir}), Path(pipe_dir), timeout)
        folder = headsearch_folder(pipe_dir)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    if not groups:
        return ""
    pids = sorted(pid for group in groups.values() for pid in group)
    what = "an orphaned daemon of a killed search" if len(groups) == 1 else \
        f"{len(groups)} orphaned daemons of killed searches"
    return f"; stopped {what} ({_pids(pids)})"


PROBE_SCRIPT = """\
import sys
try:
    import torch
    torch.ones(1, device="cuda").add_(1).item()
except Exception as e:
    print(f"{type(e).__name__}: {e}")
    sys.exit(1)
"""


def cuda_client_probe(env: dict[str, str], timeout: float = PROBE_TIMEOUT) -> str | None:
    """Whether a CUDA client gets through the daemon just started: a short Python process in `env` (the
    environment the workers will get) imports torch and computes on one tensor on the GPU. None if it
    did, else why not. A daemon can start and still serve no client (its server will not start on one of
    the GPUs it sees, say): every worker would then fail or hang in its first CUDA call, where one probe
    costs a few seconds."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE_SCRIPT], env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"a CUDA client did not get through the daemon within {timeout:g} s"
    except OSError as e:
        return f"a CUDA client could not run ({e.strerror or e})"
    if done.returncode == 0:
        return None
    # The script prints the error on stdout; stderr's last line is what a crash (or torch's import) left.
    said = _line(done.stdout) or _line(done.stderr, -1)
    return f"a CUDA client failed under the daemon (exit code {done.returncode})" + (f": {said}" if said else "")


def _probe_failure(probe: Callable[[dict[str, str]], str | None], env: dict[str, str]) -> str | None:
    """Run `probe` in `env`: None if a client got through, else the first line of why not. A probe that
    raises fails too (MPS never raises into the search)."""
    try:
        said = probe(env)
    except Exception as e:  # any error of a probe handed in: the search still runs, without MPS
        return f"the client probe raised {type(e).__name__}: {e}"
    return None if said is None else (_line(said) or "a CUDA client did not get through the daemon")


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


def _new_folder() -> Path:
    """A fresh private folder for a daemon (pipe/, log/ and the owner file), owned by this process."""
    folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
    try:
        (folder / "pipe").mkdir()
        (folder / "log").mkdir()
        _write_owner(folder)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


@contextlib.contextmanager
def _own_daemon(binary: str, probe: Callable[[dict[str, str]], str | None], timeout: float) -> Iterator[MpsStatus]:
    """Start a daemon of our own and probe it; yield "started" with its variables in os.environ, or
    "failed" with everything undone already (daemon stopped, environment as it was, folder removed)."""
    try:
        folder = _new_folder()
    except OSError as e:
        yield MpsStatus(FAILED, f"its folder could not be made ({e.strerror or e}); {TAKE_TURNS}")
        return
    pipe_dir = folder / "pipe"
    ours = {PIPE_VAR: str(pipe_dir), LOG_VAR: str(folder / "log")}
    env = _daemon_env(ours)
    started = False
    try:
        failure = _start_daemon(binary, env, timeout)
        started = failure is None
        if started:  # what the workers will inherit: this process's environment (its GPU names too) and ours
            failure = _probe_failure(probe, {**os.environ, **ours})
        if failure is None:
            with _environment(ours):  # what the workers started in the body inherit
                yield MpsStatus(STARTED, f"a daemon of this search's own ({pipe_dir})", pipe_dir)
    finally:
        if started or mps_daemon_pids(pipe_dir):  # a -d that failed may have left one (say, after a timeout)
            _stop_daemon(binary, env, pipe_dir, timeout)
        shutil.rmtree(folder, ignore_errors=True)
    if failure is not None:
        yield MpsStatus(FAILED, f"{failure}; {TAKE_TURNS}")


@contextlib.contextmanager
def managed_mps(wanted: bool, *, find_mps: Callable[[], list[MpsProcess]] = mps_processes,
                probe: Callable[[dict[str, str]], str | None] = cuda_client_probe,
                timeout: float = 10.0) -> Iterator[MpsStatus]:
    """Run the body under an MPS control daemon of our own when `wanted`, the control binary is on PATH
    and no other MPS runs here (`find_mps` lists them; orphans of killed searches are stopped first;
    CUDA_MPS_PIPE_DIRECTORY set means the user runs one), once `probe` (given the workers' environment,
    returning None or why not) saw a client get through it; yield an `MpsStatus` saying what happened.
    The daemon is stopped, the environment restored and its folder removed when the body ends, however
    it ends. Never raises for MPS's sake."""
    if not wanted:
        yield MpsStatus(OFF, "not wanted for this search")
        return
    if os.environ.get(PIPE_VAR):
        yield MpsStatus(ALREADY_RUNNING, f"{PIPE_VAR} is set ({os.environ[PIPE_VAR]}): the MPS named there is used as it is")
        return
    binary = control_binary()
    kinds: dict[str, list[MpsProcess]] = {ORPHAN: [], DEFAULT: [], UNKNOWN: [], PRIVATE: []}
    for process in find_mps():
        kinds[classify(process)].append(process)
    stopped = _stop_orphans(binary, kinds[ORPHAN], timeout)
    if (elsewhere := _someone_elses_mps(kinds)) is not None:
        yield dataclasses.replace(elsewhere, reason=elsewhere.reason + stopped)
        return
    if binary is None:
        yield MpsStatus(UNAVAILABLE, f"{CONTROL_BINARY} is not on PATH: {TAKE_TURNS}{stopped}")
        return
    with _own_daemon(binary, probe, timeout) as status:
        yield dataclasses.replace(status, reason=status.reason + stopped)
