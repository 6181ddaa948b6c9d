"""headsearch starts NVIDIA MPS for a search and stops it (headsearch.machine.mps), tested on the CPU with a
fake `nvidia-cuda-mps-control` first on PATH. The fake records each call (its arguments, the two MPS
variables and what came on stdin); `-d` leaves a background "daemon" (a sleep whose argv[0] is the
control binary's name, as the real daemon's is) with a pid file in the pipe folder, and `quit` on stdin
ends it, as the real control client does.

Other people's MPS daemons (or other test runs' fakes) may run on this machine, so the tests hand
`managed_mps` a `find_mps` that sees only this test's daemons: those whose environment carries its marker.
No test has a GPU: `managed_mps` gets a probe that passes (or fails) instead of a CUDA client. How /proc is
read (pipe directories, owners of headsearch's daemons) is tested on a fake /proc tree.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from headsearch.machine.mps import (
    DEFAULT,
    LOG_VAR,
    ORPHAN,
    OWNER_FILE,
    PIPE_VAR,
    PRIVATE,
    UNKNOWN,
    MpsProcess,
    MpsStatus,
    _write_owner,
    classify,
    cuda_client_probe,
    headsearch_folder,
    managed_mps,
    mps_available,
    mps_daemon_pids,
    mps_daemon_running,
    mps_processes,
    owner_gone,
    shares_a_gpu,
)

MARKER = "HEADSEARCH_FAKE_MPS_TEST"

FAKE_CONTROL = r"""#!{python}
import json, os, signal, subprocess, sys, time
from pathlib import Path

call = {{"argv": sys.argv[1:], "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
        "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY")}}
if "CUDA_VISIBLE_DEVICES" in os.environ:  # the daemon must see every GPU: recorded only when wrongly set
    call["visible"] = os.environ["CUDA_VISIBLE_DEVICES"]
