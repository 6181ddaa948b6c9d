"""What stops a search from outside its trials: a cluster's SIGTERM (Slurm's time limit and preemption) and a device
fault (under NVIDIA MPS one client's fatal fault reaches every client on the GPU). Neither is an architecture's fault:
the trials running are failed as `interrupted (...)`, so that the same command, run again, retries them at once.

Real `headsearch run` processes on the tiny translation search of test_search.py; the device fault is a task (a
`module:attr` reference, as a plugin) whose training step raises the error CUDA gives, in every worker at once.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import OWN_GROUP
from optuna.trial import TrialState

from headsearch.errors import Terminated, device_fault, interruption, sigterm_raises
from test_search import (SLOWER_TRAIN, StoragePoller, finished, load, run_cmd, running_after_a_complete_trial,
                         sqlite_url, sub_env, wait_until, write_space)  # noqa: F401 (write_space: a fixture)

KILL_WAIT = 30.0  # Slurm's default KillWait: SIGKILL follows SIGTERM after it
RESUME_LINE = "error: interrupted (SIGTERM): finished trials are kept in the study; run the same command to resume"


def term_group_leader(cmd, env, cwd):
    """`cmd` leading a process group of its own (a SIGTERM to it reaches it alone, not its workers)."""
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **OWN_GROUP)  # a process group of its own


def stopped_by_sigterm(proc) -> tuple[str, str, float]:
    """SIGTERM to `proc` alone, as a scheduler sends it: (stdout, stderr, seconds until it exited)."""
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=90)
    return out, err, time.monotonic() - sent


def terminated_once(proc, moment, what: str, ending: str = RESUME_LINE):
    """Once `moment()` is true (within 120 s), SIGTERM to `proc` alone: it exits 143 within Slurm's KillWait, its
    last line (`ending`) saying what was kept and how to go on. Returns (what `moment` returned, stderr)."""
    try:
        seen = wait_until(moment, proc, 120, what)
        out, err, seconds = stopped_by_sigterm(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-3000:]
    assert seconds < KILL_WAIT
    check_one_line(err, ending)
    return seen, err


def check_one_line(err: str, ending: str) -> None:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].rstrip().endswith(ending), lines[-3:]
    assert err.count("error: ") - err.count("CUDA error: ") == 1, err[-3000:]  # one line of headsearch's


@pytest.mark.processes
@pytest.mark.slow
def test_sigterm_fails_the_running_trial_as_interrupted_and_the_same_command_retries_it_at_once(
        tmp_path, spa_file, tokenizer_cache, write_space):
    space = write_space(tmp_path / "space.yaml", train=SLOWER_TRAIN)
    url, n = sqlite_url(tmp_path / "h.db"), 2
    # Heartbeats of 60 s: a trial left RUNNING would hold its place for 3 minutes, past the rerun's timeout.
    cmd = run_cmd(space, url, "s", n, spa_file, tmp_path / "runs", "--pruner", "none", "--heartbeat", 60)
    env = sub_env(tokenizer_cache)
    poller = StoragePoller(url, "s", tmp_path / "runs" / "s")
    proc = term_group_leader(cmd, env, tmp_path)
    (trials, victim), err = terminated_once(proc, lambda: running_after_a_complete_trial(poller),
                                            "a trial was running after one completed")
    now = {t.number: t for t in load(url, "s").get_trials(deepcopy=False)}
    assert now[victim.number].state == TrialState.FAIL
    assert now[victim.number].user_attrs["fail_reason"] == "interrupted (SIGTERM)"
    [retry] = [t for t in now.values() if t.state == TrialState.WAITING]  # its architecture goes first next time
    assert retry.params == now[victim.number].params

    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert again.returncode == 0, again.stderr[-3000:]
    study = load(url, "s")
    assert len(finished(study)) == n
    assert len(study.trials) == n + 1  # the budget, plus the interrupted trial
    assert study.trials[retry.number].state == TrialState.COMPLETE  # the retry trained the interrupted architecture
    done_before = {t.number: t.values for t in trials if t.state == TrialState.COMPLETE}
    for number, values in done_before.items():
        assert study.trials[number].values == values


@pytest.mark.processes
@pytest.mark.slow
def test_sigterm_to_the_parent_alone_stops_its_workers_within_slurms_kill_wait(
        tmp_path, spa_file, tokenizer_cache, write_space):
    space = write_space(tmp_path / "space.yaml", train={"epochs": 200, "max_steps_per_epoch": 30})
    url = sqlite_url(tmp_path / "h.db")
    cmd = run_cmd(space, url, "s", 4, spa_file, tmp_path / "runs", "--pruner", "none", "--workers", 2)
    poller = StoragePoller(url, "s", tmp_path / "runs" / "s")
    proc = term_group_leader(cmd, sub_env(tokenizer_cache), tmp_path)
    terminated_once(proc, lambda: len([t for t in poller.trials() or () if t.state == TrialState.RUNNING
                                       and t.intermediate_values]) == 2, "two trials ran together")
    trials = load(url, "s").get_trials(deepcopy=False)
    assert [t.state for t in trials].count(TrialState.RUNNING) == 0
    assert [t.state for t in trials].count(TrialState.WAITING) == 2  # both architectures re-enqueued
    assert sorted(t.user_attrs.get("fail_reason") for t in trials if t.state == TrialState.FAIL) == ["interrupted (SIGTERM)"] * 2
    alive = subprocess.run(["pgrep", "-g", str(proc.pid), "-f", "spawn_main"], capture_output=True, text=True).stdout.split()
    assert alive == [], f"worker processes left running: {alive}"


def test_sigterm_raises_once_and_gives_the_handler_back():
    """In process, as an API user's program runs a search: SIGTERM raises `Terminated` (a KeyboardInterrupt, 143),
    a second one does not interrupt its unwinding, and the program's own handler is back afterwards."""
    heard = []
    previous = signal.signal(signal.SIGTERM, lambda *_: heard.append("own"))
    try:
        with pytest.raises(Terminated) as stopped:
            with sigterm_raises():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler runs at the next instruction: never reached
        try:
            with sigterm_raises():
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        assert isinstance(stopped.value, KeyboardInterrupt) and stopped.value.exit_code == 143
        assert interruption(stopped.value) == "interrupted (SIGTERM)"
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert heard == ["own"]
    finally:
        signal.signal(signal.SIGTERM, previous)


