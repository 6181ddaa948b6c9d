"""`headsearch analyze` as a user runs it: on tiny real runs, on a search trial, and on bad input."""
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from headsearch.cli.main import app
from headsearch.tasks import DataSource, apply_overrides, get_task
from headsearch.training import train_run

runner = CliRunner()

TINY_VIT = {"arch": {"enc_heads": [4, 2, 2, 1], "fusion": "add"},
            "train": {"epochs": 1, "max_steps_per_epoch": 3, "batch_size": 64},
            "data": {"train_limit": 500, "val_size": 200, "test_limit": 200}}
TINY_MT = {"arch": {"d_model": 32, "enc_layers": 2, "enc_heads": [4, 2], "dec_layers": 1, "dec_heads": 2, "d_ff": 64},
           "train": {"epochs": 1, "max_steps_per_epoch": 5},
           "data": {"train_limit": 1000, "val_size": 40, "test_size": 40, "max_len": 16, "vocab_size": 1000}}


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory, cifar_dir):
    task = get_task("vit-cifar10")
    cfg = apply_overrides(task, task.config("tiny"), TINY_VIT)
    run_dir, _ = train_run(cfg, DataSource(data_dir=cifar_dir), tmp_path_factory.mktemp("vit") / "run", device="cpu")
    return run_dir


@pytest.fixture(scope="module")
def mt_run(tmp_path_factory, spa_file):
    import os

    os.environ.setdefault("HEADSEARCH_CACHE", str(tmp_path_factory.mktemp("cache")))
    task = get_task("translation-en-es")
    cfg = apply_overrides(task, task.config("tiny"), TINY_MT)
    run_dir, _ = train_run(cfg, DataSource(data_file=spa_file), tmp_path_factory.mktemp("mt") / "run", device="cpu")
    return run_dir


def _png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000


@pytest.mark.slow
def test_analyze_vit_run_writes_json_and_figures(vit_run, cifar_dir, tmp_path):
    out = tmp_path / "an"
    result = runner.invoke(app, ["analyze", str(vit_run), "--data-dir", str(cifar_dir), "--samples", "64", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "analysis.json").read_text())
    assert [l["heads"] for l in data["layers"]] == [4, 2, 2, 1]
    first = data["layers"][0]
    assert len(first["output_dissimilarity"]) == 4 and len(first["ablation"]) == 4
    assert data["layers"][3]["scalars"]["output_dissimilarity"] is None  # one head: no pair (NaN -> null)
    curve = data["pruning_curve"]
    assert curve[0]["heads_pruned"] == 0 and curve[0]["accuracy"] == data["baseline"]  # starts at the unpruned metric
    assert curve[-1]["heads_pruned"] == 9 and len(curve) == 11
    for name in ("query_orthogonality", "context_nonorthogonality", "output_dissimilarity", "head_importance",
                 "pruning_curve", "attention_sample0", "soft_vs_self_sample0"):  # fusion: soft beside self
        assert _png(out / f"{name}.png"), name
    assert "pruning curve" in result.output and "q-ortho" in result.output


@pytest.mark.slow
def test_analyze_translation_run_json_format(mt_run, spa_file, tmp_path):
    out = tmp_path / "an"
    result = runner.invoke(app, ["analyze", str(mt_run), "--data-file", str(spa_file), "--samples", "20",
                                 "--no-ablation", "--format", "json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    names = [l["name"] for l in data["layers"]]
    assert names == ["encoder.blocks.0.attn", "encoder.blocks.1.attn", "decoder.blocks.0.self_attn", "decoder.blocks.0.cross_attn"]
    assert "ablation" not in data["layers"][0]
    assert data["pruning_curve"][0]["bleu"] == data["baseline"]
    assert _png(out / "cross_attention_sample0.png")
    assert (mt_run / "tokenizer_src.json").exists()  # the run's own vocabularies were used


def test_not_a_run_directory(tmp_path):
    result = runner.invoke(app, ["analyze", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "is not a run directory: expected config.yaml and model.safetensors" in result.stderr


@pytest.mark.slow
def test_checkpoint_that_does_not_match_its_config(vit_run, cifar_dir, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(vit_run, copy)
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["arch"]["d_ff"] = 96
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    result = runner.invoke(app, ["analyze", str(copy), "--data-dir", str(cifar_dir), "--samples", "16"])
    assert result.exit_code == 2
    assert "does not match" in result.stderr and "Traceback" not in result.output
    assert not (copy / "analysis").exists()


def test_missing_data(vit_run, tmp_path):
    result = runner.invoke(app, ["analyze", str(vit_run), "--data-dir", str(tmp_path / "nowhere")])
    assert result.exit_code == 2
    assert "does not exist" in result.stderr


@pytest.mark.slow
def test_analysis_of_a_search_trial_is_uploaded_to_it(spa_file, tmp_path, monkeypatch):
    import optuna

    from headsearch.search.runner import Search, SearchSettings

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HEADSEARCH_CACHE", str(tmp_path / "cache"))
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"schedule": {"families": ["uniform"], "heads": [2]}, "skip": ["none"],
                                     "fusion": ["none"], "fixed": TINY_MT}))
    storage = f"sqlite:///{tmp_path / 'h.db'}"
    Search(SearchSettings(task="translation-en-es", space=str(space), trials=1, storage=storage, study="s",
                          data_file=str(spa_file), preset="tiny", run_root=str(tmp_path / "runs"))).run_worker()
    trial_dir = tmp_path / "runs" / "s" / "trial-00000"
    assert json.loads((trial_dir / "study.json").read_text())["trial"] == 0
    result = runner.invoke(app, ["analyze", str(trial_dir), "--data-file", str(spa_file), "--samples", "10", "--no-ablation"])
    assert result.exit_code == 0, result.output
    assert "uploaded to s trial 0" in result.output
    study = optuna.load_study(study_name="s", storage=storage)
    metas = optuna.artifacts.get_all_artifact_meta(study)
    assert {"trial0-analysis.json", "trial0-pruning_curve.png"} <= {m.filename for m in metas}
