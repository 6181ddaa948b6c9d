"""Benchmark: what a paused trial costs (--pruner-pause, headsearch.training.pause): pause.pt on disk, and the
seconds to write it and read it back, against the best checkpoint (model.safetensors) every trial writes anyway.

A paused trial keeps its weights, its best weights, Adam's two moments, the step state and the random states;
one never resumed keeps them until the study is removed. Measured at the headline search's ViT (`headsearch run
--task vit-cifar10`, no preset: the deep-head space's schedules on it; the head count does not change the
parameters) and with a HAM fusion (its soft branch adds parameters), after one optimizer step (Adam's moments
exist from then on). The device's seconds are the host's: the state is moved to the CPU to be written.

It also checks, on the device, that a paused run goes on as if it had never stopped: a tiny ViT on real CIFAR-10
($HEADSEARCH_DATA/cifar10) trained straight through, and the same run paused after its first epoch and resumed in a
fresh model, optimizer and data binding, with the preset's step mode on that device. On the CPU the two are equal
bit for bit (tests/test_pause.py); on a GPU the table says whether they are, or by how much they differ.

    .venv/bin/python benchmarks/pause_cost.py
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from common import DATA, ROOT, markdown_table, parser, report, resolve_device

VARIANTS = {"seed ViT (fusion none)": {}, "HAM B (fusion add)": {"fusion": "add"}}


def paused_model(arch_overrides: dict, device):
    """A headline ViT after one optimizer step, with its steps: what a trial paused at a rung holds."""
    import torch

    from headsearch.models import ViT
    from headsearch.tasks import apply_overrides, get_task, resolve_config
    from headsearch.training.fastpath import StepMode
    from headsearch.training.steps import EagerSteps

    task = get_task("vit-cifar10")
    cfg = apply_overrides(task, resolve_config(task), {"arch": arch_overrides})
    model = ViT(cfg.arch, image_size=32, in_chans=3, num_classes=10).to(device)
    steps = EagerSteps(model, model, SimpleNamespace(), cfg.train, device, StepMode("off", None, False), 100)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    steps.optimizer.step()
    return model, steps


def measure(name: str, overrides: dict, device, repeats: int) -> list:
    from headsearch.training.pause import load_pause, save_pause
    from headsearch.training.records import TrainResult
    from headsearch.training.rundir import save_checkpoint

    model, steps = paused_model(overrides, device)
    params = sum(p.numel() for p in model.parameters())
    best = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result = TrainResult(status="paused", primary_metric="accuracy", params=params)
    saves, loads, checkpoints = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        pause, checkpoint = Path(tmp) / "pause.pt", Path(tmp) / "model.safetensors"
        for _ in range(repeats):
            start = time.perf_counter()
            save_pause(pause, epoch=3, model=model, steps=steps, bound=SimpleNamespace(), result=result,
                       best_state=best, wall_seconds=1.0)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            load_pause(pause, device)
            loads.append(time.perf_counter() - start)
            start = time.perf_counter()
            save_checkpoint(best, checkpoint)
            checkpoints.append(time.perf_counter() - start)
        size, reference = pause.stat().st_size, checkpoint.stat().st_size
    return [name, f"{params:,}", f"{size / 1e6:.2f}", f"{reference / 1e6:.2f}", f"{size / reference:.1f}x",
            f"{statistics.median(saves) * 1e3:.0f}", f"{statistics.median(loads) * 1e3:.0f}",
            f"{statistics.median(checkpoints) * 1e3:.0f}"]


# Timings differ between any two runs; everything else an epoch's record holds must not.
TIMINGS = {"train_seconds", "wall_seconds", "samples_per_s"}
RESUME_RUN = {"seed": 0, "train": {"epochs": 3}, "data": {"train_limit": 1024, "val_size": 512, "test_limit": 512}}


def epoch_records(run_dir: Path) -> list[dict]:
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in lines]


def flat(record: dict, prefix: str = "") -> dict:
    """{"metrics": {"accuracy": 0.2}} as {"metrics.accuracy": 0.2}."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def largest_difference(a: list[dict], b: list[dict]) -> tuple[float, str]:
    """The largest |difference| between two runs' epoch records, and the field it is in ("" when equal)."""
    worst, where = 0.0, ""
    for x, y in zip(map(flat, a), map(flat, b)):
        for key in x.keys() | y.keys():
            u, v = x.get(key), y.get(key)
            if isinstance(u, (int, float)) and isinstance(v, (int, float)):
                gap = abs(float(u) - float(v))
            else:
                gap = 0.0 if u == v else float("inf")
            if gap > worst:
                worst, where = gap, f"{key}, epoch {x.get('epoch')}"
    return worst, where


