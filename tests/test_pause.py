"""A paused run goes on as if it had never stopped (headsearch.training.pause): on the CPU, a run paused after an
epoch and resumed in a fresh model, optimizer and data order equals the run trained straight through, bit for bit:
every epoch's loss, learning rate and validation metrics, the best checkpoint's bytes and the test figures."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from headsearch.errors import HeadsearchError
from headsearch.tasks import DataSource
from headsearch.training.pause import load_pause
from headsearch.training.records import PAUSE, Callback, PauseRun
from headsearch.training.steps import GraphSteps
from headsearch.training.trainer import CHECKPOINT, fit
from test_fastpath import GRAPHS, TRANSLATION, VIT, make_steps_for, translation_config, vit_config

# Timings differ between any two runs; everything else a record holds must not.
TIMINGS = {"train_seconds", "wall_seconds", "samples_per_s"}


class PauseAfter(Callback):
    """Pauses the run at the end of epoch `epoch`; counts the epochs it hears."""

    def __init__(self, epoch: int | None = None):
        self.epoch, self.heard = epoch, []

    def on_epoch_end(self, record) -> None:
        self.heard.append(record.epoch)
        if record.epoch == self.epoch:
            raise PauseRun(f"paused after epoch {record.epoch}")


def records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in lines]


def final(run_dir) -> dict:
    return json.loads((run_dir / "final.json").read_text())


def straight_and_paused(task, bound, tmp_path, pause_after: int):
    """The same run trained straight through (tmp_path/straight) and paused after `pause_after`, then resumed from
    a fresh binding of the data (tmp_path/paused). Returns (straight dir, paused dir, epochs the resumption heard)."""
    cpu = torch.device("cpu")
    straight, paused = tmp_path / "straight", tmp_path / "paused"
    straight.mkdir(), paused.mkdir()
    fit(task, bound.rebind(bound.cfg), device=cpu, run_dir=straight)
    with pytest.raises(PauseRun):
        fit(task, bound.rebind(bound.cfg), device=cpu, run_dir=paused, callbacks=[PauseAfter(pause_after)])
    assert final(paused)["status"] == "paused" and (paused / PAUSE).is_file()
    assert [r["epoch"] for r in records(paused)] == list(range(1, pause_after + 1))
    heard = PauseAfter()
    fit(task, bound.rebind(bound.cfg), device=cpu, run_dir=paused, callbacks=[heard], resume=True)
    return straight, paused, heard.heard


def assert_same_run(straight, paused, pause_after: int) -> None:
    assert records(paused) == records(straight)
    assert (paused / CHECKPOINT).read_bytes() == (straight / CHECKPOINT).read_bytes()
    got, want = final(paused), final(straight)
    assert got["resumed_at"] == pause_after and want["resumed_at"] is None
    for key in ("status", "epochs_run", "steps", "best_epoch", "best_value", "best_metrics", "test_metrics", "samples",
                "epoch_seconds_alone"):
        assert got[key] == want[key], key


def test_a_paused_vit_resumes_bit_for_bit(cifar, one_thread, tmp_path):
    """Dropout (torch's generator), a warm-up and cosine schedule (the scheduler's position), Adam's moments and
    the ViT's generator of shuffles and augmentations (carried across epochs) all matter here: leaving any of them
    out of the pause changes epochs 3 and 4."""
    cfg = vit_config({"epochs": 4, "warmup_epochs": 1.5, "schedule": "cosine", "min_lr_ratio": 0.1, "lr": 3e-3},
                     arch={"dropout": 0.1})
    bound = VIT.setup(cfg, cifar, "cpu")
    straight, paused, heard = straight_and_paused(VIT, bound, tmp_path, pause_after=2)
    assert heard == [3, 4]  # the resumption trained the epochs after the pause only
    assert_same_run(straight, paused, 2)


def test_a_paused_translation_resumes_bit_for_bit(spa_file, cache_env, one_thread, tmp_path):
    """Translation shuffles each epoch from (seed, epoch): it carries no data state, and resumes all the same."""
    cfg = translation_config({"epochs": 3, "max_steps_per_epoch": 6, "schedule": "cosine"})
    bound = TRANSLATION.setup(cfg, DataSource(data_file=spa_file), "cpu")
    straight, paused, heard = straight_and_paused(TRANSLATION, bound, tmp_path, pause_after=1)
    assert heard == [2, 3]
    assert_same_run(straight, paused, 1)


def test_a_resumption_that_died_midway_leaves_nothing_the_next_one_reads_twice(cifar, one_thread, tmp_path):
    """A resumption killed after writing epochs past the pause (metrics.jsonl lines, a better checkpoint): the next
    resumption writes both again from the pause, and ends as the straight run does."""
    cfg = vit_config({"epochs": 3})
    bound = VIT.setup(cfg, cifar, "cpu")
    cpu = torch.device("cpu")
    straight, paused = tmp_path / "straight", tmp_path / "paused"
    straight.mkdir(), paused.mkdir()
    fit(VIT, bound.rebind(cfg), device=cpu, run_dir=straight)
    with pytest.raises(PauseRun):
        fit(VIT, bound.rebind(cfg), device=cpu, run_dir=paused, callbacks=[PauseAfter(1)])

    class Dies(Callback):
        def on_epoch_end(self, record) -> None:
            raise KeyboardInterrupt  # after epoch 2 was kept: its line and maybe its checkpoint are on disk

    with pytest.raises(KeyboardInterrupt):
        fit(VIT, bound.rebind(cfg), device=cpu, run_dir=paused, callbacks=[Dies()], resume=True)
    assert [r["epoch"] for r in records(paused)] == [1, 2]
    fit(VIT, bound.rebind(cfg), device=cpu, run_dir=paused, resume=True)
    assert_same_run(straight, paused, 1)


def test_graph_steps_load_a_pause_into_their_own_tensors(cifar):
    """GraphSteps' optimizer reads its learning rate from `lr_tensor` and a captured graph reads the moments by
    address: a resumed GraphSteps keeps both tensors, with the saved values in them, and then steps as the
    uninterrupted one does (the CPU runs the same step uncaptured)."""
    cfg = vit_config({"max_steps_per_epoch": 8, "warmup_epochs": 0.5, "schedule": "cosine", "lr": 3e-3},
                     data={"train_limit": 1000})
    bound = VIT.setup(cfg, cifar, "cpu")
    batches = list(itertools.islice(bound.train_batches(1), 8))
    first = make_steps_for(GraphSteps, bound, cfg, GRAPHS)
    first.warm_up(batches[:1])
    for batch in batches[:4]:
        first.step(batch)
    saved, weights = first.state_dict(), first.model.state_dict()

    second = make_steps_for(GraphSteps, bound, cfg, GRAPHS)
    second.warm_up(batches[:1])
    moments = {id(v) for state in second.optimizer.state.values() for v in state.values()}
    second.model.load_state_dict(weights)
    second.load_state_dict(saved)
    assert second.optimizer.param_groups[0]["lr"] is second.lr_tensor
    assert {id(v) for state in second.optimizer.state.values() for v in state.values()} == moments
    assert second.steps_taken == 4 and int(second.state.step) == 4
    for batch in batches[4:]:
        first.step(batch), second.step(batch)
        assert torch.equal(first.state.last_loss, second.state.last_loss)
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), second.model.parameters()))


def test_a_missing_or_foreign_pause_is_one_line(tmp_path):
    cpu = torch.device("cpu")
    with pytest.raises(HeadsearchError, match="no paused run to resume here"):
        load_pause(tmp_path / PAUSE, cpu)
    (tmp_path / PAUSE).write_bytes(b"not a checkpoint")
    with pytest.raises(HeadsearchError, match="not a paused run's state") as got:
        load_pause(tmp_path / PAUSE, cpu)
    assert "\n" not in str(got.value)
    torch.save({"format": 99}, tmp_path / PAUSE)
    with pytest.raises(HeadsearchError, match="another format"):
        load_pause(tmp_path / PAUSE, cpu)
