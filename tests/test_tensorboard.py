"""`--tensorboard DIR` (the `tensorboard` extra): each epoch's record as TensorBoard scalars at step = epoch, equal
to what metrics.jsonl and the study's intermediate values hold; for `run` one TensorBoard run per trained trial
(DIR/trial-NNNNN), written by the worker that trained it (solo or in a cohort); without the package, one line."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import optuna
import pytest

TINY = ["--preset", "tiny", "--device", "cpu", "--set", "train.max_steps_per_epoch=1", "--set", "train.batch_size=16",
        "--set", "data.train_limit=64", "--set", "data.val_size=32", "--set", "data.test_limit=32"]


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the TensorBoard run in `log_dir`: [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def hparams_of(log_dir: Path) -> dict:
    """The hyperparameters the run's HPARAMS summary holds."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}


def f32(x: float) -> float:
    """A scalar as TensorBoard stores it (float32)."""
    return float(np.float32(x))


def expected_from_records(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What the writer should have written for these metrics.jsonl records."""
    out = {"train/loss": [], "train/lr": [], "time/epoch_seconds": []}
    before = 0.0
    for r in records:
        e = r["epoch"]
        out["train/loss"].append((e, f32(r["train_loss"])))
        out["train/lr"].append((e, f32(r["lr"])))
        out["time/epoch_seconds"].append((e, f32(r["train_seconds"] - before)))
        before = r["train_seconds"]
        for name, value in r["metrics"].items():
            out.setdefault(f"val/{name}", []).append((e, f32(value)))
    return out


def metrics_jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def check_trials(study, tb: Path) -> list:
    """Each trained trial of `study` has its own TensorBoard run equal to its metrics.jsonl and its intermediate
    values; nothing else is in `tb`. Returns the trained trials."""
    trained = [t for t in study.get_trials(deepcopy=False) if "run_dir" in t.user_attrs]
    assert trained
    assert sorted(p.name for p in tb.iterdir()) == sorted(f"trial-{t.number:05d}" for t in trained)
    for t in trained:
        got = scalars(tb / f"trial-{t.number:05d}")
        records = metrics_jsonl(t.user_attrs["run_dir"])
        assert got == expected_from_records(records), t.number
        assert [s for s, _ in got["val/accuracy"]] == list(range(1, len(records) + 1))  # step = epoch
        assert got["val/accuracy"] == [(e, f32(v)) for e, v in sorted(t.intermediate_values.items())]
        assert hparams_of(tb / f"trial-{t.number:05d}") == t.params
    return trained


def test_train_writes_each_epoch_as_metrics_jsonl_holds_it(cli, tmp_path, cifar_dir, one_thread, tensorboard_package):
    out, tb = tmp_path / "run", tmp_path / "tb"
    result = cli(["train", "--task", "vit-cifar10", "--data-dir", cifar_dir, "--out", out, "--epochs", "3", *TINY,
                  "--tensorboard", tb])
    assert result.exit_code == 0, result.output
    records = metrics_jsonl(out)
    assert [r["epoch"] for r in records] == [1, 2, 3]
    got = scalars(tb)
    assert got == expected_from_records(records)
    assert {"train/loss", "train/lr", "time/epoch_seconds", "val/accuracy"} <= set(got)
    assert hparams_of(tb)["skip"] == "none"  # the architecture's fields
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1  # one run, one file


@pytest.mark.processes
@pytest.mark.slow
def test_run_with_two_workers_writes_one_tensorboard_run_per_trial(cli, tmp_path, cifar_dir, one_thread,
                                                                    tensorboard_package):
    url, tb = f"sqlite:///{tmp_path / 'h.db'}", tmp_path / "tb"
    result = cli(["run", "--task", "vit-cifar10", "--space", "ham", "--data-dir", cifar_dir, "--storage", url,
                  "--run-root", tmp_path / "runs", "--pruner", "none", "--epochs", "2", "--trials", "3",
                  "--workers", "2", "--cohort", "1", *TINY, "--tensorboard", tb])
    assert result.exit_code == 0, result.output
    study = optuna.load_study(study_name="vit-cifar10-ham-tiny", storage=url)
    trained = check_trials(study, tb)
    assert len(trained) == 3 and all(t.state.name == "COMPLETE" for t in trained)
    # Written by the worker processes (not this one), each its own trials' runs.
    workers = {t.user_attrs["worker"] for t in trained}
    assert 1 <= len(workers) <= 2 and not any(w.endswith(f":{os.getpid()}") for w in workers)


@pytest.mark.slow
def test_a_cohort_writes_each_member_trials_own_run(tmp_path, cifar_dir, one_thread, tensorboard_package):
    """Trials trained as one stacked model (api.search, cohort=2): each slot's epochs go to its own trial's run."""
    from headsearch import api

    url, tb = f"sqlite:///{tmp_path / 'h.db'}", tmp_path / "tb"
    api.search("vit-cifar10", space="ham", trials=2, storage=url, data_dir=cifar_dir, preset="tiny", device="cpu",
               pruner="none", epochs=2, cohort=2, run_root=str(tmp_path / "runs"), heartbeat=0, tensorboard=tb,
               sets={"train": {"max_steps_per_epoch": 1, "batch_size": 16}, "data": {"train_limit": 64, "val_size": 32, "test_limit": 32}})
    study = optuna.load_study(study_name="vit-cifar10-ham-tiny", storage=url)
    trained = check_trials(study, tb)
    assert len(trained) == 2 and sorted(t.user_attrs["cohort"]["slot"] for t in trained) == [0, 1]  # trained together


def test_the_writer_comes_before_the_pruner():
    """So the epoch a pruner stops a trial at is written too."""
    from headsearch.search.runner import TrialRun
    from headsearch.training.tensorboard import TensorBoardWriter

    writer = TensorBoardWriter("unused")
    cfg = SimpleNamespace(train=SimpleNamespace(diversity_samples=0))
    run = TrialRun(trial=None, cfg=cfg, run_dir=Path("x"), pruning="pruning", clock=None, tensorboard=writer)
    assert run.trainer_callbacks(["display"]) == [writer, "pruning", "display"]
    assert writer.writer is None  # nothing opened (or written) before an epoch ends


def test_without_the_package_tensorboard_is_one_line_and_writes_nothing(cli, tmp_path, cifar_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    monkeypatch.chdir(tmp_path)
    tb = tmp_path / "tb"
    line = cli.error_line(cli(["train", "--task", "vit-cifar10", "--data-dir", cifar_dir, "--out", tmp_path / "run",
                               *TINY, "--tensorboard", tb]),
                          "--tensorboard", "tensorboard package", "pip install 'headsearch[tensorboard]'")
    assert line == ("error: --tensorboard needs the tensorboard package, which is not installed:"
                    " pip install 'headsearch[tensorboard]'")
    url = f"sqlite:///{tmp_path / 'h.db'}"
    cli.error_line(cli(["run", "--task", "vit-cifar10", "--space", "ham", "--data-dir", cifar_dir, "--storage", url,
                        "--run-root", tmp_path / "runs", "--workers", "2", *TINY, "--tensorboard", tb]),
                   "pip install 'headsearch[tensorboard]'")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run directory, study, trial or TensorBoard run


def test_a_file_for_dir_is_one_line(cli, tmp_path, cifar_dir, tensorboard_package):
    (tmp_path / "taken").write_text("")
    cli.error_line(cli(["train", "--task", "vit-cifar10", "--data-dir", cifar_dir, "--out", tmp_path / "run", *TINY,
                        "--tensorboard", tmp_path / "taken"]), "--tensorboard", "is a file")
    cli.error_line(cli(["run", "--task", "vit-cifar10", "--storage", f"sqlite:///{tmp_path / 'h.db'}",
                        "--tensorboard", tmp_path / "taken" / "tb"]), "which is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
