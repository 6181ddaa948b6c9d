"""The device lock (headsearch.training.devicelock) between real processes: exclusive and shared holds
exclude each other, shared holds overlap, a waiting exclusive request is not starved by busy shared
holders, a killed holder frees the device, and nesting in one thread is refused instead of deadlocking.

Helper processes run a small script (HELPER) and append one line per event to a shared log with
O_APPEND, so the log's order is the order in which the events happened. The tests order things with
files and with /proc/locks (which lists a process blocked in flock), and assert orderings, never
tight durations.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from headsearch.training.devicelock import (
    DeviceHold,
    DeviceShare,
    LockNestingError,
    NoShare,
    device_key,
    lock_file_stem,
)

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 30.0  # generous: a loaded two-core machine may be slow, but never this slow

HELPER = r"""
import json, os, sys, time
from pathlib import Path
from headsearch.training.devicelock import DeviceShare

args = json.loads(sys.argv[1])
share = DeviceShare(Path(args["lock_dir"]), args["key"])
events, name = Path(args["events"]), args["name"]
log = os.open(events / "log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)

def note(*words):
    os.write(log, (" ".join(map(str, words)) + "\n").encode())

def wait_for_file(path):
    deadline = time.monotonic() + 60
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.005)

if args["action"] == "hold":
    note("request", name)
    with getattr(share, args["mode"])() as hold:
        note("acquire", name, hold.waited)
        (events / f"{name}.acquired").touch()
        wait_for_file(events / f"{name}.release")
        note("release", name)
else:  # "loop": re-take shared in a tight loop until told to stop, handing over to the next holder
    newest, rounds = events / "newest", 0
    while not (events / "stop").exists():
        with share.shared():
            note("S+", name)
            (events / f"{name}.newest").write_text(name)
            os.replace(events / f"{name}.newest", newest)
            # Let go only once another looper holds the device too (or after a while, should none come):
            # so some shared hold is always in place, as when workers' epochs overlap.
            deadline = time.monotonic() + 0.3
            while newest.read_text() == name and time.monotonic() < deadline:
                time.sleep(0.001)
            note("S-", name)
        rounds += 1
        if rounds == 5:
            (events / f"{name}.looping").touch()
