"""The training library (`headsearch.training.train_run` / `trainer.fit`) on tiny slices of the real data.

CIFAR-10 is read from disk once for the fully real run and once more (module-scoped) for the other
ViT runs, which get those same real arrays through a patched `load_cifar10` instead of re-reading
the shards each time.
"""
import json
import math
from importlib import metadata
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import headsearch
from headsearch.errors import Diverged
from headsearch.models import ViT
from headsearch.tasks import DataSource, apply_overrides, get_task, resolve_config
from headsearch.tasks.translation_data import read_parallel_tsv
from headsearch.training import train_run
from headsearch.training.steps import lr_multiplier
from headsearch.training.trainer import Callback

VIT = get_task("vit-cifar10")
TRANSLATION = get_task("translation-en-es")

# 2 epochs x 5 steps of 64 images on 2,000 training images; 200 validation and 500 test images.
VIT_TINY = {
    "seed": 0,
    "train": {"epochs": 2, "max_steps_per_epoch": 5, "batch_size": 64},
    "data": {"train_limit": 2000, "val_size": 200, "test_limit": 500},
}
RUN_FILES = {"config.yaml", "command.txt", "env.json", "metrics.jsonl", "final.json", "model.safetensors", "split.json"}


def vit_config(**changes) -> "headsearch.config.RunConfig":
    """VIT_TINY with some sections changed: vit_config(train={"lr": 1e6}, seed=1)."""
    over = {k: dict(v) if isinstance(v, dict) else v for k, v in VIT_TINY.items()}
    for key, value in changes.items():
        if isinstance(value, dict):
            over[key].update(value)
        else:
            over[key] = value
    return apply_overrides(VIT, resolve_config(VIT), over)


def read_json(path: Path):
    return json.loads(path.read_text())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def vit_run(cifar_dir, tmp_path_factory):
    """One fully real run: the shards are read from disk by the task itself."""
    cfg = vit_config()
    out = tmp_path_factory.mktemp("vit") / "run"
    run_dir, result = train_run(cfg, DataSource(data_dir=cifar_dir), out, device="cpu",
                                argv=["headsearch", "train", "--task", "vit-cifar10"])
    return cfg, run_dir, result


def metric_values(run_dir: Path) -> list[dict]:
    """What metrics.jsonl records per epoch, timings (which differ run to run) left out."""
    return [{k: r[k] for k in ("epoch", "step", "train_loss", "lr", "metrics")} for r in read_jsonl(run_dir / "metrics.jsonl")]


# --------------------------------------------------------------------------------- the run directory


@pytest.mark.slow
def test_run_directory_holds_exactly_the_run_files(vit_run):
    _, run_dir, _ = vit_run
    assert {p.name for p in run_dir.iterdir()} == RUN_FILES  # no temporary files left behind either


def test_config_yaml_round_trips_to_an_equal_run_config(vit_run):
    cfg, run_dir, _ = vit_run
    assert resolve_config("vit-cifar10", config=run_dir / "config.yaml") == cfg
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["max_steps_per_epoch"] == 5


def test_command_and_environment_are_recorded(vit_run):
    _, run_dir, _ = vit_run
    assert (run_dir / "command.txt").read_text() == "headsearch train --task vit-cifar10\n"
    versions = read_json(run_dir / "env.json")["versions"]
    assert versions["torch"] == metadata.version("torch")  # the installed distribution
    assert torch.__version__.startswith(versions["torch"])
    assert versions["headsearch"] == headsearch.__version__ == metadata.version("headsearch")


def test_metrics_jsonl_has_one_line_per_epoch(vit_run):
    _, run_dir, result = vit_run
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["epoch"] for r in records] == [1, 2]
    assert [r["step"] for r in records] == [5, 10]
    for r in records:
        assert 0.0 <= r["metrics"]["accuracy"] <= 1.0
        assert math.isfinite(r["train_loss"]) and r["train_loss"] > 0
        assert r["samples_per_s"] > 0
    assert records[0]["train_seconds"] < records[1]["train_seconds"]  # cumulative
    assert [r["metrics"] for r in records] == [h.metrics for h in result.history]


def test_final_json_reports_the_completed_run(vit_run):
    cfg, run_dir, result = vit_run
    final = read_json(run_dir / "final.json")
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert final["status"] == "completed"
    assert final["error"] is None
    assert final["primary_metric"] == "accuracy"
    assert final["epochs_run"] == 2 and final["steps"] == 10
    assert final["samples"] == 2 * 5 * 64
    assert final["best_epoch"] in (1, 2)
    best = records[final["best_epoch"] - 1]["metrics"]
    assert final["best_value"] == best["accuracy"] == max(r["metrics"]["accuracy"] for r in records)
    assert 0.0 <= final["test_metrics"]["accuracy"] <= 1.0
    assert final["params"] > 0
    assert final["params"] == sum(p.numel() for p in ViT(cfg.arch).parameters())
    assert final["samples_per_s"] > 0
    assert final["samples_per_s"] == pytest.approx(final["samples"] / final["train_seconds"])
    assert final["test_metrics"] == result.test_metrics


