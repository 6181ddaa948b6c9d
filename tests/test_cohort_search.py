"""`headsearch run --cohort K`: the search trains K trials at a time as one stacked model, and gets the trials
(and the results) it gets with `--cohort 1`."""
from __future__ import annotations

import subprocess
import sys

import optuna
import pytest

from headsearch.search.runner import Search, SearchSettings

SPACE = """\
schedule: {families: [uniform, halving, doubling], heads: [2, 4, 8, 16], min_heads: 1}
skip: [none, output, scores]
fusion: [none, hadamard, add]
fixed:
  arch: {patch_size: 8}  # 17 tokens, not 65: the soft branch costs T^2, and nothing here depends on the patch
  train: {epochs: 2, max_steps_per_epoch: 4, batch_size: 32, lr: 3.0e-3, warmup_epochs: 0.5, schedule: cosine}
  data: {train_limit: 640, val_size: 96, test_limit: 96}
"""


def search(tmp_path, cifar_dir, cohort: int, trials: int = 5, **settings) -> Search:
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    return Search(SearchSettings(task="vit-cifar10", space=str(space), trials=trials, sampler="random", seed=3,
                                 data_dir=str(cifar_dir), storage=f"sqlite:///{tmp_path / f'c{cohort}.db'}",
                                 run_root=str(tmp_path / f"runs{cohort}"), device="cpu", cohort=cohort, heartbeat=0,
                                 **settings))


def trials_of(s: Search):
    study = optuna.load_study(study_name=s.study_name, storage=s.settings.storage)
    return sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)


@pytest.mark.slow
def test_cohort_4_and_cohort_1_give_the_same_trials_and_results(tmp_path, cifar_dir, one_thread):
    """Same seed and sampler: the same parameters for every trial, accuracies within 0.02 (here: equal to
    float32 rounding), each trial with a complete run directory and its cohort recorded."""
    together, alone = search(tmp_path, cifar_dir, 4, pruner="none"), search(tmp_path, cifar_dir, 1, pruner="none")
    assert together.machine_plan().cohort == 4 and alone.machine_plan().cohort == 1
    together.prepare_data()
    together.run_worker()
    alone.prepare_data()
    alone.run_worker()
    a, b = trials_of(together), trials_of(alone)
    # The same proposals, duplicates of a held architecture (running in the cohort, finished alone) included
    assert [(t.params, t.user_attrs.get("duplicate_of")) for t in a] == [(t.params, t.user_attrs.get("duplicate_of")) for t in b]
    a, b = [t for t in a if "duplicate_of" not in t.user_attrs], [t for t in b if "duplicate_of" not in t.user_attrs]
    assert len(a) == len(b) == 5
    for x, y in zip(a, b):
        assert x.params == y.params and x.state == y.state == optuna.trial.TrialState.COMPLETE, (x.number, x.params, y.params)
        assert abs(x.user_attrs["val_metrics"]["accuracy"] - y.user_attrs["val_metrics"]["accuracy"]) <= 0.02
        assert abs(x.user_attrs["test_metrics"]["accuracy"] - y.user_attrs["test_metrics"]["accuracy"]) <= 0.02
        assert x.intermediate_values.keys() == y.intermediate_values.keys() == {1, 2}
        assert x.user_attrs["cohort"]["size"] == 4 and "cohort" not in y.user_attrs
        assert x.user_attrs["step_mode"] == "cohort of 4: eager"
        assert x.user_attrs["epoch_seconds_alone"] > 0 and x.values[1] == pytest.approx(
            x.user_attrs["best_epoch"] * x.user_attrs["epoch_seconds_alone"])
    # Five trials, cohort of four: the fifth took a slot freed by the first four.
    assert sorted(t.user_attrs["cohort"]["slot"] for t in a[:4]) == [0, 1, 2, 3] and a[4].user_attrs["cohort"]["slot"] == 0


@pytest.mark.processes
def test_the_cohort_flag_is_checked_before_anything_runs(tmp_path, cifar_dir):
    for flag, expected in (("0", "--cohort 0: give the number of trials"), ("x", "Invalid value for '--cohort'")):
        proc = subprocess.run([sys.executable, "-m", "headsearch", "run", "--task", "vit-cifar10", "--cohort", flag,
                               "--data-dir", str(cifar_dir), "--storage", f"sqlite:///{tmp_path / 'x.db'}"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and not (tmp_path / "x.db").exists()
    proc = subprocess.run([sys.executable, "-m", "headsearch", "run", "--task", "translation-en-es", "--cohort", "4",
                           "--storage", f"sqlite:///{tmp_path / 'y.db'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--cohort 4: task translation-en-es trains its trials one at a time" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "y.db").exists()
