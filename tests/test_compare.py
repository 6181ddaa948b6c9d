"""`headsearch compare`: configs x seeds trained through the search's workers, and statistics that equal a
recomputation from the runs' own records."""
from __future__ import annotations

import json
import math
from pathlib import Path

import optuna
import pytest

from headsearch.analysis.stats import bootstrap_ci, paired_t_test
from headsearch.search.compare import ConfigGrid, check_seeds, resolve_candidates
from headsearch.tasks import get_task, resolve_config

VIT = get_task("vit-cifar10")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Small enough for the CPU: the tiny preset's model on 8x8 patches (17 tokens, not 65: HAM B's soft branch costs
# T^2), 2 epochs on 512 images.
SMALL = {"train": {"epochs": 2}, "data": {"train_limit": 512, "val_size": 128, "test_limit": 128}}
PATCH = {"patch_size": 8}


def small_configs(tmp_path, write_yaml) -> list[Path]:
    classic = write_yaml(tmp_path / "classic.yaml", {"arch": {"enc_heads": [4, 4, 4, 4], **PATCH}, **SMALL})
    ham_b = write_yaml(tmp_path / "ham-b.yaml", {"arch": {"fusion": "add", **PATCH}, **SMALL})
    return [classic, ham_b]


# ------------------------------------------------------------------------------ the grid


def test_the_grid_hands_out_points_seed_by_seed_and_skips_what_is_held():
    cands = resolve_candidates([str(EXAMPLES / "ham-a.yaml"), str(EXAMPLES / "ham-b.yaml")], VIT, preset="tiny")
    grid = ConfigGrid(tuple(cands), seeds=3)
    assert grid.points == 6 and [c.name for c in cands] == ["ham-a", "ham-b"]
    study = optuna.create_study()
    order = []
    for _ in range(6):
        point = grid.next_point(study.get_trials())
        order.append((point["config"], point["seed"]))
        study.enqueue_trial(point)
        t = study.ask()
        assert grid.sample(t, None)["seed"] == point["seed"]  # the trial's config carries the point's seed
        study.tell(t, 0.0)
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert grid.next_point(study.get_trials()) is None
    # An interrupted run is trained again; one that diverged is not (it would diverge again).
    study2 = optuna.create_study()
    for reason, point in (("interrupted (Ctrl-C)", {"config": 0, "seed": 0}), ("loss nan is not finite", {"config": 1, "seed": 0})):
        study2.enqueue_trial(point)
        t = study2.ask()
        t.set_user_attr("fail_reason", reason)
        study2.tell(t, state=optuna.trial.TrialState.FAIL)
    assert grid.next_point(study2.get_trials()) == {"config": 0, "seed": 0}


def test_configs_resolve_as_train_reads_them(tmp_path, write_yaml):
    path = write_yaml(tmp_path / "mine.yaml", {"enc_heads": [8, 4, 2, 1], "skip": "scores"})
    cands = resolve_candidates([str(path), str(path)], VIT, preset="tiny", epochs=3)
    assert [c.name for c in cands] == ["mine", "mine-2"]
    assert cands[0].config == resolve_config(VIT, preset="tiny", config=path, overrides={"train": {"epochs": 3}})


def test_set_overrides_every_config_and_is_checked():
    from headsearch.search.compare import parse_sets

    sets = parse_sets(["data.val_size=0", "train.lr=1e-2", "data.augment=[flip]"])
    assert sets == {"data": {"val_size": 0, "augment": ["flip"]}, "train": {"lr": 0.01}}
    cands = resolve_candidates([str(EXAMPLES / "ham-a.yaml"), str(EXAMPLES / "ham-b.yaml")], VIT, preset="tiny", epochs=2,
                               sets=sets)
    for c in cands:
        assert c.config.data.val_size == 0 and c.config.train.lr == 0.01 and c.config.train.epochs == 2
        assert c.config.data.augment == ("flip",)
    for bad in ("val_size=0", "model.x=1", "data.val_size"):
        with pytest.raises(Exception, match="SECTION.KEY=VALUE"):
            parse_sets([bad])
    with pytest.raises(Exception, match="data.val_size = -1"):
        resolve_candidates([str(EXAMPLES / "ham-a.yaml")] * 2, VIT, sets=parse_sets(["data.val_size=-1"]))


