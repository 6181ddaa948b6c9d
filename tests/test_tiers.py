"""The tier guard of tests/conftest.py (docs/testing.md), run on a suite of its own: a test that starts a
process unmarked `processes`, or takes longer than the limit marked with no tier, fails; a library's own
process (ctypes asking ldconfig) and a marked test do not."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = '''
import ctypes.util, subprocess, sys, time
import pytest

def test_unmarked_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.processes
def test_marked_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_a_library_probes_for_a_shared_object():
    ctypes.util._findSoname_ldconfig("c")  # runs /sbin/ldconfig -p: the library's process, not the test's

def test_unmarked_takes_too_long():
    time.sleep(1.2)

@pytest.mark.slow
def test_slow_takes_long():
    time.sleep(1.2)
'''


@pytest.mark.processes
def test_the_tier_guard_fails_unmarked_processes_and_long_unmarked_tests(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), tests / "conftest.py")
    (tests / "test_demo.py").write_text(DEMO)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-rf", str(tests)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin:/sbin", "HEADSEARCH_UNMARKED_SECONDS": "1"})
    failed = set(re.findall(r"FAILED \S+::(\w+)", proc.stdout))
    assert failed == {"test_unmarked_starts_a_process", "test_unmarked_takes_too_long"}, proc.stdout[-3000:]
    assert "3 passed" in proc.stdout
    assert "it started a process" in proc.stdout and "it took 1.2 s (over 1)" in proc.stdout