# ------------------------------------------------------------------------------------------ device faults


@pytest.mark.parametrize("message", [
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported",
    "CUDA error: unspecified launch failure",
    "CUDA error: misaligned address",
    "CUDA error: uncorrectable ECC error encountered",
    "CUDA error: all CUDA-capable devices are busy or unavailable",
    "CUDA error: CUDA-capable device(s) is/are busy or unavailable",
    "CUDA error: the MPS client has been terminated by the server",
    "cudaErrorDevicesUnavailable",
])
def test_an_error_that_leaves_the_device_unusable_is_a_device_fault(message):
    assert device_fault(RuntimeError(message)) == message.splitlines()[0]
    try:  # as a wrapper re-raises it
        try:
            raise RuntimeError(message)
        except RuntimeError as e:
            raise ValueError("the step failed") from e
    except ValueError as wrapped:
        assert device_fault(wrapped) == message.splitlines()[0]


@pytest.mark.parametrize("message", [
    "CUDA error: device-side assert triggered",  # the model's own (an index out of range): failed for good
    "CUDA out of memory. Tried to allocate 2.00 GiB",
    "mat1 and mat2 shapes cannot be multiplied (4x8 and 16x2)",
])
def test_a_models_own_error_is_not_a_device_fault(message):
    assert device_fault(RuntimeError(message)) is None


FAULTY_TASK = '''
"""translation-en-es whose training steps raise the error CUDA gives after a device fault, while
HS_TEST_DEVICE_FAULT is set: in every process at once, as every MPS client on a GPU gets one client's fault."""
import dataclasses
import os

from headsearch.tasks import get_task

BASE = get_task("translation-en-es")


class Faulty:
    def __init__(self, bound):
        self.bound = bound

    def __getattr__(self, name):
        return getattr(self.bound, name)

    def rebind(self, cfg):
        return Faulty(self.bound.rebind(cfg))

    def loss(self, model, batch, label_smoothing):
        if os.environ.get("HS_TEST_DEVICE_FAULT"):
            raise RuntimeError("CUDA error: an illegal memory access was encountered\\n"
                               "CUDA kernel errors might be asynchronously reported at some other API call")
        return self.bound.loss(model, batch, label_smoothing)


def setup(*args, **kwargs):
    return Faulty(BASE.setup(*args, **kwargs))


TASK = dataclasses.replace(BASE, name="translation-device-fault", setup=setup)
'''


