"""A source checkout runs without `pip install`: `python -m headsearch` with the repository on PYTHONPATH
finds the built-in search spaces, which live inside the package (headsearch/search/spaces/)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def checkout(tmp_path):
    """A copy of the package alone (no installed metadata beside it) and an environment that imports it."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "headsearch", src / "headsearch", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(src), "COLUMNS": "200"}
    found = subprocess.run([sys.executable, "-c", "import headsearch; print(headsearch.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found).is_relative_to(src)  # the copy is what runs, not the installed package
    return tmp_path, env


def headsearch(args, cwd, env):
    return subprocess.run([sys.executable, "-m", "headsearch", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_spaces_are_found_from_a_source_checkout(checkout):
    cwd, env = checkout
    listed = headsearch(["spaces"], cwd, env)
    assert listed.returncode == 0, listed.stderr
    assert all(name in listed.stdout for name in ("deep-head", "ham", "full"))


@pytest.mark.slow
def test_run_from_a_source_checkout(checkout, cifar_dir):
    cwd, env = checkout
    result = headsearch(["run", "--task", "vit-cifar10", "--space", "deep-head", "--preset", "tiny", "--trials", "1",
                         "--epochs", "1", "--data-dir", str(cifar_dir), "--storage", f"sqlite:///{cwd / 'h.db'}",
                         "--run-root", str(cwd / "runs"), "--device", "cpu"], cwd, env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and (cwd / "h.db").is_file()