@pytest.mark.parametrize("specs, fragment", [
    (["nope.yaml", "examples/ham-b.yaml"], "config nope.yaml: no such file"),
    (["examples/ham-b.yaml"], "give at least two"),
    (["study:s", "examples/ham-b.yaml"], "write study:NAME:TRIAL"),
    (["study:s:best", "examples/ham-b.yaml"], "neither a trial number nor 'pareto'"),
    (["examples/deep-head.yaml", "examples/ham-b.yaml"], "the ViT is encoder-only"),
])
def test_bad_configs_are_refused_with_one_line(cli, tmp_path, specs, fragment):
    root = EXAMPLES.parent
    specs = [s if s.startswith("study:") or s == "nope.yaml" else str(root / s) for s in specs]
    result = cli(["compare", *specs, "--task", "vit-cifar10", "--seeds", 2, "--storage", f"sqlite:///{tmp_path / 'c.db'}",
                  "--run-root", tmp_path / "runs"])
    cli.error_line(result, fragment)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "c.db").exists()


def test_too_few_seeds_and_a_missing_study_trial_are_refused(cli, tmp_path):
    with pytest.raises(Exception, match="at least 2 seeds"):
        check_seeds(1)
    ham = [str(EXAMPLES / "ham-a.yaml"), str(EXAMPLES / "ham-b.yaml")]
    cli.error_line(cli(["compare", *ham, "--task", "vit-cifar10", "--seeds", 1, "--run-root", tmp_path / "runs"]),
                   "--seeds 1", "at least 2 seeds")
    url = f"sqlite:///{tmp_path / 's.db'}"
    optuna.create_study(study_name="searched", storage=url)
    line = cli.error_line(cli(["compare", "study:searched:7", ham[0], "--task", "vit-cifar10", "--storage", url,
                               "--run-root", tmp_path / "runs"]))
    assert "study searched has no trial 7" in line
    assert not (tmp_path / "runs").exists()
    assert [s.study_name for s in optuna.get_all_study_summaries(url)] == ["searched"]  # no comparison study made


# ------------------------------------------------------------------------------ a real comparison


def small_cifar_folder(cifar_dir: Path, folder: Path, train: int = 700, test: int = 200) -> Path:
    """The first `train` training and `test` test images of CIFAR-10, as a user's small --data-dir."""
    import numpy as np

    folder.mkdir()
    for name, n in (("train_0.npz", train), ("test.npz", test)):
        with np.load(cifar_dir / name) as d:
            np.savez(folder / name, x=d["x"][:n], y=d["y"][:n], label_names=d["label_names"])
    return folder


def test_the_data_check_honours_set_val_size_on_a_small_folder(tmp_path, cifar_dir, write_yaml):
    """Issue 50, item 8b. The comparison's data check (before any study exists) loaded the data with the preset's
    search budget, not the runs' configs: a folder of 700 images was refused for val_size 1000 whatever --set
    data.val_size said, so a small folder could not be compared at all. Now it checks the first config as its runs
    train it: --set reaches the check, and a --set the folder cannot hold is what the refusal names."""
    from headsearch.errors import ConfigError
    from headsearch.search.compare import comparison_search

    small = small_cifar_folder(cifar_dir, tmp_path / "small")
    configs = [str(p) for p in small_configs(tmp_path, write_yaml)]
    sets = {"data": {"val_size": 100, "train_limit": 256}}
    s, _ = comparison_search(configs, "vit-cifar10", seeds=2, storage=f"sqlite:///{tmp_path / 'c.db'}",
                             run_root=str(tmp_path / "runs"), preset="tiny", sets=sets, data_dir=str(small), device="cpu")
    assert (s.base.data.val_size, s.base.data.train_limit) == (100, 256)
    s.check_data()  # was: val_size=1000 does not fit 700 training images
    too_big = {"data": {"val_size": 700}}
    s, _ = comparison_search(configs, "vit-cifar10", seeds=2, storage=f"sqlite:///{tmp_path / 'c.db'}",
                             run_root=str(tmp_path / "runs"), preset="tiny", sets=too_big, data_dir=str(small), device="cpu")
    with pytest.raises(ConfigError, match="val_size=700 does not fit 700 training images"):
        s.check_data()
    assert not (tmp_path / "c.db").exists()


