"""Task plugins: a task found by an entry point (group `headsearch.tasks`) or a `module:attr` reference
reaches every command and every worker process. The example plugin (examples/bitext-plugin) is installed
with pip into a fresh virtual environment and driven through the CLI: tasks, train, run --workers 2,
report, export, analyze."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import yaml

from headsearch.errors import HeadsearchError
from headsearch.tasks import ENTRY_POINT_GROUP, get_task, registry, task_reference

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "examples" / "bitext-plugin"
SMALL = ["--set", "data.n_train=256", "--set", "data.n_val=64", "--set", "data.n_test=64", "--set", "train.epochs=2",
         "--set", "train.max_steps_per_epoch=3"]


# ------------------------------------------------------------------------------------- the registry


@pytest.fixture
def clean_registry(monkeypatch):
    """The registry as a fresh process has it, restored after the test."""
    monkeypatch.setattr(registry, "_REGISTRY", {})
    monkeypatch.setattr(registry, "_REFERENCES", {})


def test_built_in_tasks_load_through_the_plugin_path(clean_registry):
    assert set(registry.task_references()) >= set(registry.BUILTIN)
    task = get_task("vit-cifar10")
    assert task.name == "vit-cifar10" and task_reference(task) == "vit-cifar10"
    from headsearch.tasks import vit_cifar10

    assert task is vit_cifar10.TASK


def test_a_module_attr_reference_is_what_configs_record(clean_registry, monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN))
    task = get_task("headsearch_bitext.task:TASK")
    assert task.name == "bitext-en-es" and task_reference(task) == "headsearch_bitext.task:TASK"
    assert get_task("headsearch_bitext.task:TASK") is task and get_task("bitext-en-es") is task
    from headsearch.tasks import resolve_config

    cfg = resolve_config(task, preset="tiny")
    assert cfg.task == "headsearch_bitext.task:TASK"  # a worker or a later command imports it from this
    assert resolve_config("headsearch_bitext.task:TASK", config=cfg.to_dict()).data == cfg.data


@pytest.mark.parametrize("reference, fragment", [
    ("no_such_module_xyz:TASK", "cannot import no_such_module_xyz"),
    ("json:nothing", "json has no nothing"),
    ("json:dumps", "dumps is a function, not a headsearch.tasks.Task"),
    ("json:", "write package.module:attr"),
    ("nonesuch", "unknown task 'nonesuch': use one of"),
])
def test_a_bad_task_reference_says_what_to_do(clean_registry, reference, fragment):
    with pytest.raises(HeadsearchError, match=fragment.replace("(", r"\(")):
        get_task(reference)


def test_a_plugin_may_not_take_a_built_in_name(clean_registry, monkeypatch, tmp_path):
    (tmp_path / "impostor.py").write_text(
        "import dataclasses\nfrom headsearch.tasks.vit_cifar10 import TASK as T\nTASK = dataclasses.replace(T)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(HeadsearchError, match="a built-in task's name: rename it"):
        get_task("impostor:TASK")


def test_two_installed_packages_naming_one_task_is_an_error(clean_registry, monkeypatch):
    from importlib import metadata

    real = metadata.entry_points

    def entry_points(group=None, **kw):
        if group != ENTRY_POINT_GROUP:
            return real(group=group, **kw)
        return [metadata.EntryPoint("vit-cifar10", "someone_else.tasks:VIT", ENTRY_POINT_GROUP)]

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    with pytest.raises(HeadsearchError, match="two installed packages name the task 'vit-cifar10'"):
        get_task("vit-cifar10")


def test_the_cli_says_one_line_for_a_task_it_cannot_load(cli, tmp_path):
    result = cli(["train", "--task", "no_such_module_xyz:TASK", "--out", str(tmp_path / "run"), "--device", "cpu"])
    line = cli.error_line(result, "--task no_such_module_xyz:TASK", "cannot import no_such_module_xyz")
    assert "PYTHONPATH" in line
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ the example plugin, installed with pip


def fresh_venv(where: Path) -> Path:
    """A new virtual environment that sees this one's packages (torch, optuna, pip, setuptools) through a
    .pth file, with headsearch built into a wheel from this checkout and installed from it, as `pip install .`
    does (its console script, entry points and the search spaces the wheel ships). No pip of its own: this
    one's pip is used."""
    venv.create(where, with_pip=False)
    python = where / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "parent-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    source = where.parent / "headsearch-source"  # a build writes beside the sources: not in the repository
    for name in ("headsearch", "search_spaces"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip(python, str(source))
    shutil.rmtree(source)  # what runs now is the installed wheel alone
    return python


def pip(python: Path, *args: str) -> None:
    """`pip install` as a user runs it (the build backend comes from the package index, in isolation: the
    environment's own setuptools may be too old to build a wheel); dependencies are there already."""
    proc = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.processes
@pytest.mark.slow
def test_the_example_plugin_installs_with_pip_and_runs_through_every_command(tmp_path, spa_file):
    python = fresh_venv(tmp_path / "venv")
    plugin = shutil.copytree(PLUGIN, tmp_path / "bitext-plugin")  # builds write beside the sources: not in the repo
    pip(python, str(plugin))
    bin_dir = python.parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": "",
           "HEADSEARCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}

    def headsearch(*args: str) -> str:
        proc = subprocess.run([bin_dir / "headsearch", *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=900)
        assert proc.returncode == 0, f"headsearch {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    # The built-in spaces, from the wheel: search_spaces/ shipped as headsearch/search_spaces/.
    assert [s["name"] for s in json.loads(headsearch("spaces", "--format", "json"))] == ["deep-head", "full", "ham", "modern"]
    shipped = subprocess.run([python, "-c", "from headsearch.search.space import _builtin_dir; print(_builtin_dir())"],
                             capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout.strip()
    assert Path(shipped).is_relative_to(python.parent.parent) and Path(shipped).name == "search_spaces", shipped
    listed = {t["name"]: t for t in json.loads(headsearch("tasks", "--format", "json"))}
    assert {"vit-cifar10", "translation-en-es", "bitext-en-es"} <= set(listed)
    assert "shared word-prefix tokens" in listed["bitext-en-es"]["description"]

    run_dir = tmp_path / "run"
    headsearch("train", "--task", "bitext-en-es", "--data-file", str(spa_file), "--preset", "tiny", "--device", "cpu",
               "--out", str(run_dir), *SMALL)
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "completed" and final["epochs_run"] == 2
    assert set(final["test_metrics"]) == {"accuracy", "f1", "loss"}
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["task"] == "bitext-en-es"  # the entry point's name
    split = json.loads((run_dir / "bitext_split.json").read_text())  # the plugin's own artifact
    assert split["counts"]["test"]["examples"] == 64 and split["counts"]["test"]["positives"] == 32

    space = subprocess.run([python, "-c", "import headsearch_bitext; print(headsearch_bitext.SPACE)"], capture_output=True,
                           text=True, env=env, check=True).stdout.strip()
    storage = f"sqlite:///{tmp_path / 'bitext.db'}"
    study = ["--storage", storage, "--study", "bitext"]
    headsearch("run", "--task", "bitext-en-es", "--space", space, "--data-file", str(spa_file), "--preset", "tiny",
               "--trials", "6", "--workers", "2", "--device", "cpu", "--run-root", str(tmp_path / "runs"), "--pruner", "none",
               *study, *SMALL)
    report = json.loads(headsearch("report", *study, "--format", "json"))
    assert report["counts"]["complete"] == 6
    assert [o["name"] for o in report["objectives"]] == ["accuracy", "time"]

    import optuna

    trials = [t for t in optuna.load_study(study_name="bitext", storage=storage).get_trials(deepcopy=False)
              if "duplicate_of" not in t.user_attrs]
    # Trained in the worker processes (a worker that could not load the task fails the run); which of the
    # two trains how many trials is up to the race for the budget lock.
    assert 1 <= len({t.user_attrs["worker"] for t in trials}) <= 2
    assert {t.user_attrs["config"]["task"] for t in trials} == {"bitext-en-es"}

    headsearch("export", *study, "--pareto", "--out", str(tmp_path / "best"))
    exported = sorted((tmp_path / "best").glob("trial-*.yaml"))
    assert exported and yaml.safe_load(exported[0].read_text())["task"] == "bitext-en-es"

    trial_dir = next(p for p in sorted((tmp_path / "runs" / "bitext").glob("trial-*")) if (p / "final.json").exists())
    analysis = json.loads(headsearch("analyze", str(trial_dir), "--data-file", str(spa_file), "--samples", "16", "--device", "cpu",
                                     "--format", "json"))
    assert analysis["task"] == "bitext-en-es" and len(analysis["layers"]) == 2
    assert any(Path(f).name.startswith("head_importance") for f in analysis["figures"])


@pytest.mark.processes
@pytest.mark.slow
def test_a_module_attr_task_reaches_worker_processes_and_later_commands(tmp_path, spa_file, cli, monkeypatch):
    # Not installed: on PYTHONPATH only, named by its reference, which workers and `report` import again.
    monkeypatch.setenv("PYTHONPATH", str(PLUGIN) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.syspath_prepend(str(PLUGIN))
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_REFERENCES", dict(registry._REFERENCES))
    reference = "headsearch_bitext.task:TASK"
    storage = f"sqlite:///{tmp_path / 'ref.db'}"
    result = cli(["run", "--task", reference, "--space", str(PLUGIN / "headsearch_bitext" / "space.yaml"), "--data-file",
                  str(spa_file), "--preset", "tiny", "--trials", "2", "--workers", "2", "--device", "cpu", "--pruner", "none",
                  "--run-root", str(tmp_path / "runs"), "--storage", storage, "--study", "ref", *SMALL])
    assert result.exit_code == 0, result.output
    import optuna

    study = optuna.load_study(study_name="ref", storage=storage)
    assert study.user_attrs["headsearch"]["task"] == reference
    assert {t.user_attrs["config"]["task"] for t in study.trials} == {reference}
    # A later process: `report` loads the task from the study's reference.
    proc = subprocess.run([sys.executable, "-m", "headsearch", "report", "--storage", storage, "--study", "ref", "--format",
                           "json"], capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["counts"]["complete"] == 2
