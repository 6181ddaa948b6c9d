"""The CLI's habits: --version, --format json for the listings, $OPTUNA_STORAGE, and one module of shared
helpers (no command imports cli/main.py, which imports every command)."""
from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

import headsearch
from headsearch.search.space import all_spaces
from headsearch.tasks import all_tasks


@pytest.mark.floor
def test_version_prints_the_package_version(cli):
    result = cli(["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"headsearch {headsearch.__version__}"


def test_tasks_and_spaces_as_json(cli):
    tasks = json.loads(cli(["tasks", "--format", "json"]).stdout)
    assert [t["name"] for t in tasks] == [t.name for t in all_tasks()]
    vit = next(t for t in tasks if t["name"] == "vit-cifar10")
    assert vit["metrics"][0] == {"name": "accuracy", "direction": "maximize"} and "tiny" in vit["presets"]

    spaces = json.loads(cli(["spaces", "-f", "json"]).stdout)
    assert [s["name"] for s in spaces] == [s.name for s in all_spaces()]
    ham = next(s for s in spaces if s["name"] == "ham")
    assert ham["fusion"] == ["none", "hadamard", "add"] and ham["skip"] == ["none", "output", "scores"]
    assert ham["schedule"]["heads"] == [4] and ham["tasks"] == ["vit-cifar10"]

    for command in ("tasks", "spaces"):
        cli.error_line(cli([command, "--format", "yaml"]), "--format 'yaml' is not known", "table or json")


@pytest.mark.floor
def test_the_storage_comes_from_optuna_storage_unless_the_flag_says(cli, tmp_path, monkeypatch):
    env_url = f"sqlite:///{tmp_path / 'from-env.db'}"
    flag_url = f"sqlite:///{tmp_path / 'from-flag.db'}"
    monkeypatch.setenv("OPTUNA_STORAGE", env_url)
    for command in (["report"], ["export", "--pareto", "--out", str(tmp_path / "out")]):
        assert "from-flag.db" not in cli.error_line(cli(command), "from-env.db")
        assert "from-env.db" not in cli.error_line(cli([*command, "--storage", flag_url]), "from-flag.db")
    assert not (tmp_path / "from-env.db").exists() and not (tmp_path / "from-flag.db").exists()


def test_no_command_module_imports_the_cli_entry_point():
    cli_dir = Path(headsearch.__file__).parent / "cli"
    for path in cli_dir.glob("*.py"):
        if path.name == "main.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "headsearch.cli.main", f"{path.name} imports headsearch.cli.main"


def test_train_takes_set_over_the_config_and_under_the_flags(cli, tmp_path, cifar_dir, write_yaml):
    config = write_yaml(tmp_path / "run.yaml", {
        "task": "vit-cifar10", "seed": 0,
        "arch": {"d_model": 32, "d_ff": 64, "enc_layers": 2, "enc_heads": [2, 2]},
        "train": {"epochs": 3, "max_steps_per_epoch": 1, "batch_size": 16, "lr": 1.0e-3},
        "data": {"train_limit": 64, "val_size": 32, "test_limit": 32},
    })
    out = tmp_path / "run"
    result = cli(["train", "--task", "vit-cifar10", "--config", config, "--data-dir", cifar_dir, "--out", out,
                  "--device", "cpu", "--set", "train.lr=2e-3", "--set", "arch.enc_heads=[4, 1]",
                  "--set", "train.epochs=5", "--epochs", "1"])
    assert result.exit_code == 0, result.output
    import yaml

    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["train"]["lr"] == 2.0e-3 and written["arch"]["enc_heads"] == [4, 1]  # --set over --config
    assert written["train"]["epochs"] == 1  # --epochs over --set
    for bad, fragment in (("lr=1", "write SECTION.KEY=VALUE"), ("model.lr=1", "SECTION arch, train or data"),
                          ("train.no_such_field=1", "no_such_field")):
        cli.error_line(cli(["train", "--task", "vit-cifar10", "--data-dir", cifar_dir, "--out", tmp_path / "bad",
                            "--set", bad]), fragment)
        assert not (tmp_path / "bad").exists()


def test_run_takes_set_for_every_trial(cli, tmp_path):
    from headsearch.search.runner import Search, SearchSettings

    s = Search(SearchSettings(task="vit-cifar10", space="ham", preset="tiny", device="cpu", epochs=2,
                              sets={"train": {"lr": 2.0e-3, "epochs": 7}, "data": {"val_size": 100}}))
    assert s.base.train.lr == 2.0e-3 and s.base.data.val_size == 100
    assert s.base.train.epochs == 2  # --epochs over --set
    url = f"sqlite:///{tmp_path / 'h.db'}"
    cli.error_line(cli(["run", "--task", "vit-cifar10", "--storage", url, "--set", "train.lr"]), "--set train.lr")
    cli.error_line(cli(["run", "--task", "vit-cifar10", "--storage", url, "--set", "train.lr=-1"]), "lr")
    assert not (tmp_path / "h.db").exists()


@pytest.mark.slow
def test_enqueued_architectures_are_trained_first_and_never_twice(cli, tmp_path, cifar_dir, one_thread):
    """`run --enqueue CONFIG`: the papers' architectures first (Optuna's enqueue_trial), once per study."""
    from headsearch.search.runner import Search, SearchSettings

    examples = Path(__file__).resolve().parent.parent / "examples"
    url = f"sqlite:///{tmp_path / 'h.db'}"
    args = ["run", "--task", "vit-cifar10", "--space", "ham", "--preset", "tiny", "--data-dir", cifar_dir,
            "--storage", url, "--run-root", tmp_path / "runs", "--device", "cpu", "--pruner", "none",
            "--set", "train.max_steps_per_epoch=1", "--set", "data.train_limit=64", "--set", "data.val_size=32",
            "--set", "data.test_limit=32", "--epochs", "1", "--enqueue", examples / "ham-b.yaml",
            "--enqueue", examples / "ham-a.yaml"]
    result = cli([*args, "--trials", "2"])
    assert result.exit_code == 0, result.output
    import optuna

    study = optuna.load_study(study_name="vit-cifar10-ham-tiny", storage=url)
    fusions = [t.user_attrs["config"]["arch"]["fusion"] for t in study.trials]
    assert fusions == ["add", "hadamard"]  # ham-b, then ham-a, before anything sampled
    assert study.trials[0].user_attrs["config"]["data"]["train_limit"] == 64  # --set reached the trials
    # Resumed with the same --enqueue: nothing enqueued again, one sampled trial more.
    result = cli([*args, "--trials", "3"])
    assert result.exit_code == 0, result.output
    trials = optuna.load_study(study_name="vit-cifar10-ham-tiny", storage=url).trials
    held = [t for t in trials if "duplicate_of" not in t.user_attrs]
    assert len(held) == 3 and [t.user_attrs["config"]["arch"]["fusion"] for t in held[:2]] == ["add", "hadamard"]

    # A config the space does not hold: one line, before any study exists.
    other = f"sqlite:///{tmp_path / 'other.db'}"
    line = cli.error_line(cli(["run", "--task", "vit-cifar10", "--space", "deep-head", "--preset", "tiny", "--storage", other,
                               "--data-dir", cifar_dir, "--enqueue", examples / "ham-b.yaml"]), "ham-b.yaml")
    assert "is not an architecture of space deep-head" in line and not (tmp_path / "other.db").exists()
    s = Search(SearchSettings(task="vit-cifar10", space="ham", preset="tiny", device="cpu"))
    assert s.archs.params_of(examples / "vit-classic.yaml") == {"schedule": "uniform", "heads": 4, "skip": "none", "fusion": "none"}


TRACKER = '''
import json, os


class Recorder:
    """An Optuna callback, as optuna-integration's are: called with the study and the finished FrozenTrial."""

    def __call__(self, study, trial):
        with open(os.environ["TRACKER_FILE"], "a") as f:
            f.write(json.dumps({"study": study.study_name, "number": trial.number, "state": trial.state.name,
                                "values": trial.values, "arch": trial.user_attrs.get("arch"), "pid": os.getpid()}) + "\\n")


record = Recorder()
'''


@pytest.mark.slow
@pytest.mark.floor
def test_run_calls_optuna_callbacks_after_each_trained_trial(cli, tmp_path, cifar_dir, one_thread, monkeypatch):
    (tmp_path / "my_trackers.py").write_text(TRACKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TRACKER_FILE", str(tmp_path / "calls.jsonl"))
    url = f"sqlite:///{tmp_path / 'h.db'}"
    args = ["run", "--task", "vit-cifar10", "--space", "ham", "--preset", "tiny", "--data-dir", cifar_dir, "--storage", url,
            "--run-root", tmp_path / "runs", "--device", "cpu", "--pruner", "none", "--epochs", "1", "--trials", "3",
            "--set", "train.max_steps_per_epoch=1", "--set", "data.train_limit=64", "--set", "data.val_size=32",
            "--set", "data.test_limit=32"]
    result = cli([*args, "--callback", "my_trackers:record"])
    assert result.exit_code == 0, result.output
    import optuna

    study = optuna.load_study(study_name="vit-cifar10-ham-tiny", storage=url)
    trained = [t for t in study.trials if "duplicate_of" not in t.user_attrs]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    # One call per trained trial, after it was told: its state and values as the storage holds them.
    assert [(c["number"], c["state"], c["values"], c["arch"]) for c in calls] == [
        (t.number, t.state.name, t.values, t.user_attrs["arch"]) for t in trained]
    assert {c["study"] for c in calls} == {"vit-cifar10-ham-tiny"} and len(calls) == 3

    for spec, fragment in (("my_trackers", "write module:attr"), ("no_such_module:x", "cannot import no_such_module"),
                           ("my_trackers:nothing", "my_trackers has no nothing"), ("my_trackers:json", "json is not callable")):
        line = cli.error_line(cli(["run", "--task", "vit-cifar10", "--storage", f"sqlite:///{tmp_path / 'bad.db'}",
                                   "--callback", spec]), f"--callback {spec}")
        assert fragment in line, line
    assert not (tmp_path / "bad.db").exists()


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="session")
def mlflow_tracker() -> None:
    """MLflow and optuna-integration (the dev extra) for examples/trackers/mlflow_tracker.py."""
    import importlib.util

    from conftest import unavailable

    for name in ("mlflow", "optuna_integration"):
        if importlib.util.find_spec(name) is None:
            unavailable(f"{name} is not installed (pip install -e '.[dev]')")


@pytest.mark.processes
@pytest.mark.slow
def test_every_worker_process_calls_the_callbacks_for_its_own_trials(cli, tmp_path, cifar_dir, monkeypatch, mlflow_tracker):
    """Two callbacks on a search with two worker processes: a recorder, and the MLflow tracker of
    examples/trackers (optuna-integration's MLflowCallback) on a local MLflow store. Each trained trial reaches
    both once, in the worker that trained it; MLflow's runs, read back, are the study's trials."""
    (tmp_path / "my_trackers.py").write_text(TRACKER)
    path = os.pathsep.join([str(tmp_path), str(EXAMPLES / "trackers"), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)  # the workers import them
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLES / "trackers"))
    monkeypatch.setenv("TRACKER_FILE", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    url = f"sqlite:///{tmp_path / 'h.db'}"
    result = cli(["run", "--task", "vit-cifar10", "--space", "ham", "--preset", "tiny", "--data-dir", cifar_dir, "--storage", url,
                  "--run-root", tmp_path / "runs", "--device", "cpu", "--pruner", "none", "--epochs", "1", "--trials", "4",
                  "--workers", "2", "--cohort", "1", "--set", "train.max_steps_per_epoch=1", "--set", "data.train_limit=64",
                  "--set", "data.val_size=32", "--set", "data.test_limit=32", "--callback", "my_trackers:record",
                  "--callback", "mlflow_tracker:track"])
    assert result.exit_code == 0, result.output
    import optuna

    study = optuna.load_study(study_name="vit-cifar10-ham-tiny", storage=url)
    trained = {t.number: t for t in study.trials if "duplicate_of" not in t.user_attrs}
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    # Each trained trial once, called in the worker process that trained it (its "worker" attribute's pid).
    assert sorted(c["number"] for c in calls) == sorted(trained) and len(calls) == 4
    for c in calls:
        t = trained[c["number"]]
        assert (c["state"], c["values"]) == (t.state.name, t.values)
        assert t.user_attrs["worker"].endswith(f":{c['pid']}") and c["pid"] != os.getpid()

    # The tracker's runs, read back from MLflow's store: one run per trained trial, equal to it.
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == study.study_name]
    runs = client.search_runs([experiment.experiment_id])
    tracked = {int(r.data.tags["number"]): r.data for r in runs}
    assert sorted(tracked) == sorted(trained) and len(runs) == 4
    for number, data in tracked.items():
        t = trained[number]
        assert data.tags["state"] == t.state.name
        assert data.metrics == dict(zip(study.metric_names, t.values))
        assert data.params == {k: str(v) for k, v in t.params.items()}


@pytest.mark.processes
@pytest.mark.floor
def test_shell_completion_completes_commands_and_options():
    import subprocess
    import sys

    script = Path(sys.executable).parent / "headsearch"  # the console script: completion is keyed by its name
    # A user's shell is detected from the parent process; here that is pytest (under make's sh), so the
    # shell is named instead, with Typer's switch for that (older Typers ignore a name without it).
    import os

    naming = {**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    shown = subprocess.run([str(script), "--show-completion", "bash"], capture_output=True, text=True, timeout=120,
                           env=naming)
    assert shown.returncode == 0 and "complete -o default -F _headsearch_completion headsearch" in shown.stdout

    def complete(words: str) -> list[str]:
        env = {"_HEADSEARCH_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - 1),
               "PATH": str(script.parent)}
        proc = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    assert complete("headsearch ta") == ["tasks", "table"]
    assert complete("headsearch run --pru") == ["--pruner", "--pruner-startup-trials", "--pruner-startup",
                                                "--pruner-warmup-epochs", "--pruner-warmup", "--pruner-min-epochs",
                                                "--pruner-reduction-factor", "--pruner-noise-margin", "--pruner-noise",
                                                "--pruner-percentile", "--pruner-pause"]


@pytest.mark.parametrize("argv, flag", [
    (["export", "--study", "s", "--out", ""], "--out"),
    (["report", "--plots="], "--plots"),
    (["run", "--task", "vit-cifar10", "--run-root", " "], "--run-root"),
    (["train", "--task", "vit-cifar10", "--tensorboard", ""], "--tensorboard"),
    (["dashboard", "--artifact-dir="], "--artifact-dir"),
    (["export", "--study", "s", "--out", "best/"], None),
    (["run", "--study", ""], None),  # a name, not an output: its own check (test_fuzz.NAMES_AND_PATHS)
])
def test_an_empty_output_path_is_found_on_the_raw_command_line(argv, flag):
    """Typer reads `--out ""` as Path("."), the current folder: the raw argument is the only place to see it."""
    from headsearch.cli.checks import empty_output_flag

    assert empty_output_flag(argv) == flag


@pytest.mark.processes
def test_an_empty_output_path_is_one_line_and_writes_nothing(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "headsearch", "export", "--storage", f"sqlite:///{tmp_path / 'h.db'}",
                           "--study", "s", "--pareto", "--out", ""], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --out is empty: give the path to write to (. for the current folder)"
    assert list(tmp_path.iterdir()) == []