def test_split_json_records_the_split(vit_run):
    _, run_dir, _ = vit_run
    split = read_json(run_dir / "split.json")
    assert (split["seed"], split["train"], split["val"], split["test"]) == (0, 2000, 200, 500)
    assert len(split["val_indices"]) == len(set(split["val_indices"])) == 200


def test_checkpoint_reloads_strictly_and_reproduces_the_test_accuracy(vit_run, cifar):
    cfg, run_dir, _ = vit_run
    model = ViT(cfg.arch)
    model.load_state_dict(load_file(str(run_dir / "model.safetensors")), strict=True)
    model.eval()
    bound = VIT.setup(cfg, cifar, "cpu")
    with torch.no_grad():
        test = bound.evaluate(model, "test")
    final = read_json(run_dir / "final.json")
    assert test["accuracy"] == final["test_metrics"]["accuracy"]
    assert test["loss"] == pytest.approx(final["test_metrics"]["loss"], rel=1e-5)


# ------------------------------------------------------------------------------------- determinism


@pytest.mark.slow
def test_same_seed_gives_identical_metrics_and_another_seed_does_not(vit_run, cifar, tmp_path):
    cfg, first_dir, _ = vit_run
    again, _ = train_run(cfg, cifar, tmp_path / "again", device="cpu", argv=["test"])
    assert metric_values(again) == metric_values(first_dir)
    other, _ = train_run(cfg.replace(seed=1), cifar, tmp_path / "seed1", device="cpu", argv=["test"])
    assert metric_values(other) != metric_values(first_dir)
    assert [r["train_loss"] for r in metric_values(other)] != [r["train_loss"] for r in metric_values(first_dir)]


# -------------------------------------------------------------------------------- how runs end early


def test_a_huge_learning_rate_raises_diverged_naming_the_step(cifar, tmp_path):
    cfg = vit_config(train={"lr": 1e6})
    with pytest.raises(Diverged) as info:
        train_run(cfg, cifar, tmp_path / "run", device="cpu", argv=["test"])
    err = info.value
    assert isinstance(err.step, int) and not isinstance(err.step, bool) and err.step > 0
    assert err.step <= 10  # within the 2 x 5 steps of the run
    assert f"step {err.step}" in str(err)
    final = read_json(tmp_path / "run" / "final.json")
    assert final["status"] == "diverged"
    assert f"step {err.step}" in final["error"]


class Halt(Exception):
    pass


class HaltAtEpoch(Callback):
    def __init__(self, epoch: int):
        self.epoch = epoch
        self.seen: list[int] = []

    def on_epoch_end(self, record) -> None:
        self.seen.append(record.epoch)
        if record.epoch == self.epoch:
            raise Halt(f"halted at epoch {record.epoch}")


def test_a_callback_stopping_the_run_keeps_the_finished_work(cifar, tmp_path):
    cfg = vit_config(train={"epochs": 4})
    halt = HaltAtEpoch(2)
    with pytest.raises(Halt, match="halted at epoch 2"):
        train_run(cfg, cifar, tmp_path / "run", device="cpu", argv=["test"], callbacks=[halt])
    assert halt.seen == [1, 2]
    run_dir = tmp_path / "run"
    final = read_json(run_dir / "final.json")
    assert final["status"] == "stopped"
    assert "Halt" in final["error"]
    assert final["epochs_run"] == 2
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 2
    assert (run_dir / "model.safetensors").is_file()
    ViT(cfg.arch).load_state_dict(load_file(str(run_dir / "model.safetensors")), strict=True)


# ------------------------------------------------------------------------------- seconds to target


@pytest.mark.slow
def test_seconds_to_target(cifar, tmp_path):
    reached_dir, reached = train_run(vit_config(train={"target": 0.0}), cifar, tmp_path / "reached",
                                     device="cpu", argv=["test"])
    first = read_jsonl(reached_dir / "metrics.jsonl")[0]
    assert reached.seconds_to_target == reached.history[0].train_seconds == first["train_seconds"]
    assert reached.seconds_to_target < reached.train_seconds  # the first epoch, not the last
    assert read_json(reached_dir / "final.json")["seconds_to_target"] == first["train_seconds"]

    never_dir, never = train_run(vit_config(train={"target": 1.01}), cifar, tmp_path / "never",
                                 device="cpu", argv=["test"])
    assert never.seconds_to_target is None
    final = read_json(never_dir / "final.json")
    assert final["seconds_to_target"] is None and final["target"] == 1.01


