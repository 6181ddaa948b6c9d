"""Learning really happens: the `tiny` presets, trained on the real data through the command line,
reach a quality far above chance, and their validation metric improves from the first epoch to the best.

Other tests only check that metrics lie in their ranges; a model that never learns (a detached loss,
a zero learning rate, shuffled labels, a broken decoder) passes those and fails these.

Each test runs the full `tiny` preset (its data and its epochs) in-process through `headsearch train`,
as a user would, and reads the run directory's `final.json` and `metrics.jsonl`. Runs are
deterministic for a seed on a given CPU; the thresholds leave wide margins for other CPUs and torch
versions while staying far above what an untrained model scores.

Measured on this project's 2-core CPU (shared, torch on its default threads), seed defaults:
- vit-cifar10 tiny (20,000 training images x 6 epochs, 119,194 parameters): validation accuracy
  0.234 at epoch 1 -> 0.5165 at epoch 6 (the best), test accuracy 0.5008; 113 s for the command.
- translation-en-es tiny (24,000 Tatoeba pairs x 5 epochs, 1.37 M parameters): validation BLEU
  0.16 at epoch 1 -> 11.64 at epoch 5 (the best), test BLEU 13.80; 152 s for the command (tokenizers
  trained included). With `--epochs 3` the test BLEU falls to 5.4, so the full preset is kept.
Under pytest on the idle machine: 97 s and 103 s (3 min 20 s for the file). Both numbers grow several
times when other work shares the two cores (the ViT took 448 s once beside another test run).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from headsearch.cli.main import app

WIDE = {"COLUMNS": "240"}  # Rich wraps its tables at 80 columns when the output is not a terminal


def train(*args) -> Path:
    """`headsearch train ARGS --device cpu` in-process; returns the run directory (the `--out` value)."""
    args = [str(a) for a in args]
    result = CliRunner().invoke(app, ["train", *args, "--device", "cpu"], env=WIDE)
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr, result.exception)
    run_dir = Path(args[args.index("--out") + 1])
    assert (run_dir / "final.json").is_file(), f"no final.json in {run_dir}: {result.stdout}"
    return run_dir


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """(final.json, the lines of metrics.jsonl in epoch order)."""
    final = json.loads((run_dir / "final.json").read_text())
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return final, sorted(epochs, key=lambda e: e["epoch"])


def assert_completed_and_improved(final: dict, epochs: list[dict], metric: str, min_gain: float) -> None:
    """The run finished every epoch; the best epoch is one of them, its validation `metric` is the
    maximum of the curve and at least `min_gain` above epoch 1's."""
    assert final["status"] == "completed", final
    assert final["error"] is None, final["error"]
    assert [e["epoch"] for e in epochs] == list(range(1, final["epochs_run"] + 1))
    curve = {e["epoch"]: e["metrics"][metric] for e in epochs}
    best_epoch = final["best_epoch"]
    assert best_epoch in curve, (best_epoch, curve)
    assert final["best_metrics"][metric] == pytest.approx(curve[best_epoch])
    assert curve[best_epoch] == pytest.approx(max(curve.values()))
    assert curve[best_epoch] - curve[1] >= min_gain, f"validation {metric} by epoch: {curve}"


@pytest.mark.slow
def test_tiny_vit_learns_cifar10(cifar_dir, tmp_path):
    """The tiny ViT preset on the real CIFAR-10 shards classifies far above chance (0.10).

    Asserts: the run completes; test accuracy >= 0.35 and best validation accuracy >= 0.35; the
    validation accuracy at the best epoch is at least 0.10 above epoch 1's (and the best epoch is the
    curve's maximum).
    Measured (2-core CPU, full tiny preset: 20,000 images x 6 epochs): validation accuracy 0.234 at
    epoch 1 -> 0.5165 at epoch 6 (best), test accuracy 0.5008; 97-113 s on an idle machine.
    """
    run_dir = train("--task", "vit-cifar10", "--preset", "tiny", "--data-dir", cifar_dir, "--out", tmp_path / "run")
    final, epochs = read_run(run_dir)

    assert_completed_and_improved(final, epochs, "accuracy", min_gain=0.10)
    assert final["best_metrics"]["accuracy"] >= 0.35, final["best_metrics"]
    assert final["test_metrics"]["accuracy"] >= 0.35, final["test_metrics"]


@pytest.mark.slow
def test_tiny_translation_learns_en_es(spa_file, tmp_path, monkeypatch):
    """The tiny translation preset on the real Tatoeba English-Spanish file translates: corpus BLEU
    far above 0 (an untrained or broken decoder scores ~0; epoch 1 scored 0.16).

    Asserts: the run completes; test BLEU >= 5 and best validation BLEU >= 5; the validation BLEU at
    the best epoch is at least 3 points above epoch 1's (and the best epoch is the curve's maximum).
    Measured (2-core CPU, full tiny preset: 24,000 pairs x 5 epochs): validation BLEU 0.16 at epoch 1
    -> 11.64 at epoch 5 (best), test BLEU 13.80 (CER 0.54, WER 0.69); 103-152 s, tokenizers included.
    """
    monkeypatch.setenv("HEADSEARCH_CACHE", str(tmp_path / "cache"))
    run_dir = train("--task", "translation-en-es", "--preset", "tiny", "--data-file", spa_file,
                    "--out", tmp_path / "run")
    final, epochs = read_run(run_dir)

    assert_completed_and_improved(final, epochs, "bleu", min_gain=3.0)
    assert final["best_metrics"]["bleu"] >= 5.0, final["best_metrics"]
    assert final["test_metrics"]["bleu"] >= 5.0, final["test_metrics"]