@pytest.mark.processes
@pytest.mark.slow
def test_a_device_fault_in_every_worker_is_one_event_and_its_trials_are_retried(
        tmp_path, spa_file, tokenizer_cache, write_space):
    (tmp_path / "faulty_task.py").write_text(textwrap.dedent(FAULTY_TASK))
    space = write_space(tmp_path / "space.yaml")
    url, n = sqlite_url(tmp_path / "h.db"), 2
    cmd = run_cmd(space, url, "s", n, spa_file, tmp_path / "runs", "--pruner", "none", "--workers", 2)
    cmd[cmd.index("--task") + 1] = "faulty_task:TASK"
    env = {**sub_env(tokenizer_cache), "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    first = subprocess.run(cmd, cwd=tmp_path, env={**env, "HS_TEST_DEVICE_FAULT": "1"}, capture_output=True, text=True,
                           timeout=240)
    assert first.returncode == 1, first.stderr[-3000:]
    check_one_line(first.stderr, "")
    line = next(line for line in first.stderr.splitlines() if "error: device fault" in line)
    assert line.startswith("error: device fault on the CPU: 2 workers stopped within"), line
    assert "(CUDA error: an illegal memory access was encountered); their trials are kept for retry: rerun the same command" in line
    for i in range(2):  # each worker's own line says so too
        assert "device fault" in (tmp_path / "runs" / "s" / "workers" / f"worker-{i}.failed").read_text()
    trials = load(url, "s").get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.FAIL] * 2 + [TrialState.WAITING] * 2  # retried first next time
    assert [t.user_attrs["fail_reason"] for t in trials[:2]] == [
        "interrupted (device fault: CUDA error: an illegal memory access was encountered)"] * 2
    # Each retry is its trial's architecture, enqueued: the next run trains it first (a rerun that does so is
    # test_sigterm_fails_the_running_trial_as_interrupted_and_the_same_command_retries_it_at_once's).
    assert sorted(map(str, (t.params for t in trials[2:]))) == sorted(map(str, (t.params for t in trials[:2])))


@pytest.mark.processes
@pytest.mark.slow
def test_a_device_fault_in_one_process_is_one_line_and_its_trial_is_retried(tmp_path, spa_file, tokenizer_cache,
                                                                            write_space):
    (tmp_path / "faulty_task.py").write_text(textwrap.dedent(FAULTY_TASK))
    cmd = run_cmd(write_space(tmp_path / "space.yaml"), sqlite_url(tmp_path / "h.db"), "s", 1, spa_file,
                  tmp_path / "runs", "--pruner", "none")
    cmd[cmd.index("--task") + 1] = "faulty_task:TASK"
    env = {**sub_env(tokenizer_cache), "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "HS_TEST_DEVICE_FAULT": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    check_one_line(proc.stderr, "error: device fault (CUDA error: an illegal memory access was encountered): the device"
                                " is unusable; finished trials are kept in the study; run the same command to resume")
    trial, retry = load(sqlite_url(tmp_path / "h.db"), "s").get_trials(deepcopy=False)
    assert (retry.state, retry.params) == (TrialState.WAITING, trial.params)
    assert trial.user_attrs["fail_reason"] == "interrupted (device fault: CUDA error: an illegal memory access was encountered)"


@pytest.mark.processes
@pytest.mark.slow
def test_sigterm_to_train_keeps_the_finished_epochs_and_exits_143(tmp_path, spa_file, tokenizer_cache):
    """`headsearch train` under a cluster's time limit: SIGTERM ended it at once, without a line, its run directory
    saying nothing of how it ended. Now it stops as Ctrl-C does: the run is recorded as interrupted with its
    finished epochs, one line says so, and the exit status is 143."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "headsearch", "train", "--task", "translation-en-es", "--data-file", str(spa_file),
           "--preset", "tiny", "--device", "cpu", "--out", str(run_dir), "--set", "data.train_limit=256", "--set",
           "data.val_size=32", "--set", "data.test_size=32", "--set", "train.epochs=500", "--set", "train.max_steps_per_epoch=3"]
    proc = term_group_leader(cmd, sub_env(tokenizer_cache), tmp_path)
    metrics = run_dir / "metrics.jsonl"
    terminated_once(proc, lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, "an epoch finished",
                    "error: interrupted (SIGTERM): finished epochs and the best checkpoint are kept in the run directory")
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "interrupted" and final["epochs_run"] >= 1, final