mode = {mode!r}
if sys.argv[1:] == ["-d"]:
    if mode == "fail":
        print("fake: cannot start the daemon", file=sys.stderr)
        sys.exit(1)
    if mode == "hang":
        time.sleep(60)
    daemon = subprocess.Popen(["nvidia-cuda-mps-control", "300"], executable={sleep!r}, start_new_session=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (Path(call["pipe"]) / "fake-daemon.pid").write_text(str(daemon.pid))
else:  # a client: `echo quit | nvidia-cuda-mps-control`
    call["stdin"] = sys.stdin.read()
    if call["stdin"].strip() == "quit" and mode != "stubborn":
        os.kill(int((Path(call["pipe"]) / "fake-daemon.pid").read_text()), signal.SIGTERM)
with open({record!r}, "a") as f:
    f.write(json.dumps(call) + "\n")
"""


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    """Put a fake control binary first on PATH (mode "ok"; "fail" or "hang" on -d; "stubborn": its daemon
    ignores quit); returns the file its calls are recorded in. No MPS variable is set, the marker tags
    this test's daemons, and the daemon's folder goes under tmp_path/tmp."""
    record = tmp_path / "calls.jsonl"

    def install(mode: str = "ok") -> Path:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        fake = bin_dir / "nvidia-cuda-mps-control"
        fake.write_text(FAKE_CONTROL.format(python=sys.executable, mode=mode, sleep=shutil.which("sleep"), record=str(record)))
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        return record

    monkeypatch.delenv(PIPE_VAR, raising=False)
    monkeypatch.delenv(LOG_VAR, raising=False)
    monkeypatch.setenv(MARKER, str(tmp_path))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the daemon's folder goes
    yield install
    for pid in this_tests_daemons(tmp_path):  # a failed test's fake daemon does not outlive it
        os.kill(pid, signal.SIGKILL)


def leftovers(tmp_path: Path) -> list[Path]:
    """What the MPS contexts of a test left in the temporary folder (nothing, once they ended)."""
    return list((tmp_path / "tmp").iterdir())


def calls(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def this_tests_daemons(tmp_path: Path) -> list[int]:
    """The MPS daemons started under this test (their environment carries the marker)."""
    tag = f"{MARKER}={tmp_path}".encode()
    found = []
    for pid in mps_daemon_pids():
        try:
            if tag in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:
            pass
    return found


@pytest.fixture
def only_this_test(tmp_path):
    """A `find_mps` for `managed_mps` that sees only the MPS processes of this test."""
    return lambda: [p for p in mps_processes() if p.pid in this_tests_daemons(tmp_path)]


def passes(env: dict[str, str]) -> None:
    """A client probe that got through (no GPU here to run the real one)."""
    return None


def start_fake_daemon(pipe_dir: str | Path | None) -> subprocess.Popen:
    """A daemon not started by `managed_mps` (someone else's, or a killed search's): a sleep named as the
    control binary, with `pipe_dir` as its CUDA_MPS_PIPE_DIRECTORY (None: unset), that the fake control
    binary's `quit` ends (its pid file in the pipe folder) when that folder exists."""
    env = {k: v for k, v in os.environ.items() if k != PIPE_VAR}
    if pipe_dir is not None:
        env[PIPE_VAR] = str(pipe_dir)
    daemon = subprocess.Popen(["nvidia-cuda-mps-control", "300"], executable=shutil.which("sleep"), env=env)
    if pipe_dir is not None and Path(pipe_dir).is_dir():
        (Path(pipe_dir) / "fake-daemon.pid").write_text(str(daemon.pid))
    return daemon


def stop(daemon: subprocess.Popen) -> None:
    daemon.kill()
    daemon.wait()


def a_killed_searchs_folder(owner: str | None) -> Path:
    """The folder a search left behind when it was killed: made as `managed_mps` makes it, its owner file
    holding `owner` (None: no owner file)."""
    folder = Path(tempfile.mkdtemp(prefix="headsearch-mps-"))
    (folder / "pipe").mkdir()
    (folder / "log").mkdir()
    if owner is not None:
        (folder / OWNER_FILE).write_text(owner)
    return folder


def a_dead_pid() -> int:
    ended = subprocess.Popen(["true"])
    ended.wait()
    return ended.pid


@pytest.mark.processes
def test_a_search_starts_its_daemon_and_stops_it_after(fake_mps, only_this_test, tmp_path, monkeypatch):
    record = fake_mps()
    with managed_mps(True, find_mps=only_this_test, probe=passes) as status:
        assert status.state == "started" and status.active
        pipe, log = os.environ[PIPE_VAR], os.environ[LOG_VAR]
        assert pipe == str(status.pipe_dir) and Path(pipe).is_dir() and Path(log).is_dir()
        assert calls(record) == [{"argv": ["-d"], "pipe": pipe, "log": log}]
        daemon = this_tests_daemons(tmp_path)
        assert len(daemon) == 1 and mps_daemon_pids(status.pipe_dir) == daemon  # it is ours, found as such
        # A worker started now (spawn copies the environment) would connect to this daemon.
        seen = subprocess.run([sys.executable, "-c", f"import os; print(os.environ['{PIPE_VAR}'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        assert seen == pipe
    assert calls(record)[1:] == [{"argv": [], "pipe": pipe, "log": log, "stdin": "quit\n"}]
    assert not this_tests_daemons(tmp_path)  # it waited for the daemon to go
    assert PIPE_VAR not in os.environ and LOG_VAR not in os.environ
    assert Path(pipe).is_relative_to(tmp_path / "tmp") and not leftovers(tmp_path)


@pytest.mark.processes
def test_the_environment_is_restored_as_it_was(fake_mps, only_this_test, monkeypatch):
    fake_mps()
    monkeypatch.setenv(LOG_VAR, "/var/log/nvidia-mps")  # set, but not the pipe: nobody runs MPS yet
    with managed_mps(True, find_mps=only_this_test, probe=passes) as status:
        assert status.state == "started" and os.environ[LOG_VAR] != "/var/log/nvidia-mps"
    assert os.environ[LOG_VAR] == "/var/log/nvidia-mps" and PIPE_VAR not in os.environ


@pytest.mark.processes
def test_the_daemon_is_stopped_when_the_search_fails(fake_mps, only_this_test, tmp_path):
    record = fake_mps()
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C, or any error in the search
        with managed_mps(True, find_mps=only_this_test, probe=passes) as status:
            assert status.state == "started" and this_tests_daemons(tmp_path)
            raise KeyboardInterrupt
    assert [c["argv"] for c in calls(record)] == [["-d"], []] and calls(record)[1]["stdin"] == "quit\n"
    assert not this_tests_daemons(tmp_path) and not leftovers(tmp_path)
    assert PIPE_VAR not in os.environ


@pytest.mark.processes
def test_a_daemon_that_ignores_quit_is_terminated(fake_mps, only_this_test, tmp_path):
    record = fake_mps("stubborn")
    with managed_mps(True, find_mps=only_this_test, probe=passes, timeout=0.5) as status:
        assert status.state == "started"
    assert [c["argv"] for c in calls(record)] == [["-d"], []]  # asked to quit first
    wait_until(lambda: not this_tests_daemons(tmp_path), "the daemon ends after SIGTERM")
    assert not leftovers(tmp_path)


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


@pytest.mark.processes
@pytest.mark.parametrize("their_pipe", [None, "/tmp/nvidia-mps/"])  # unset, or the default named
def test_someone_elses_daemon_on_the_default_pipe_directory_is_used_as_it_is(fake_mps, only_this_test, tmp_path,
                                                                             their_pipe):
    record = fake_mps()
    outside = start_fake_daemon(their_pipe)
    try:
        assert outside.pid in mps_daemon_pids() and mps_daemon_running()  # found by its name in /proc
        with managed_mps(True, find_mps=only_this_test, probe=passes) as status:
            assert status.state == "already running" and status.active and status.pipe_dir is None
            assert f"pid {outside.pid}, the default pipe directory" in status.reason
            assert PIPE_VAR not in os.environ
        assert calls(record) == []  # nothing started, nothing stopped
        assert outside.poll() is None
    finally:
        outside.kill()
        outside.wait()


def test_a_pipe_directory_in_the_environment_means_the_user_runs_mps(fake_mps, only_this_test, monkeypatch):
    record = fake_mps()
    monkeypatch.setenv(PIPE_VAR, "/tmp/their-mps")
    with managed_mps(True, find_mps=only_this_test, probe=passes) as status:
        assert status.state == "already running" and PIPE_VAR in status.reason
        assert os.environ[PIPE_VAR] == "/tmp/their-mps"
    assert calls(record) == [] and os.environ[PIPE_VAR] == "/tmp/their-mps"


def test_without_the_control_binary_mps_is_unavailable(fake_mps, only_this_test, tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert not mps_available()
    with managed_mps(True, find_mps=only_this_test, probe=passes) as status:
        assert status.state == "unavailable" and "not on PATH" in status.reason and not status.active
        assert PIPE_VAR not in os.environ


def test_not_wanted_means_off(fake_mps, only_this_test):
    record = fake_mps()
    with managed_mps(False, find_mps=only_this_test, probe=passes) as status:
        assert status == MpsStatus("off", "not wanted for this search")
    assert calls(record) == []


@pytest.mark.processes
@pytest.mark.parametrize("mode, said", [("fail", "exited with code 1: fake: cannot start the daemon"),
                                        ("hang", "did not return within 0.5 s")])
def test_a_daemon_that_will_not_start_is_reported_and_the_search_goes_on(fake_mps, only_this_test, tmp_path, mode, said):
    fake_mps(mode)
    probed = []
    with managed_mps(True, find_mps=only_this_test, probe=probed.append, timeout=0.5) as status:
        assert status.state == "failed" and said in status.reason and not status.active
        assert probed == []  # no daemon, nothing to probe
        assert PIPE_VAR not in os.environ and LOG_VAR not in os.environ  # no worker looks for it
    assert not this_tests_daemons(tmp_path) and not leftovers(tmp_path)


def test_mps_is_wanted_when_two_workers_share_a_gpu():
    assert shares_a_gpu(["0", "1", "0", "1"])
    assert not shares_a_gpu(["0", "1"])
    assert not shares_a_gpu([None, None, None])  # CPU workers: no GPU to share


@pytest.mark.processes
def test_the_daemon_sees_every_gpu_and_the_workers_keep_their_names(fake_mps, only_this_test, tmp_path, monkeypatch):
    record = fake_mps()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # `CUDA_VISIBLE_DEVICES=2,3 headsearch run`: workers get "2", "3"
    probed = []
    with managed_mps(True, find_mps=only_this_test, probe=lambda env: probed.append(env)) as status:
        assert status.state == "started"
        assert "visible" not in calls(record)[0]  # the fake control binary ran without CUDA_VISIBLE_DEVICES
        daemon, = this_tests_daemons(tmp_path)
        assert not any(entry.startswith(b"CUDA_VISIBLE_DEVICES=")
                       for entry in Path(f"/proc/{daemon}/environ").read_bytes().split(b"\0"))
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"  # what the workers' pins are named in
        # The probe ran in the workers' environment: the parent's GPU names and this daemon.
        (env,) = probed
        assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env[PIPE_VAR] == os.environ[PIPE_VAR] == str(status.pipe_dir)
        assert env[LOG_VAR] == os.environ[LOG_VAR]
    assert [c["argv"] for c in calls(record)] == [["-d"], []] and "visible" not in calls(record)[1]  # quit too
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


@pytest.mark.processes
@pytest.mark.parametrize("probe, said", [
    (lambda env: "RuntimeError: all CUDA-capable devices are busy or unavailable\nmore lines",
     "RuntimeError: all CUDA-capable devices are busy or unavailable; the workers' kernels take turns on each GPU"),
    (lambda env: 1 / 0, "the client probe raised ZeroDivisionError: division by zero; the workers' kernels take turns"),
])
def test_a_daemon_no_client_gets_through_is_stopped_before_the_search(fake_mps, only_this_test, tmp_path, probe, said):
    record = fake_mps()
    with managed_mps(True, find_mps=only_this_test, probe=probe) as status:
        assert status.state == "failed" and not status.active and status.reason.startswith(said)
        assert "more lines" not in status.reason
        # Undone before the search starts: stopped, the environment as it was, the folder gone.
        assert [c["argv"] for c in calls(record)] == [["-d"], []] and calls(record)[1]["stdin"] == "quit\n"
        assert not this_tests_daemons(tmp_path)
        assert PIPE_VAR not in os.environ and LOG_VAR not in os.environ
        assert not leftovers(tmp_path)
    assert len(calls(record)) == 2 and not leftovers(tmp_path)


@pytest.mark.processes
def test_the_default_probe_says_why_a_client_fails():
    # No GPU is visible with CUDA_VISIBLE_DEVICES=-1, on any machine: the client's first CUDA call fails.
    said = cuda_client_probe({**os.environ, "CUDA_VISIBLE_DEVICES": "-1"})
    assert said is not None and said.startswith("a CUDA client failed under the daemon (exit code 1): ")
    assert "Error" in said and "\n" not in said
    assert cuda_client_probe(dict(os.environ), timeout=0.001) == \
        "a CUDA client did not get through the daemon within 0.001 s"


@pytest.mark.processes
@pytest.mark.parametrize("owner", ["missing", "dead", "pid reused"])
def test_an_orphan_of_a_killed_search_is_stopped_and_our_daemon_started(fake_mps, only_this_test, tmp_path, owner):
    record = fake_mps()
    text = {"missing": None, "dead": f"{a_dead_pid()} 12345\n",
            "pid reused": f"{os.getpid()} 1\n"}[owner]  # this process, but it started later than that owner
    folder = a_killed_searchs_folder(text)
    orphan = start_fake_daemon(folder / "pipe")
    try:
        with managed_mps(True, find_mps=only_this_test, probe=passes) as status:
            assert status.state == "started" and status.pipe_dir != folder / "pipe"
            assert status.reason.endswith(f"; stopped an orphaned daemon of a killed search (pid {orphan.pid})")
            assert calls(record)[0] == {"argv": [], "pipe": str(folder / "pipe"), "log": None, "stdin": "quit\n"}
            assert calls(record)[1]["argv"] == ["-d"]
            assert orphan.wait(timeout=10) is not None and not folder.exists()
            assert this_tests_daemons(tmp_path) == mps_daemon_pids(status.pipe_dir)  # ours alone
        assert not leftovers(tmp_path)
    finally:
        stop(orphan)


@pytest.mark.processes
def test_another_running_searchs_daemon_is_left_alone(fake_mps, only_this_test, tmp_path):
    record = fake_mps()
    folder = a_killed_searchs_folder(None)
    _write_owner(folder)  # its owner (this process, here) is alive: a search that runs
    theirs = start_fake_daemon(folder / "pipe")
    try:
        with managed_mps(True, find_mps=only_this_test, probe=passes) as status:
            assert status.state == "in use elsewhere" and not status.active and status.pipe_dir is None
            assert f"another running search is here (pipe directory {folder / 'pipe'}, pid {theirs.pid})" in status.reason
            assert status.reason.endswith("the workers run without MPS")
            assert PIPE_VAR not in os.environ
        assert calls(record) == [] and theirs.poll() is None and folder.is_dir()  # no second daemon; theirs untouched
    finally:
        stop(theirs)


@pytest.mark.processes
def test_a_daemon_on_another_pipe_directory_is_not_taken_for_ours(fake_mps, only_this_test, tmp_path):
    record = fake_mps()
    their_pipe = tmp_path / "their-mps"
    theirs = start_fake_daemon(their_pipe)
    try:
        with managed_mps(True, find_mps=only_this_test, probe=passes) as status:
            assert status.state == "in use elsewhere" and not status.active
            assert f"runs here with pipe directory {their_pipe}" in status.reason
            assert status.reason.endswith(f"the workers run without MPS (set {PIPE_VAR}={their_pipe} to use it)")
            assert PIPE_VAR not in os.environ
        assert calls(record) == [] and theirs.poll() is None
    finally:
        stop(theirs)


def fake_process(proc: Path, pid: int, argv0: str, env: dict[str, str] | None, state: str = "S",
                 start: int = 1000) -> None:
    """/proc/PID of a fake /proc tree: stat (its state and start time, field 22), cmdline and environ
    (None: unreadable, as another user's is)."""
    d = proc / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_text(f"{pid} ({os.path.basename(argv0)[:15]}) {state} " + " ".join(["0"] * 18) + f" {start} 0 0\n")
    (d / "cmdline").write_bytes(argv0.encode() + b"\0-d\0")
    if env is not None:
        (d / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in env.items()))


def test_mps_processes_are_read_from_proc_with_their_pipe_directories(tmp_path):
    proc = tmp_path / "proc"
    fake_process(proc, 100, "nvidia-cuda-mps-control", {"HOME": "/root", PIPE_VAR: "/x/headsearch-mps-a/pipe"})
    fake_process(proc, 101, "/usr/bin/nvidia-cuda-mps-server", {"HOME": "/root"})  # the default directory
    fake_process(proc, 102, "nvidia-cuda-mps-control", None)  # another user's: no environment to read
    fake_process(proc, 103, "nvidia-cuda-mps-control", {}, state="Z")  # ended, not reaped
    fake_process(proc, 104, "python", {PIPE_VAR: "/x/headsearch-mps-a/pipe"})
    fake_process(proc, 105, "nvidia-cuda-mps-control", {PIPE_VAR: ""})  # empty: the default
    (proc / "self").mkdir()
    assert mps_processes(proc) == [MpsProcess(100, "/x/headsearch-mps-a/pipe"), MpsProcess(101, None),
                                   MpsProcess(102, None, readable=False), MpsProcess(105, None)]
    assert mps_daemon_pids(Path("/x/headsearch-mps-a/pipe"), proc) == [100]
    assert mps_daemon_pids(proc_root=proc) == [100, 101, 102, 105]


def test_an_orphan_is_a_headsearch_daemon_whose_search_is_gone(tmp_path):
    proc = tmp_path / "proc"
    fake_process(proc, 200, "python", {}, start=777)  # a search that runs
    fake_process(proc, 201, "python", {}, state="Z", start=777)  # one that ended
    tmp = tmp_path / "tmp"

    def daemon_of(name: str, owner: str | None) -> MpsProcess:
        folder = tmp / f"headsearch-mps-{name}"
        (folder / "pipe").mkdir(parents=True)
        if owner is not None:
            (folder / OWNER_FILE).write_text(owner)
        return MpsProcess(1, str(folder / "pipe"))

    assert classify(daemon_of("a", None), proc) == ORPHAN  # no owner file
    assert classify(daemon_of("b", "999 777\n"), proc) == ORPHAN  # no such process
    assert classify(daemon_of("c", "201 777\n"), proc) == ORPHAN  # a zombie
    assert classify(daemon_of("d", "200 778\n"), proc) == ORPHAN  # its PID given to a later process
    assert classify(daemon_of("e", "garbage"), proc) == ORPHAN
    assert classify(daemon_of("f", "200 777\n"), proc) == PRIVATE  # its search runs
    assert classify(daemon_of("g", "200\n"), proc) == PRIVATE
    unreadable = daemon_of("h", None)
    (Path(unreadable.pipe_dir).parent / OWNER_FILE).mkdir()  # there, but not to be read: counted alive
    assert classify(unreadable, proc) == PRIVATE
    gone = MpsProcess(1, str(tmp / "headsearch-mps-gone" / "pipe"))  # its folder removed under it
    assert classify(gone, proc) == ORPHAN
    assert classify(MpsProcess(1, "/srv/mps"), proc) == PRIVATE  # not headsearch's: never an orphan
    assert classify(MpsProcess(1, str(tmp / "pipe")), proc) == PRIVATE
    assert classify(MpsProcess(1, None), proc) == classify(MpsProcess(1, "/tmp/nvidia-mps"), proc) == DEFAULT
    assert classify(MpsProcess(1, None, readable=False), proc) == UNKNOWN
    assert headsearch_folder("/tmp/headsearch-mps-x1/pipe") == Path("/tmp/headsearch-mps-x1")
    assert headsearch_folder("headsearch-mps-x1/pipe") is None and headsearch_folder("/tmp/headsearch-mps-x1") is None
    # The owner file managed_mps writes names this process, alive, by its real /proc.
    mine = tmp / "headsearch-mps-mine"
    mine.mkdir()
    _write_owner(mine)
    assert (mine / OWNER_FILE).read_text().split()[0] == str(os.getpid()) and not owner_gone(mine)
