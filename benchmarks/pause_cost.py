"""Benchmark: what a paused trial costs (--pruner-pause, headsearch.training.pause): pause.pt on disk, and the
seconds to write it and read it back, against the best checkpoint (model.safetensors) every trial writes anyway.

A paused trial keeps its weights, its best weights, Adam's two moments, the step state and the random states;
one never resumed keeps them until the study is removed. Measured at the headline search's ViT (`headsearch run
--task vit-cifar10`, no preset: the deep-head space's schedules on it; the head count does not change the
parameters) and with a HAM fusion (its soft branch adds parameters), after one optimizer step (Adam's moments
exist from then on). The device's seconds are the host's: the state is moved to the CPU to be written.

    .venv/bin/python benchmarks/pause_cost.py
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from common import markdown_table, parser, report, resolve_device

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
    report("Pause checkpoint cost (--pruner-pause)", table, device, args, notes)


if __name__ == "__main__":
    main()