def resume_check(device) -> list:
    """A tiny ViT trained straight, and paused after epoch 1 then resumed: whether the resumed run equals it."""
    from headsearch.tasks import DataSource, apply_overrides, get_task, resolve_config
    from headsearch.training.records import Callback, PauseRun
    from headsearch.training.trainer import fit

    class PauseAfterFirst(Callback):
        def on_epoch_end(self, record) -> None:
            if record.epoch == 1:
                raise PauseRun("paused after epoch 1")

    task = get_task("vit-cifar10")
    cfg = apply_overrides(task, resolve_config(task, preset="tiny"), RESUME_RUN)
    bound = task.setup(cfg, DataSource(data_dir=DATA / "cifar10"), device)
    with tempfile.TemporaryDirectory() as tmp:
        straight, paused = Path(tmp) / "straight", Path(tmp) / "paused"
        straight.mkdir(), paused.mkdir()
        want = fit(task, bound.rebind(bound.cfg), device=device, run_dir=straight)
        try:
            fit(task, bound.rebind(bound.cfg), device=device, run_dir=paused, callbacks=[PauseAfterFirst()])
            raise RuntimeError("the run was not paused")
        except PauseRun:
            pass
        got = fit(task, bound.rebind(bound.cfg), device=device, run_dir=paused, resume=True)
        a, b = epoch_records(straight), epoch_records(paused)
        same_bytes = (straight / "model.safetensors").read_bytes() == (paused / "model.safetensors").read_bytes()
    gap, where = largest_difference(a, b)
    verdict = ("equal, bit for bit" if gap == 0 and len(a) == len(b) and same_bytes else
               f"{len(b)} of {len(a)} epochs; largest difference {gap:.3g} ({where}); best checkpoint"
               f" {'equal' if same_bytes else 'differs'}")
    return [f"tiny ViT, {cfg.train.epochs} epochs, paused after epoch 1", verdict,
            f"{want.best_value:.4f}", f"{got.best_value:.4f}"]


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    device = resolve_device(args.device)
    repeats = 3 if args.quick else 7
    rows = [measure(name, overrides, device, repeats) for name, overrides in VARIANTS.items()]
    table = markdown_table(["headline ViT", "params", "pause.pt MB", "model.safetensors MB", "ratio", "write ms",
                            "read ms", "best checkpoint write ms"], rows)
    largest = max(float(r[2]) for r in rows)
    notes = [f"a search of 39 architectures all paused and never resumed keeps at most {39 * largest:.0f} MB of pauses"
             " (a resumed run's pause is removed when it completes)",
             f"median of {repeats} writes and reads each; the pause is written once per paused trial, at its rung"]
    print(table, flush=True)  # before the resumed run's check: a step cut short on a GPU still shows the cost
    check = markdown_table(["resumed run (straight run's data, seed, steps)", "resumed against straight",
                            "best accuracy straight", "best accuracy resumed"], [resume_check(device)])
    notes.append(f"the resumed run: real CIFAR-10 ({os.path.relpath(DATA / 'cifar10', ROOT)}), preset tiny, {RESUME_RUN}; records compared"
                 " without their timings, and the best checkpoint's bytes")
    report("Pause checkpoint cost (--pruner-pause)", table + "\n\n" + check, device, args, notes)


if __name__ == "__main__":
    main()