# ------------------------------------------------------------------------------------- lr schedule


def test_warmup_is_linear():
    # 4 warm-up steps of 100: (s + 1) / 4.
    assert [lr_multiplier(s, 100, 4, "cosine", 0.0) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert [lr_multiplier(s, 100, 4, "constant", 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_constant_schedule_without_warmup_is_one():
    assert {lr_multiplier(s, 50, 0, "constant", 0.3) for s in range(60)} == {1.0}


def test_cosine_goes_from_one_to_min_ratio():
    # 10 warm-up steps, then 100 cosine steps from s = 10 to s = 110.
    assert lr_multiplier(10, 110, 10, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_multiplier(60, 110, 10, "cosine", 0.1) == pytest.approx(0.55)  # 0.5 * (1 + 0.1) half way
    assert lr_multiplier(110, 110, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_multiplier(500, 110, 10, "cosine", 0.1) == pytest.approx(0.1)  # stays at the floor
    # A quarter of the way: 0.1 + 0.9 * 0.5 * (1 + cos(pi / 4)) = 0.1 + 0.45 * 1.70711
    assert lr_multiplier(35, 110, 10, "cosine", 0.1) == pytest.approx(0.868198, abs=1e-6)
    # No warm-up, min 0: 0.5 at half way, 0 at the end.
    assert lr_multiplier(0, 8, 0, "cosine", 0.0) == pytest.approx(1.0)
    assert lr_multiplier(4, 8, 0, "cosine", 0.0) == pytest.approx(0.5)
    assert lr_multiplier(8, 8, 0, "cosine", 0.0) == pytest.approx(0.0, abs=1e-12)


def test_cosine_is_monotone_after_warmup():
    values = [lr_multiplier(s, 110, 10, "cosine", 0.2) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert min(values) == pytest.approx(0.2)


# ------------------------------------------------------------------------------------- translation

TRANSLATION_TINY = {
    "seed": 0,
    "arch": {"d_model": 32, "enc_layers": 1, "enc_heads": 4, "dec_layers": 1, "dec_heads": 4, "d_ff": 64},
    "train": {"epochs": 1, "max_steps_per_epoch": 5, "batch_size": 64},
    "data": {"train_limit": 2000, "val_size": 50, "test_size": 100, "max_len": 16, "vocab_size": 2000},
}


@pytest.fixture(scope="module")
def translation_run(spa_file, tmp_path_factory):
    cfg = apply_overrides(TRANSLATION, resolve_config(TRANSLATION), TRANSLATION_TINY)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HEADSEARCH_CACHE", str(tmp_path_factory.mktemp("cache")))
        run_dir, result = train_run(cfg, DataSource(data_file=spa_file), tmp_path_factory.mktemp("tr") / "run",
                                    device="cpu", argv=["test"])
    return cfg, run_dir, result


def test_translation_run_writes_tokenizers_and_split(translation_run):
    from tokenizers import Tokenizer

    _, run_dir, _ = translation_run
    assert RUN_FILES | {"tokenizer_src.json", "tokenizer_tgt.json", "test_translations.tsv", "bleu_signature.txt"} == {
        p.name for p in run_dir.iterdir()}
    for side in ("src", "tgt"):
        tok = Tokenizer.from_file(str(run_dir / f"tokenizer_{side}.json"))
        assert 10 < tok.get_vocab_size() <= 2000
    split = read_json(run_dir / "split.json")
    assert len(split["val_indices"]) == 50 and len(split["test_indices"]) == 100
    assert not set(split["val_indices"]) & set(split["test_indices"])
    assert split["train"] == 2000


def test_translation_run_writes_test_translations_and_metrics(translation_run, spa_file):
    _, run_dir, result = translation_run
    lines = (run_dir / "test_translations.tsv").read_text().splitlines()
    assert lines[0] == "source\treference\thypothesis"
    assert len(lines) == 101
    assert all(line.count("\t") == 2 for line in lines)
    # The test pairs are the ones split.json names, in that order.
    corpus = read_parallel_tsv(spa_file)
    test_idx = read_json(run_dir / "split.json")["test_indices"]
    assert [line.split("\t")[:2] for line in lines[1:]] == [[corpus.src[i], corpus.tgt[i]] for i in test_idx]

    assert "nrefs:1" in (run_dir / "bleu_signature.txt").read_text()
    final = read_json(run_dir / "final.json")
    assert final["status"] == "completed" and final["primary_metric"] == "bleu"
    test = final["test_metrics"]
    assert {"bleu", "cer", "wer"} <= set(test)
    assert 0.0 <= test["bleu"] <= 100.0 and test["cer"] >= 0.0 and test["wer"] >= 0.0
    assert test == result.test_metrics
