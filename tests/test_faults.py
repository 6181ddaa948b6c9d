"""Faults: the machine failing under a run (a full disk, an I/O error), a process killed mid-write, a
worker crashing, a busy port, and noise around an error.

A full disk is injected where it strikes in practice, at the `fsync` of a file being written (the
test says which file), because a real full file system needs privileges a test should not assume. The
task is the planted-token task of test_custom_task.py: it trains in a fraction of a second.
"""
from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from safetensors.torch import load_file
from test_custom_task import NAME, SPACE, TASK

from headsearch.errors import environment_fault
from headsearch.io import append_line, remove_stale_temporaries, write_atomic

CPU = ["--device", "cpu"]


@pytest.fixture
def planted(monkeypatch):
    from headsearch.tasks import registry

    monkeypatch.setitem(registry._REGISTRY, NAME, TASK)
    return TASK


def disk_full_at(monkeypatch, when) -> list[str]:
    """Make `fsync` fail with ENOSPC for files written through write_atomic whose temporary name
    satisfies `when(name, calls_so_far)`. Returns the names it failed on."""
    real_fsync, failed, seen = os.fsync, [], []

    def fsync(fd):
        name = os.readlink(f"/proc/self/fd/{fd}")
        seen.append(name)
        if when(name, seen):
            failed.append(name)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return failed


def fault_line(result, *fragments: str) -> str:
    """An environment fault's exit: code 1, no traceback, and the last line of stderr (after whatever
    progress the run printed) the one "error: ..." line, holding every fragment."""
    assert result.exit_code == 1, (result.exit_code, result.stdout, result.stderr, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], result.stderr
    for f in fragments:
        assert f in lines[-1], lines[-1]
    return lines[-1]


def temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


# ----------------------------------------------------------------------------- environment faults


def test_environment_faults_are_told_from_bugs():
    full = OSError(errno.ENOSPC, "No space left on device", "/runs/x/model.safetensors")
    assert environment_fault(full) == "No space left on device writing /runs/x/model.safetensors"
    assert environment_fault(OSError(errno.EIO, "Input/output error")) == "Input/output error"
    try:  # a fault underneath another exception (as Optuna or SQLAlchemy wrap it) still counts
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("storage failed") from inner
    except RuntimeError as outer:
        assert environment_fault(outer) == "Disk quota exceeded"
    assert "database or disk is full" in environment_fault(Exception("(sqlite3.OperationalError) database or disk is full"))
    assert environment_fault(OSError(errno.ENOENT, "No such file or directory")) is None  # bad input or a bug
    assert environment_fault(ValueError("shapes do not match")) is None


def test_a_full_disk_during_train_gives_one_line_exit_1_and_keeps_the_finished_epochs(planted, cli, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    # The second checkpoint (or, if the metric never improves again, final.json) meets a full disk.
    # The second checkpoint meets a full disk, and so does the record of the failure (final.json).
    failed = disk_full_at(monkeypatch, lambda name, seen: (".model.safetensors." in name and
                                                           sum(".model.safetensors." in s for s in seen) == 2)
                          or ".final.json." in name)
    result = cli(["train", "--task", NAME, "--out", run_dir, "--seed", "1", "--epochs", "4", *CPU])
    line = fault_line(result, "No space left on device writing", str(run_dir), "the run directory keeps the epochs")
    assert failed and Path(failed[0]).parent == run_dir, failed
    assert Path(failed[0]).name.startswith(".model.safetensors.") and "model.safetensors:" in line  # the first fault is named
    assert not temporaries(tmp_path)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records and [r["epoch"] for r in records] == list(range(1, len(records) + 1))
    assert load_file(str(run_dir / "model.safetensors"))  # the last checkpoint written whole is still there


def test_a_full_disk_during_run_fails_that_trial_keeps_the_others_and_says_so(planted, cli, tmp_path, monkeypatch):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    storage = f"sqlite:///{tmp_path / 'study.db'}"  # the study's disk is fine; the run root's fills up
    failed = disk_full_at(monkeypatch, lambda name, seen: "trial-00001" in name)
    result = cli(["run", "--task", NAME, "--space", space, "--trials", "3", "--preset", "tiny", "--storage", storage,
                  "--study", "full", "--run-root", tmp_path / "runs", *CPU])
    fault_line(result, "No space left on device writing", "trial-00001", "finished trials are kept in the study")
    assert failed
    trials = optuna.load_study(study_name="full", storage=storage).trials
    assert trials[0].state == optuna.trial.TrialState.COMPLETE
    assert trials[1].state == optuna.trial.TrialState.FAIL
    assert "No space left on device" in trials[1].user_attrs["fail_reason"]
    assert not temporaries(tmp_path)


def test_a_line_appended_on_a_full_disk_is_cut_back_off(tmp_path, monkeypatch):
    log = tmp_path / "metrics.jsonl"
    append_line(log, '{"epoch": 1}')
    real_write = os.write

    def half_then_full(fd, data):  # the disk fills in the middle of the record
        if len(data) > 4:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError) as caught:
        append_line(log, '{"epoch": 2, "val": {"accuracy": 0.5}}')
    monkeypatch.undo()
    assert caught.value.filename == str(log)  # so the one line can name the file
    assert log.read_text() == '{"epoch": 1}\n'