"""


class Helpers:
    """Helper processes of one test, the files they order themselves by, and their event log."""

    def __init__(self, tmp_path: Path):
        self.lock_dir, self.events = tmp_path / "locks", tmp_path / "events"
        self.events.mkdir()
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, mode: str = "shared", action: str = "hold", key: str = "cuda-GPU-test") -> subprocess.Popen:
        args = dict(lock_dir=str(self.lock_dir), key=key, events=str(self.events), name=name, mode=mode, action=action)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.procs[name] = subprocess.Popen([sys.executable, "-c", HELPER, json.dumps(args)], cwd=REPO, env=env)
        return self.procs[name]

    def acquired(self, name: str) -> bool:
        return (self.events / f"{name}.acquired").exists()

    def release(self, name: str) -> None:
        (self.events / f"{name}.release").touch()

    def log(self) -> list[list[str]]:
        path = self.events / "log"
        return [line.split() for line in path.read_text().splitlines()] if path.exists() else []

    def waited(self, name: str) -> float:
        return next(float(e[2]) for e in self.log() if e[:2] == ["acquire", name])

    def finish(self, *names: str) -> None:
        """Release `names` and check that each of them ends cleanly."""
        for name in names:
            self.release(name)
        for name in names:
            assert self.procs[name].wait(timeout=TIMEOUT) == 0, f"helper {name} failed"

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def helpers(tmp_path):
    h = Helpers(tmp_path)
    yield h
    h.kill_all()


def wait_until(condition, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def blocked_in_flock(pid: int) -> bool:
    """Whether process `pid` waits for a flock now: /proc/locks lists a waiting request as '-> FLOCK ... PID'."""
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and "FLOCK" in fields and str(pid) in fields:
            return True
    return False


def order(log: list[list[str]]) -> list[str]:
    """The acquire/release events of a log, as 'acquire A', 'release A', ..."""
    return [f"{e[0]} {e[1]}" for e in log if e[0] in ("acquire", "release")]


@pytest.mark.processes
@pytest.mark.parametrize("holder_mode, waiter_mode", [("exclusive", "shared"), ("shared", "exclusive"),
                                                      ("exclusive", "exclusive")])
def test_a_hold_blocks_a_conflicting_request_until_it_ends(helpers, holder_mode, waiter_mode):
    helpers.start("A", holder_mode)
    wait_until(lambda: helpers.acquired("A"), "A holds the device")
    waiter = helpers.start("B", waiter_mode)
    wait_until(lambda: blocked_in_flock(waiter.pid), "B waits in flock")
    time.sleep(0.3)  # B's request started before it blocked: it has now waited at least this long
    assert not helpers.acquired("B")
    helpers.finish("A")
    wait_until(lambda: helpers.acquired("B"), "B gets the device once A left")
    helpers.finish("B")
    assert order(helpers.log()) == ["acquire A", "release A", "acquire B", "release B"]
    assert helpers.waited("B") >= 0.3  # the wait is reported, so a trainer can leave it out of its timings
    assert helpers.waited("A") < TIMEOUT


@pytest.mark.processes
def test_shared_holders_overlap(helpers):
    for name in "ABC":
        helpers.start(name, "shared")
    # None of them lets go before it is told to, so all three hold the device at once.
    wait_until(lambda: all(helpers.acquired(n) for n in "ABC"), "three shared holders hold the device together")
    helpers.finish(*"ABC")
    events = order(helpers.log())
    assert sorted(events[:3]) == ["acquire A", "acquire B", "acquire C"]


@pytest.mark.processes
def test_a_waiting_exclusive_request_is_not_starved_by_busy_shared_holders(helpers):
    """Three workers re-take the device shared in a tight loop, each letting go only once another holds
    it: some shared hold is always in place, so with plain flock (which grants new shared locks while an
    exclusive request waits) the exclusive request would wait forever. The gate keeps new shared holds
    out once it waits; the last holder lets go after its 0.3 s of patience and the request is granted."""
    loopers = ["L1", "L2", "L3"]
    for name in loopers:
        helpers.start(name, action="loop")
    wait_until(lambda: all((helpers.events / f"{n}.looping").exists() for n in loopers), "the loopers loop")
    helpers.start("E", "exclusive")
    wait_until(lambda: helpers.acquired("E"), "the exclusive request is granted", timeout=TIMEOUT)
    time.sleep(0.2)  # hold it a while: the loopers keep asking meanwhile
    helpers.release("E")
    assert helpers.procs["E"].wait(timeout=TIMEOUT) == 0
    wait_until(lambda: shared_after_exclusive(helpers.log()) == set(loopers), "every looper goes on after the exclusive hold")
    (helpers.events / "stop").touch()
    for name in loopers:
        assert helpers.procs[name].wait(timeout=TIMEOUT) == 0

    holding: set[str] = set()
    inside_exclusive = False
    for event, name, *_ in helpers.log():
        if event == "S+":
            assert not inside_exclusive, f"{name} took the device shared during the exclusive hold"
            holding.add(name)
        elif event == "S-":
            holding.discard(name)
        elif event == "acquire" and name == "E":
            assert not holding, f"the exclusive hold began while {holding} held the device shared"
            inside_exclusive = True
        elif event == "release" and name == "E":
            inside_exclusive = False


def shared_after_exclusive(log: list[list[str]]) -> set[str]:
    """The loopers that took the device shared after E released it."""
    heads = [e[:2] for e in log]
    if ["release", "E"] not in heads:
        return set()
    return {e[1] for e in log[heads.index(["release", "E"]):] if e[0] == "S+"}


@pytest.mark.processes
@pytest.mark.parametrize("victim_mode, waiter_mode", [("exclusive", "shared"), ("shared", "exclusive")])
def test_a_killed_holder_frees_the_device(helpers, victim_mode, waiter_mode):
    victim = helpers.start("A", victim_mode)
    wait_until(lambda: helpers.acquired("A"), "A holds the device")
    waiter = helpers.start("B", waiter_mode)
    wait_until(lambda: blocked_in_flock(waiter.pid), "B waits in flock")
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(timeout=TIMEOUT) == -signal.SIGKILL
    wait_until(lambda: helpers.acquired("B"), "B gets the device its killed holder left")
    helpers.finish("B")
    assert order(helpers.log()) == ["acquire A", "acquire B", "release B"]  # A never released it itself


@pytest.mark.parametrize("outer, inner", list(itertools.product(("shared", "exclusive"), repeat=2)))
def test_nesting_in_one_thread_raises_instead_of_deadlocking(tmp_path, outer, inner):
    share = DeviceShare(tmp_path / "locks", "cpu")
    same_device = DeviceShare(tmp_path / "locks", "cpu")
    with getattr(share, outer)():
        with pytest.raises(LockNestingError, match=f"{inner}\\(\\) entered inside {outer}\\(\\).*never nest"):
            with getattr(share, inner)():
                pass
        with pytest.raises(LockNestingError):  # another object for the same device is the same lock
            with getattr(same_device, inner)():
                pass
        with DeviceShare(tmp_path / "locks", "cuda-0").exclusive():  # another device is another lock
            pass
    with getattr(share, inner)() as hold:  # the refused request left nothing behind
        assert hold.mode == inner


def test_holds_report_their_waits_and_the_lock_folder_is_made(tmp_path):
    share = DeviceShare(tmp_path / "new" / "locks", "cuda-GPU-1234")
    assert (tmp_path / "new" / "locks").is_dir()
    with share.shared() as first:
        pass
    with share.exclusive() as second:
        pass
    assert isinstance(first, DeviceHold) and (first.mode, second.mode) == ("shared", "exclusive")
    assert share.waited_total == pytest.approx(first.waited + second.waited)
    with pytest.raises(ValueError):  # an error in the body propagates and releases the device
        with share.exclusive():
            raise ValueError
    with share.exclusive():
        pass


def test_no_share_does_nothing_but_keeps_the_same_rules():
    share = DeviceShare.none()
    assert isinstance(share, NoShare)
    with share.shared() as hold:
        assert hold == DeviceHold("shared", 0.0)
        with pytest.raises(LockNestingError):
            with share.exclusive():
                pass
    with share.exclusive() as hold:
        assert hold.waited == 0.0
    assert share.waited_total == 0.0


def test_device_keys_become_distinct_safe_file_names():
    assert device_key(None) == "cpu" and device_key("GPU-8f3a") == "cuda-GPU-8f3a"
    mig = "cuda-MIG-GPU-8f3a/1/0"
    assert "/" not in lock_file_stem(mig)
    assert lock_file_stem(mig) != lock_file_stem("cuda-MIG-GPU-8f3a_1_0")
    assert lock_file_stem("cuda-GPU-8f3a") == "cuda-GPU-8f3a"