@pytest.mark.slow
def test_compare_on_a_small_folder_with_set_val_size(cli, tmp_path, cifar_dir, write_yaml, one_thread):
    """Issue 50, item 8b, as a user meets it: `compare --data-dir SMALL --set data.val_size=100` trains and compares
    (it said `val_size=1000 does not fit 700 training images` and exited 2)."""
    small = small_cifar_folder(cifar_dir, tmp_path / "small")
    result = cli(["compare", *small_configs(tmp_path, write_yaml), "--task", "vit-cifar10", "--preset", "tiny",
                  "--seeds", 2, "--data-dir", small, "--set", "data.val_size=100", "--set", "train.max_steps_per_epoch=1",
                  "--epochs", 1, "--storage", f"sqlite:///{tmp_path / 'c.db'}", "--study", "cmp",
                  "--run-root", tmp_path / "runs", "--device", "cpu", "--format", "json"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    out = json.loads(result.stdout)
    assert [len(c["runs"]) for c in out["configs"]] == [2, 2] and not out["missing"]


@pytest.mark.slow
def test_compare_two_configs_over_two_seeds(cli, tmp_path, cifar_dir, write_yaml, one_thread):
    """The acceptance case on the CPU: means, stds and paired differences equal a recomputation from each run's
    own final.json; the interval holds the mean difference; a rerun trains nothing and says the same."""
    configs = small_configs(tmp_path, write_yaml)
    url = f"sqlite:///{tmp_path / 'c.db'}"
    args = ["compare", *configs, "--task", "vit-cifar10", "--preset", "tiny", "--seeds", 2, "--data-dir", cifar_dir,
            "--storage", url, "--study", "cmp", "--run-root", tmp_path / "runs", "--device", "cpu", "--format", "json"]
    result = cli(args)
    assert result.exit_code == 0, (result.stderr, result.exception)
    out = json.loads(result.stdout)
    assert [c["name"] for c in out["configs"]] == ["classic", "ham-b"] and out["seeds"] == 2 and not out["missing"]

    # Per run: its seed, its run directory, and metrics equal to what the run itself recorded.
    recorded = {}
    for c in out["configs"]:
        assert [r["seed"] for r in c["runs"]] == [0, 1]
        for r in c["runs"]:
            final = json.loads((Path(r["run_dir"]) / "final.json").read_text())
            saved = json.loads((Path(r["run_dir"]) / "config.json").read_text()) if (Path(r["run_dir"]) / "config.json").exists() else None
            assert r["metrics"]["val_accuracy"] == pytest.approx(final["best_metrics"]["accuracy"])
            assert r["metrics"]["test_accuracy"] == pytest.approx(final["test_metrics"]["accuracy"])
            assert r["metrics"]["best_epoch"] == final["best_epoch"]
            assert sorted(r["curve"]) == ["1", "2"]
            if saved is not None:
                assert saved["seed"] == r["seed"]
            recorded[c["name"], r["seed"]] = r["metrics"]
    # The two configs really differ (HAM B has its soft branch), and each seed gave its own run.
    assert out["configs"][1]["runs"][0]["metrics"]["params"] > out["configs"][0]["runs"][0]["metrics"]["params"]
    assert recorded["classic", 0]["val_loss"] != recorded["classic", 1]["val_loss"]

    for c in out["configs"]:
        for metric in ("val_accuracy", "test_accuracy", "time", "best_epoch"):
            xs = [recorded[c["name"], s][metric] for s in (0, 1)]
            assert c["mean"][metric] == pytest.approx(sum(xs) / 2)
            assert c["std"][metric] == pytest.approx(abs(xs[0] - xs[1]) / math.sqrt(2))  # two values: |a - b| / sqrt 2
    diffs = {d["metric"]: d for d in out["differences"] if (d["a"], d["b"]) == ("classic", "ham-b")}
    for metric in ("val_accuracy", "test_accuracy", "time"):
        d = [recorded["ham-b", s][metric] - recorded["classic", s][metric] for s in (0, 1)]
        got = diffs[metric]
        assert got["mean_diff"] == pytest.approx(sum(d) / 2)
        assert got["ci95"][0] <= got["mean_diff"] <= got["ci95"][1]
        assert got["ci95"] == pytest.approx(list(bootstrap_ci(d)))  # two differences: the interval spans them
        assert got["p_value"] == pytest.approx(paired_t_test(d))
    assert out["best"]["name"] in ("classic", "ham-b") and out["best"]["metric"] == "val_accuracy"

    folder = tmp_path / "runs" / "cmp" / "compare"
    assert json.loads((folder / "comparison.json").read_text())["differences"] == out["differences"]
    assert (folder / "curves.png").stat().st_size > 1000

    # The runs are the study's trials: a rerun trains nothing and gives the same numbers; a table reads them.
    study = optuna.load_study(study_name="cmp", storage=url)
    assert len(study.trials) == 4
    again = cli(args[:-1] + ["table"])
    assert again.exit_code == 0, again.stderr
    assert len(optuna.load_study(study_name="cmp", storage=url).trials) == 4
    assert "paired differences" in again.stdout and "classic" in again.stdout and "ham-b" in again.stdout
    csv_out = cli(args[:-1] + ["csv"])
    rows = csv_out.stdout.strip().splitlines()
    assert rows[0].startswith("kind,config,a,b,metric") and any(r.startswith("difference,,classic,ham-b,val_accuracy") for r in rows)


@pytest.mark.slow
def test_report_robust_retrains_the_front_with_seeds(cli, tmp_path, cifar_dir, write_yaml, one_thread):
    """`report --robust 2`: the Pareto front of a (tiny) search retrained with seeds 0 and 1 through compare,
    shown on mean values with intervals; the search's own trials are untouched."""
    space = write_yaml(tmp_path / "two.yaml", {"schedule": {"families": ["uniform"], "heads": [2, 4]},
                                               "skip": ["none"], "fusion": ["none"],
                                               "fixed": {"arch": PATCH, "data": SMALL["data"]}})
    url = f"sqlite:///{tmp_path / 's.db'}"
    searched = cli(["run", "--task", "vit-cifar10", "--space", space, "--trials", 2, "--epochs", 1, "--preset", "tiny",
                    "--pruner", "none", "--sampler", "random", "--seed", 2, "--data-dir", cifar_dir, "--storage", url, "--study", "s",
                    "--run-root", tmp_path / "runs", "--device", "cpu"])
    assert searched.exit_code == 0, searched.stderr
    front = {}
    for t in sorted(optuna.load_study(study_name="s", storage=url).best_trials, key=lambda t: t.number):
        if all(t.user_attrs["config"] != f.user_attrs["config"] for f in front.values()):  # a reused twin: once
            front[t.number] = t
    assert front  # seed 2 samples both head counts; how many are on the front depends on the measured time
    result = cli(["report", "--study", "s", "--storage", url, "--robust", 2, "--run-root", tmp_path / "runs",
                  "--device", "cpu", "--format", "json"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    out = json.loads(result.stdout)
    assert out["study"] == "s-robust" and out["seeds"] == 2 and not out["missing"]
    assert sorted(c["name"] for c in out["configs"]) == sorted(f"s#{n}" for n in front)
    for c in out["configs"]:
        trial = front[int(c["name"].split("#")[1])]
        assert c["config"]["arch"] == trial.user_attrs["config"]["arch"]  # the front's architecture, retrained
        assert [r["seed"] for r in c["runs"]] == [0, 1]
        xs = [r["metrics"]["val_accuracy"] for r in c["runs"]]
        assert c["mean"]["val_accuracy"] == pytest.approx(sum(xs) / 2)
        assert c["ci95"]["val_accuracy"] == pytest.approx(sorted(xs))  # two seeds: the interval spans them
    assert set(out["front_on_means"]) <= {c["name"] for c in out["configs"]} and out["front_on_means"]
    assert [o["name"] for o in out["objectives"]] == ["val_accuracy", "time"]
    assert len(optuna.load_study(study_name="s", storage=url).trials) == 2  # the search is untouched
    table = cli(["report", "--study", "s", "--storage", url, "--robust", 2, "--run-root", tmp_path / "runs", "--device", "cpu"])
    assert table.exit_code == 0 and "Pareto front retrained with 2 seeds" in table.stdout
    assert len(optuna.load_study(study_name="s-robust", storage=url).trials) == 2 * len(front)  # nothing retrained twice
    cli.error_line(cli(["report", "--study", "s", "--storage", url, "--robust", 1]), "--robust 1", "at least 2 seeds")