# ----------------------------------------------------------------------------- temporary files


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.processes
def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "model.safetensors"
    stale = tmp_path / f".model.safetensors.{_dead_pid()}-k1ll3d.tmp"  # what SIGKILL mid-write leaves
    live = tmp_path / f".model.safetensors.{os.getppid()}-writing.tmp"  # a live process's write in progress
    other = tmp_path / f".other.json.{_dead_pid()}-x.tmp"  # another file's: left to its own next write
    for p in (stale, live, other):
        p.write_bytes(b"half a file")
    write_atomic(target, b"whole")
    assert target.read_bytes() == b"whole"
    assert not stale.exists() and live.exists() and other.exists()
    assert remove_stale_temporaries(tmp_path / "other.json") == [other]


@pytest.mark.processes
def test_sigkill_during_a_checkpoint_write_leaves_a_file_the_next_run_removes(tmp_path):
    """A real SIGKILL: a child process is killed while its write_atomic is blocked between writing the
    temporary file and renaming it; the next write to the same path removes what it left."""
    target = tmp_path / "model.safetensors"
    child = subprocess.Popen([sys.executable, "-c", f"""
import os, sys, time
import headsearch.io as io
real = os.replace
def stuck(src, dst):
    print("written", flush=True)
    time.sleep(60)
os.replace = stuck
io.write_atomic({str(target)!r}, b"x" * 1000)
"""], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "written"
    child.kill()
    child.wait()
    assert len(temporaries(tmp_path)) == 1 and not target.exists()
    write_atomic(target, b"the next checkpoint")
    assert not temporaries(tmp_path) and target.read_bytes() == b"the next checkpoint"


# ----------------------------------------------------------------------------- reproducible bytes


def test_checkpoints_of_the_same_config_and_seed_are_byte_identical(planted, cli, tmp_path):
    runs = []
    for name in ("a", "b"):
        result = cli(["train", "--task", NAME, "--out", tmp_path / name, "--seed", "3", "--epochs", "2", *CPU])
        assert result.exit_code == 0, result.output
        runs.append((tmp_path / name / "model.safetensors").read_bytes())
    assert runs[0] == runs[1]


@pytest.mark.processes
def test_the_same_tensors_and_metadata_always_give_the_same_bytes(tmp_path):
    """safetensors writes metadata from a hash map whose order changes per process (and per map): the
    checkpoint writer sorts it. Fresh processes, so that the hash seeds really differ."""
    code = f"""
import hashlib, sys, torch
from headsearch.training.rundir import save_checkpoint
meta = {{"epoch": "3", "task": "vit-cifar10", "note": "x", "seed": "1", "a": "2"}}
save_checkpoint({{"w": torch.arange(6.0).view(2, 3), "b": torch.ones(2)}}, sys.argv[1], meta)
"""
    digests = set()
    for i in range(3):  # unsorted, three random orders of five keys agree about once in 14,400 runs
        path = tmp_path / f"{i}.safetensors"
        subprocess.run([sys.executable, "-c", code, str(path)], check=True)
        digests.add(path.read_bytes())
        assert load_file(str(path))["w"].shape == (2, 3)
    assert len(digests) == 1


# ----------------------------------------------------------------------------- worker processes


def _crashing_worker(settings, tmp: str) -> None:
    """A worker process whose trials crash in their first training step with a bug (not bad input)."""
    import dataclasses

    from headsearch.search.workers import _worker_main
    from headsearch.tasks import registry

    def setup(cfg, source, device, run_dir=None):
        bound = TASK.setup(cfg, source, device)

        def loss(*args):
            raise RuntimeError("boom in the loss\nsecond line of the message")

        bound.loss = loss
        return bound

    registry._REGISTRY[NAME] = dataclasses.replace(TASK, setup=setup)
    _worker_main(settings, 0, None, 1, ["headsearch", "run"])


@pytest.mark.processes
def test_a_crashed_worker_is_named_with_its_trial_and_reason_in_one_line(planted, tmp_path):
    from headsearch.search.runner import SearchSettings
    from headsearch.search.workers import failure_line, worker_failure

    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    settings = SearchSettings(task=NAME, space=str(space), trials=2, preset="tiny", storage=f"sqlite:///{tmp_path / 'w.db'}",
                              study="crash", run_root=str(tmp_path / "runs"), device="cpu", heartbeat=0)
    p = mp.get_context("spawn").Process(target=_crashing_worker, args=(settings, str(tmp_path)))
    p.start()
    p.join(120)
    assert p.exitcode == 1
    failure = worker_failure(0, p.exitcode, tmp_path / "runs" / "crash" / "workers")
    assert failure.message == "in trial 0: RuntimeError: boom in the loss"
    assert not failure.bad_input and "RuntimeError" in failure.log.read_text()  # the traceback stays in the log
    line = failure_line([failure])
    assert line == f"worker 0 failed in trial 0: RuntimeError: boom in the loss (traceback in {failure.log})"
    trial = optuna.load_study(study_name="crash", storage=settings.storage).trials[0]
    assert trial.state == optuna.trial.TrialState.FAIL and trial.user_attrs["fail_reason"].startswith("RuntimeError: boom")


def test_failed_workers_read_as_one_line(tmp_path):
    from headsearch.search.workers import failure_line, worker_failure

    (tmp_path / "worker-1.failed").write_text("data file pairs.txt, line 3: not valid UTF-8\n")
    bad_input = worker_failure(1, 2, tmp_path)
    killed = worker_failure(0, -9, tmp_path)  # the OOM killer leaves no word
    assert bad_input.bad_input and bad_input.message == "data file pairs.txt, line 3: not valid UTF-8"
    assert killed.message == "killed by signal 9"
    assert failure_line([bad_input]) == "data file pairs.txt, line 3: not valid UTF-8"
    assert failure_line([killed, bad_input]).endswith("; 1 other worker(s) failed too, logs beside it")


# ----------------------------------------------------------------------------- the terminal


def test_dashboard_on_a_busy_port_says_so_before_serving(cli, tmp_path):
    pytest.importorskip("optuna_dashboard")  # a dev dependency: installed by the test command
    storage = f"sqlite:///{tmp_path / 'd.db'}"
    optuna.create_study(storage=storage, study_name="s")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = cli(["dashboard", "--storage", storage, "--port", port])
    cli.error_line(result, f"cannot serve on 127.0.0.1:{port}: the port is in use")
    assert result.stdout == ""  # no "Listening on", no URL


@pytest.mark.processes
def test_warnings_do_not_reach_the_terminal_around_an_error(tmp_path, cifar_dir):
    """A Redis storage makes Optuna warn that its Redis journal is experimental before it fails (no
    driver here, or nothing listening on port 1): the user sees the error line alone."""
    result = subprocess.run([sys.executable, "-m", "headsearch", "run", "--task", "vit-cifar10", "--trials", "1", "--preset", "tiny",
                             "--storage", "redis://127.0.0.1:1/0", "--data-dir", str(cifar_dir), "--space", "deep-head",
                             "--device", "cpu", "--run-root", str(tmp_path / "runs")],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "redis" in lines[0], result.stderr


def test_a_successful_command_shows_held_warnings_once_after_its_output():
    import warnings

    from headsearch.cli.main import held_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            warnings.warn("the same thing", UserWarning)
        warnings.warn("experimental", optuna.exceptions.ExperimentalWarning)
    shown = held_warnings(caught)
    assert len(shown) == 1 and shown[0].startswith("warning: the same thing (test_faults.py:")


# ------------------------------------------------------------------ processes a test starts


STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a process that does not stop on Ctrl-C
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.processes
def test_a_started_process_that_ignores_ctrl_c_is_killed_with_its_group():
    """tests/conftest.py's `processes`: a test's Ctrl-C that stops nothing (a child ignoring SIGINT, as a
    suite launched in the background passes it on) must not leave a search running beside the suite."""
    from conftest import Processes

    procs = Processes()
    leader = procs.start([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    member = int(leader.stdout.readline())
    assert _alive(member) and os.getpgid(member) == leader.pid  # the child is in the leader's group
    procs.stop(leader, grace=0.5)
    assert leader.returncode == -9  # SIGKILL after the grace, not Ctrl-C
    procs.end_all()  # what the fixture does at the test's end: the group's members too
    for _ in range(50):
        if not _alive(member):
            break
        time.sleep(0.1)
    assert not _alive(member)


def test_the_suite_runs_with_python_s_ctrl_c_handler_however_it_was_launched():
    import signal

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
