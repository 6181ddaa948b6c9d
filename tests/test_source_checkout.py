"""A source checkout runs without `pip install`: `python -m headsearch` with the repository on PYTHONPATH
finds the built-in search spaces, which live at the top of the repository (search_spaces/). So does a
machine without SciPy and pandas (the GPU image): `train`, `run` and `bench` never import them."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def checkout(tmp_path):
    """A copy of the package and the built-in spaces beside it, as a checkout holds them (no installed metadata),
    and an environment that imports it."""
    src = tmp_path / "src"
    for name in ("headsearch", "search_spaces"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    # SciPy and pandas made unimportable, as on a GPU image that lacks them: only statistics and data frames
    # (report, compare) may need them, never train, run or bench.
    (src / "sitecustomize.py").write_text(
        "import importlib.machinery as m, sys\n"
        "class _WithoutThem:  # the path finder, blind to scipy and pandas (tests/test_source_checkout.py)\n"
        "    @classmethod\n"
        "    def find_spec(cls, name, path=None, target=None):\n"
        "        if name.split('.')[0] not in ('scipy', 'pandas'):\n"
        "            return m.PathFinder.find_spec(name, path, target)\n"
        "    @classmethod\n"
        "    def invalidate_caches(cls):\n"
        "        m.PathFinder.invalidate_caches()\n"
        "sys.meta_path[:] = [_WithoutThem if f is m.PathFinder else f for f in sys.meta_path]\n")
    env = {**os.environ, "PYTHONPATH": str(src), "COLUMNS": "200"}
    found = subprocess.run([sys.executable, "-c", "import headsearch; print(headsearch.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found).is_relative_to(src)  # the copy is what runs, not the installed package
    absent = subprocess.run([sys.executable, "-c", "import scipy"], env=env, capture_output=True, text=True)
    assert absent.returncode == 1 and "No module named 'scipy'" in absent.stderr
    return tmp_path, env


def headsearch(args, cwd, env):
    return subprocess.run([sys.executable, "-m", "headsearch", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.processes
def test_spaces_are_found_from_a_source_checkout(checkout):
    cwd, env = checkout
    listed = headsearch(["spaces"], cwd, env)
    assert listed.returncode == 0, listed.stderr
    assert all(name in listed.stdout for name in ("deep-head", "ham", "full"))


@pytest.mark.processes
@pytest.mark.slow
def test_run_from_a_source_checkout(checkout, cifar_dir):
    cwd, env = checkout
    result = headsearch(["run", "--task", "vit-cifar10", "--space", "deep-head", "--preset", "tiny", "--trials", "1",
                         "--epochs", "1", "--data-dir", str(cifar_dir), "--storage", f"sqlite:///{cwd / 'h.db'}",
                         "--run-root", str(cwd / "runs"), "--device", "cpu"], cwd, env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and (cwd / "h.db").is_file()


@pytest.mark.processes
@pytest.mark.slow
def test_train_and_bench_start_without_scipy_and_pandas(checkout, cifar_dir):
    cwd, env = checkout
    env = {**env, "HEADSEARCH_CACHE": str(cwd / "cache")}
    (cwd / "short.yaml").write_text("train: {epochs: 1, max_steps_per_epoch: 2, batch_size: 16}\n"
                                    "data: {train_limit: 64, val_size: 32, test_limit: 32}\n")
    trained = headsearch(["train", "--task", "vit-cifar10", "--preset", "tiny", "--config", str(cwd / "short.yaml"),
                          "--data-dir", str(cifar_dir), "--device", "cpu", "--out", str(cwd / "run")], cwd, env)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert (cwd / "run" / "final.json").is_file()
    # bench with data that is not there: it imports what it runs (headsearch.machine.bench) before it checks the
    # data and stops with one line; its processes import what train imports.
    benched = headsearch(["bench", "--task", "vit-cifar10", "--data-dir", str(cwd / "nowhere"), "--device", "cpu"], cwd, env)
    assert benched.returncode == 2 and benched.stderr.startswith("error:") and "Traceback" not in benched.stderr
