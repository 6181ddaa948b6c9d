"""`headsearch analyze` as a user runs it: on tiny real runs, on a search trial, and on bad input."""
import json
from pathlib import Path

import pytest
import yaml

from headsearch.tasks import DataSource, resolve_config
from headsearch.training import train_run

TINY_VIT = {"arch": {"enc_heads": [4, 2, 2, 1], "fusion": "add"},
            "train": {"epochs": 1, "max_steps_per_epoch": 3, "batch_size": 64},
            "data": {"train_limit": 500, "val_size": 200, "test_limit": 200}}


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory, cifar_dir):
    cfg = resolve_config("vit-cifar10", preset="tiny", config=TINY_VIT)
    run_dir, _ = train_run(cfg, DataSource(data_dir=cifar_dir), tmp_path_factory.mktemp("vit") / "run", device="cpu")
    return run_dir


@pytest.fixture(scope="module")
def mt_run(tmp_path_factory, spa_file, tiny_translation, tokenizer_cache):
    config = {**tiny_translation, "arch": {**tiny_translation["arch"], "enc_heads": [4, 2]}}
    cfg = resolve_config("translation-en-es", preset="tiny", config=config)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HEADSEARCH_CACHE", str(tokenizer_cache))
        run_dir, _ = train_run(cfg, DataSource(data_file=spa_file), tmp_path_factory.mktemp("mt") / "run", device="cpu")
    return run_dir


def _png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000


@pytest.mark.slow
def test_analyze_vit_run_writes_json_and_figures(vit_run, cifar_dir, tmp_path, cli):
    out = tmp_path / "an"
    result = cli(["analyze", vit_run, "--data-dir", cifar_dir, "--samples", "64", "--out", out])
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
def test_analyze_translation_run_json_format(mt_run, spa_file, tmp_path, cache_env, cli):
    out = tmp_path / "an"
    result = cli(["analyze", mt_run, "--data-file", spa_file, "--samples", "20", "--no-ablation", "--format", "json",
                  "--out", out])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data == {**json.loads((out / "analysis.json").read_text()), "uploaded": None}  # not a search trial
    names = [l["name"] for l in data["layers"]]
    assert names == ["encoder.blocks.0.attn", "encoder.blocks.1.attn", "decoder.blocks.0.self_attn", "decoder.blocks.0.cross_attn"]
    assert "ablation" not in data["layers"][0]
    assert data["pruning_curve"][0]["bleu"] == data["baseline"]
    assert _png(out / "cross_attention_sample0.png")
    assert (mt_run / "tokenizer_src.json").exists()  # the run's own vocabularies were used


def test_not_a_run_directory(tmp_path, cli):
    result = cli(["analyze", tmp_path])
    cli.error_line(result, "is not a run directory: expected config.yaml and model.safetensors")
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]


@pytest.mark.slow
def test_checkpoint_that_does_not_match_its_config(vit_run, cifar_dir, tmp_path, cli):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(vit_run, copy)
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["arch"]["d_ff"] = 96
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    result = cli(["analyze", copy, "--data-dir", cifar_dir, "--samples", "16"])
    # The line names the tensor that differs, not just torch's "Error(s) in loading state_dict for ViT:".
    line = cli.error_line(result, "does not match", "size mismatch for encoder.blocks.0.mlp.fc1")
    assert "Error(s) in loading state_dict" not in line
    assert not (copy / "analysis").exists()


def test_a_truncated_checkpoint_gets_one_line(vit_run, cifar_dir, tmp_path, cli):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(vit_run, copy)
    data = (copy / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    result = cli(["analyze", copy, "--data-dir", cifar_dir, "--samples", "16"])
    cli.error_line(result, "model.safetensors is truncated or corrupt")
    assert not (copy / "analysis").exists()


def test_out_naming_a_file_gets_one_line(vit_run, cifar_dir, tmp_path, cli):
    out = tmp_path / "taken"
    out.write_text("x")
    result = cli(["analyze", vit_run, "--data-dir", cifar_dir, "--out", out])
    cli.error_line(result, "--out", "is a file: give a folder")
    assert out.read_text() == "x"


def test_missing_data(vit_run, tmp_path, cli):
    result = cli(["analyze", vit_run, "--data-dir", tmp_path / "nowhere"])
    cli.error_line(result, "does not exist")


@pytest.mark.slow
def test_analysis_of_a_search_trial_is_uploaded_to_it(spa_file, tmp_path, monkeypatch, cache_env, tiny_translation,
                                                      write_yaml, cli):
    import optuna

    from headsearch.search.runner import Search, SearchSettings

    monkeypatch.chdir(tmp_path)
    space = write_yaml(tmp_path / "space.yaml", {"schedule": {"families": ["uniform"], "heads": [2]}, "skip": ["none"],
                                                 "fusion": ["none"], "fixed": tiny_translation})
    storage = f"sqlite:///{tmp_path / 'h.db'}"
    Search(SearchSettings(task="translation-en-es", space=str(space), trials=1, storage=storage, study="s",
                          data_file=str(spa_file), preset="tiny", run_root=str(tmp_path / "runs"))).run_worker()
    trial_dir = tmp_path / "runs" / "s" / "trial-00000"
    assert json.loads((trial_dir / "study.json").read_text())["trial"] == 0
    result = cli(["analyze", trial_dir, "--data-file", spa_file, "--samples", "10", "--no-ablation"])
    assert result.exit_code == 0, result.output
    assert "uploaded to s trial 0" in result.output
    study = optuna.load_study(study_name="s", storage=storage)
    metas = optuna.artifacts.get_all_artifact_meta(study)
    assert {"trial0-analysis.json", "trial0-pruning_curve.png"} <= {m.filename for m in metas}
