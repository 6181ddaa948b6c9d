"""The size guard's arithmetic (headsearch.models.size): the parameter count it gives before a model
exists is exactly what the built model holds, and the guard turns an absurd architecture into one line
with the estimate, before anything is created."""
from __future__ import annotations

import pytest

from headsearch.config import ArchConfig
from headsearch.models import Seq2Seq, ViT
from headsearch.models.size import FLOAT_BYTES, Footprint, seq2seq_footprint, vit_footprint

VIT_ARCHS = {
    "HAM's reference ViT": dict(),
    "halving heads, output skip": dict(enc_heads=[8, 4, 2, 1], skip="output"),
    "HAM A, scores skip": dict(fusion="hadamard", skip="scores"),
    "HAM B, key scores, fixed head width, 8x8 patches": dict(fusion="add", soft_score="key", soft_dim=5, head_dim=16, patch_size=8),
    "two layers, wider MLP": dict(d_model=64, enc_layers=2, enc_heads=[2, 4], d_ff=100, skip="output", fusion="add"),
}


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("fields", VIT_ARCHS.values(), ids=VIT_ARCHS.keys())
def test_vit_parameter_count_is_exact(fields):
    arch = ArchConfig(**fields)
    assert vit_footprint(arch, batch=1).params == n_params(ViT(arch))


@pytest.mark.parametrize("fields", [
    dict(d_model=32, enc_layers=2, dec_layers=2, dec_heads=[2, 4], d_ff=64, skip="output", fusion="hadamard"),
    dict(d_model=48, enc_layers=3, enc_heads=[6, 3, 1], dec_layers=1, dec_heads=2, d_ff=96, skip="scores", fusion="add", soft_score="key"),
], ids=["output skip, HAM A", "scores skip, HAM B"])
def test_seq2seq_parameter_count_is_exact(fields):
    arch = ArchConfig(**fields)
    assert seq2seq_footprint(arch, batch=1, src_vocab=100, tgt_vocab=120, max_len=16).params == n_params(Seq2Seq(arch, 100, 120, 16, 0))


def test_activations_by_hand_for_one_layer():
    # One layer, d=8, 2 heads of 4 (width 8), d_ff 16, 4x4 patches of a 32-pixel image: 65 tokens.
    arch = ArchConfig(d_model=8, enc_layers=1, enc_heads=2, d_ff=16, patch_size=4)
    t = 65
    per_layer = t * (4 * 8 + 4 * 8 + 2 * 16) + 2 * 2 * t * t  # tokens x (norms, q/k/v + context, MLP) + scores and probabilities
    embedded = t * 8
    fp = vit_footprint(arch, batch=3)
    assert fp.activation_bytes == 3 * (per_layer + embedded) * FLOAT_BYTES
    assert fp.training_bytes == fp.params * 16 + fp.activation_bytes


def test_footprint_describes_itself_in_readable_units():
    text = Footprint(params=1_000_000, activation_bytes=3 * 2**30).describe()
    assert "1,000,000 parameters" in text and "15.3 MiB" in text and "3.00 GiB" in text


def test_an_absurd_architecture_is_refused_with_the_estimate_before_anything_exists(cli, tmp_path, cifar_dir, write_yaml):
    config = write_yaml(tmp_path / "big.yaml", {"d_model": 1_000_000, "enc_heads": 4})
    out = tmp_path / "run"
    result = cli(["train", "--task", "vit-cifar10", "--config", config, "--data-dir", cifar_dir, "--out", out, "--device", "cpu"])
    line = cli.error_line(result, "this architecture needs about", "parameters", "GiB", "but cpu has", "lower d_model")
    assert "16,001,699,000,778 parameters" in line  # the exact count for this config (test above: exact)
    assert not out.exists()


def test_a_search_rejects_a_sampled_architecture_too_big_for_the_device(tmp_path, cifar_dir, write_yaml):
    """The base config fits, so the search starts; a sampled d_model that cannot fit is rejected (never
    trained) with the guard's message, like any invalid combination."""
    import optuna

    from headsearch.errors import ConfigError
    from headsearch.search.runner import Search, SearchSettings
    from headsearch.training.trainer import resolve_device

    space = write_yaml(tmp_path / "space.yaml", {"schedule": {"heads": [4]}, "ranges": {"d_model": [48, 4_000_000]}})
    search = Search(SearchSettings(task="vit-cifar10", space=str(space), preset="tiny", data_dir=str(cifar_dir),
                                   device="cpu", run_root=str(tmp_path / "runs")))
    trial = optuna.trial.FixedTrial({"d_model": 4_000_000, "schedule": "uniform", "heads": 4, "skip": "none", "fusion": "none"})
    with pytest.raises(ConfigError, match="this architecture needs about"):
        search.sample_config(trial, resolve_device("cpu"))
    small = optuna.trial.FixedTrial({"d_model": 48, "schedule": "uniform", "heads": 4, "skip": "none", "fusion": "none"})
    assert search.sample_config(small, resolve_device("cpu")).arch.d_model == 48
