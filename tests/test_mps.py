"""headsearch starts NVIDIA MPS for a search and stops it (headsearch.search.mps), tested on the CPU with a
fake `nvidia-cuda-mps-control` first on PATH. The fake records each call (its arguments, the two MPS
variables and what came on stdin); `-d` leaves a background "daemon" (a sleep whose argv[0] is the
control binary's name, as the real daemon's is) with a pid file in the pipe folder, and `quit` on stdin
ends it, as the real control client does.

Other people's MPS daemons (or other test runs' fakes) may run on this machine, so the tests hand
`managed_mps` a check that sees only this test's daemons: those whose environment carries its marker.
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

from headsearch.search.mps import (
    LOG_VAR,
    PIPE_VAR,
    MpsStatus,
    managed_mps,
    mps_available,
    mps_daemon_pids,
    mps_daemon_running,
    shares_a_gpu,
)

MARKER = "HEADSEARCH_FAKE_MPS_TEST"

FAKE_CONTROL = r"""#!{python}
import json, os, signal, subprocess, sys, time
from pathlib import Path

call = {{"argv": sys.argv[1:], "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
        "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY")}}
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
    return lambda: bool(this_tests_daemons(tmp_path))


def test_a_search_starts_its_daemon_and_stops_it_after(fake_mps, only_this_test, tmp_path, monkeypatch):
    record = fake_mps()
    with managed_mps(True, daemon_running=only_this_test) as status:
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


def test_the_environment_is_restored_as_it_was(fake_mps, only_this_test, monkeypatch):
    fake_mps()
    monkeypatch.setenv(LOG_VAR, "/var/log/nvidia-mps")  # set, but not the pipe: nobody runs MPS yet
    with managed_mps(True, daemon_running=only_this_test) as status:
        assert status.state == "started" and os.environ[LOG_VAR] != "/var/log/nvidia-mps"
    assert os.environ[LOG_VAR] == "/var/log/nvidia-mps" and PIPE_VAR not in os.environ


def test_the_daemon_is_stopped_when_the_search_fails(fake_mps, only_this_test, tmp_path):
    record = fake_mps()
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C, or any error in the search
        with managed_mps(True, daemon_running=only_this_test) as status:
            assert status.state == "started" and this_tests_daemons(tmp_path)
            raise KeyboardInterrupt
    assert [c["argv"] for c in calls(record)] == [["-d"], []] and calls(record)[1]["stdin"] == "quit\n"
    assert not this_tests_daemons(tmp_path) and not leftovers(tmp_path)
    assert PIPE_VAR not in os.environ


def test_a_daemon_that_ignores_quit_is_terminated(fake_mps, only_this_test, tmp_path):
    record = fake_mps("stubborn")
    with managed_mps(True, daemon_running=only_this_test, timeout=0.5) as status:
        assert status.state == "started"
    assert [c["argv"] for c in calls(record)] == [["-d"], []]  # asked to quit first
    wait_until(lambda: not this_tests_daemons(tmp_path), "the daemon ends after SIGTERM")
    assert not leftovers(tmp_path)


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def test_someone_elses_daemon_is_used_as_it_is(fake_mps, only_this_test, tmp_path):
    record = fake_mps()
    outside = subprocess.Popen(["nvidia-cuda-mps-control", "300"], executable=shutil.which("sleep"))
    try:
        assert outside.pid in mps_daemon_pids() and mps_daemon_running()  # found by its name in /proc
        with managed_mps(True, daemon_running=only_this_test) as status:
            assert status.state == "already running" and status.active and status.pipe_dir is None
            assert PIPE_VAR not in os.environ
        assert calls(record) == []  # nothing started, nothing stopped
        assert outside.poll() is None
    finally:
        outside.kill()
        outside.wait()


def test_a_pipe_directory_in_the_environment_means_the_user_runs_mps(fake_mps, only_this_test, monkeypatch):
    record = fake_mps()
    monkeypatch.setenv(PIPE_VAR, "/tmp/their-mps")
    with managed_mps(True, daemon_running=only_this_test) as status:
        assert status.state == "already running" and PIPE_VAR in status.reason
        assert os.environ[PIPE_VAR] == "/tmp/their-mps"
    assert calls(record) == [] and os.environ[PIPE_VAR] == "/tmp/their-mps"


def test_without_the_control_binary_mps_is_unavailable(fake_mps, only_this_test, tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert not mps_available()
    with managed_mps(True, daemon_running=only_this_test) as status:
        assert status.state == "unavailable" and "not on PATH" in status.reason and not status.active
        assert PIPE_VAR not in os.environ


def test_not_wanted_means_off(fake_mps, only_this_test):
    record = fake_mps()
    with managed_mps(False, daemon_running=only_this_test) as status:
        assert status == MpsStatus("off", "not wanted for this search")
    assert calls(record) == []


@pytest.mark.parametrize("mode, said", [("fail", "exited with code 1: fake: cannot start the daemon"),
                                        ("hang", "did not return within 0.5 s")])
def test_a_daemon_that_will_not_start_is_reported_and_the_search_goes_on(fake_mps, only_this_test, tmp_path, mode, said):
    fake_mps(mode)
    with managed_mps(True, daemon_running=only_this_test, timeout=0.5) as status:
        assert status.state == "failed" and said in status.reason and not status.active
        assert PIPE_VAR not in os.environ and LOG_VAR not in os.environ  # no worker looks for it
    assert not this_tests_daemons(tmp_path) and not leftovers(tmp_path)


def test_mps_is_wanted_when_two_workers_share_a_gpu():
    assert shares_a_gpu(["0", "1", "0", "1"])
    assert not shares_a_gpu(["0", "1"])
    assert not shares_a_gpu([None, None, None])  # CPU workers: no GPU to share
