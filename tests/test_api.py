"""headsearch.api: examples/api.py runs as a user would run it, and the functions return what the CLI prints."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from headsearch import api
from headsearch.errors import ConfigError, HeadsearchError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.processes
@pytest.mark.slow
def test_the_api_example_runs_and_its_answers_are_the_clis(tmp_path, cifar_dir, cli):
    work = tmp_path / "demo"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "api.py"), "--data-dir", str(cifar_dir), "--work", str(work),
                           "--quick"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert f"trained {work / 'ham-b'}" in proc.stdout and "loaded " in proc.stdout and "logits (2, 10)" in proc.stdout

    storage = f"sqlite:///{work / 'search.db'}"
    study = optuna.load_study(study_name="vit-cifar10-ham-tiny", storage=storage)
    first = study.trials[0].user_attrs["config"]["arch"]
    assert (first["skip"], first["fusion"]) == ("none", "none")  # the enqueued classic ViT went first
    assert len([t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]) == 3
    assert json.loads((work / "ham-b" / "final.json").read_text())["status"] == "completed"

    # report: the CLI's JSON is the API's report, as a dict
    printed = json.loads(cli(["report", "--storage", storage, "--format", "json"]).stdout)
    assert printed == json.loads(json.dumps(api.report(storage).to_dict()))
    df = api.trials(storage)
    assert list(df["number"]) == [t.number for t in study.trials] and "user_attrs_arch" in df.columns

    # a trained run's model and config
    model, cfg = api.load_model(work / "ham-b", data_dir=cifar_dir)
    assert cfg.arch.fusion == "add" and not model.training


def test_api_errors_are_the_clis_one_line_errors(tmp_path):
    with pytest.raises(HeadsearchError, match="unknown task 'nope': use one of translation-en-es, vit-cifar10"):
        api.train("nope")
    with pytest.raises(ConfigError, match=r"unknown config section\(s\) model"):
        api.search("vit-cifar10", sets={"model": {"x": 1}}, storage=f"sqlite:///{tmp_path / 'x.db'}")
    assert not (tmp_path / "x.db").exists()


@pytest.mark.slow
def test_api_compare_trains_every_config_with_every_seed(tmp_path, cifar_dir):
    small = {"train": {"max_steps_per_epoch": 1}, "data": {"train_limit": 64, "val_size": 32, "test_limit": 32}}
    examples = REPO / "examples"
    result = api.compare([examples / "vit-classic.yaml", examples / "ham-b.yaml"], "vit-cifar10", seeds=2, preset="tiny",
                         epochs=1, sets=small, storage=f"sqlite:///{tmp_path / 'c.db'}", run_root=tmp_path / "runs",
                         data_dir=cifar_dir, device="cpu", out=tmp_path / "out")
    assert {"configs", "differences", "best", "seeds"} <= set(result) and result["seeds"] in (2, [0, 1])
    assert (tmp_path / "out").is_dir() and any((tmp_path / "out").iterdir())
    study = optuna.load_study(study_name=optuna.get_all_study_names(f"sqlite:///{tmp_path / 'c.db'}")[0],
                              storage=f"sqlite:///{tmp_path / 'c.db'}")
    runs = [(t.user_attrs["config"]["arch"]["fusion"], t.user_attrs["config"]["seed"]) for t in study.trials]
    assert sorted(runs) == [("add", 0), ("add", 1), ("none", 0), ("none", 1)]


def test_export_takes_exactly_one_selector_as_the_command_does(tmp_path):
    for selectors in ({}, {"trial": 1, "pareto": True}):
        with pytest.raises(ConfigError, match="^pass exactly one of --trial N, --pareto, --best METRIC$"):
            api.export(f"sqlite:///{tmp_path / 'none.db'}", out=tmp_path / "out", **selectors)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
