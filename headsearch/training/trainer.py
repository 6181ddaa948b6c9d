"""One training loop for every task.

After each epoch it evaluates on the validation split and hands an `EpochRecord` to the callbacks
(a search prunes by raising from `on_epoch_end`). It records the convergence figures a search
optimises: epoch and seconds of the best validation metric, seconds to reach a target, throughput,
parameter count. The best checkpoint is kept (atomically) in the run directory as it improves, and
the final test figure is measured on it.
"""
from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from headsearch.config import RunConfig, TrainConfig
from headsearch.errors import ConfigError, Diverged
from headsearch.tasks import BoundTask, Task
from headsearch.training.fastpath import check_compile, compile_model, kept_loss, mark_step, warm_up
from headsearch.io import append_line, write_atomic
from headsearch.training.rundir import save_checkpoint

CHECKPOINT = "model.safetensors"


@dataclass
class StepInfo:
    epoch: int
    epochs: int
    epoch_step: int
    steps_per_epoch: int
    step: int
    loss: float
    lr: float
    samples_per_s: float


@dataclass
class EpochRecord:
    epoch: int
    step: int
    train_loss: float
    lr: float
    train_seconds: float  # cumulative optimisation time, evaluation excluded
    wall_seconds: float  # cumulative time since training started, evaluation included
    samples_per_s: float  # this epoch's training throughput
    metrics: dict[str, float]  # validation metrics
    diversity: dict[str, float] = field(default_factory=dict)  # mean over layers of each diversity scalar (when tracked)


@dataclass
class TrainResult:
    status: str  # "completed", "interrupted", "diverged", "stopped" (by a callback) or "failed"
    primary_metric: str
    params: int
    epochs_run: int = 0
    steps: int = 0
    best_epoch: int | None = None
    best_value: float | None = None
    best_train_seconds: float | None = None
    best_wall_seconds: float | None = None
    target: float | None = None
    seconds_to_target: float | None = None  # training seconds when the validation metric first reached target
    train_seconds: float = 0.0
    wall_seconds: float = 0.0
    compile_seconds: float = 0.0  # torch.compile warm-up before training; outside every other timing
    samples: int = 0  # training samples processed
    samples_per_s: float = 0.0  # samples / train_seconds
    best_metrics: dict[str, float] = field(default_factory=dict)
    best_diversity: dict[str, float] = field(default_factory=dict)  # at the best epoch, when tracked
    test_metrics: dict[str, float] = field(default_factory=dict)
    history: list[EpochRecord] = field(default_factory=list)
    error: str | None = None

    def to_dict(self, with_history: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_history:
            d.pop("history")
        return d


class Callback:
    """Hooks into training. Raising from `on_epoch_end` stops the run (a pruner raises TrialPruned).

    `on_evaluate` runs after each validation, before the epoch's record is kept and written: a
    callback may add measurements of the model to it (the diversity tracker of `headsearch.analysis`
    fills `record.diversity`), outside the training time.
    """

    def on_start(self, steps_per_epoch: int, epochs: int) -> None: ...
    def on_step(self, info: StepInfo) -> None: ...
    def on_evaluate(self, model: torch.nn.Module, bound: BoundTask, record: EpochRecord) -> None: ...
    def on_epoch_end(self, record: EpochRecord) -> None: ...


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def resolve_device(device: str | None = None) -> torch.device:
    """"auto" (CUDA when there is a GPU, else the CPU) or a torch device string, checked to exist here."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"--device {device!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {device}: this machine has no CUDA GPU (or torch has no CUDA): use cpu or auto")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"--device {device}: only {count} CUDA device(s) are visible (cuda:0 .. cuda:{count - 1})")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {device}: this machine has no Apple GPU (MPS): use cpu or auto")
    elif dev.type not in ("cpu", "mps"):
        raise ConfigError(f"--device {device!r}: headsearch trains on cpu or cuda (or mps): use one of those, or auto")
    return dev


def make_optimizer(model: torch.nn.Module, t: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    kwargs: dict[str, Any] = dict(lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    if device.type == "cuda":
        kwargs["fused"] = True  # one kernel for the whole update instead of several per parameter
    return cls(model.parameters(), **kwargs)


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, schedule: str, min_ratio: float) -> float:
    """Linear warm-up from ~0 to 1 over `warmup_steps`, then constant or cosine down to `min_ratio`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def autocast_context(t: TrainConfig, device: torch.device):
    use_bf16 = t.amp == "bf16" or (t.amp == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def steps_per_epoch(bound: BoundTask, t: TrainConfig) -> int:
    n = bound.batches_per_epoch()
    return min(n, t.max_steps_per_epoch) if t.max_steps_per_epoch else n


def fit(
    task: Task,
    cfg: RunConfig,
    bound: BoundTask,
    *,
    device: torch.device,
    run_dir: Path | None = None,
    callbacks: Sequence[Callback] = (),
    log_every: int = 10,
) -> TrainResult:
    """Train `bound`'s model under `cfg`; evaluate each epoch; test the best checkpoint at the end."""
    t = cfg.train
    check_compile(t, task)  # before anything is built or trained
    seed_everything(cfg.seed)
    model = bound.build_model().to(device)
    result = TrainResult(status="completed", primary_metric=task.primary.name,
                         params=sum(p.numel() for p in model.parameters()), target=t.target)
    optimizer = make_optimizer(model, t, device)
    spe = steps_per_epoch(bound, t)
    total = spe * t.epochs
    warmup = round(t.warmup_epochs * spe)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, total, warmup, t.schedule, t.min_lr_ratio))
    step_model = compile_model(model, t, task)  # evaluation uses `model`: same weights, no compiling
    amp = lambda: autocast_context(t, device)  # noqa: E731
    for cb in callbacks:
        cb.on_start(spe, t.epochs)

    best_state: dict[str, torch.Tensor] | None = None
    first_bad = torch.full((), -1, dtype=torch.long, device=device)  # step of the first non-finite loss
    bad_loss = torch.zeros((), device=device)  # and that loss
    start = time.perf_counter()
    step = 0
    stopped_by: BaseException | None = None

    def check_finite(epoch: int) -> None:
        # Read the device-side flag only here (every `log_every` steps and at epoch end), so the
        # hot loop never waits for the GPU.
        bad_step = int(first_bad)
        if bad_step >= 0:
            raise Diverged(step=bad_step, epoch=epoch, loss=float(bad_loss))

    try:
        if step_model is not model:
            model.train()
            result.compile_seconds = warm_up(step_model, optimizer, bound, bound.warmup_batches(spe), t, device, amp)
            start = time.perf_counter()  # wall time, like training time, starts after the warm-up
        for epoch in range(1, t.epochs + 1):
            model.train()
            synchronize(device)
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            seen = 0
            for i, batch in enumerate(bound.train_batches(epoch)):
                if i >= spe:
                    break
                mark_step(t)
                with amp():
                    loss, n = bound.loss(step_model, batch, t.label_smoothing)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if t.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
                optimizer.step()
                scheduler.step()
                step += 1
                seen += n
                detached = kept_loss(loss, t)
                newly_bad = (~torch.isfinite(detached)) & (first_bad < 0)
                first_bad = torch.where(newly_bad, step, first_bad)
                bad_loss = torch.where(newly_bad, detached, bad_loss)
                loss_sum += detached * n
                if step % log_every == 0 or i == spe - 1:
                    check_finite(epoch)
                    info = StepInfo(epoch, t.epochs, i + 1, spe, step, float(detached), scheduler.get_last_lr()[0],
                                    seen / max(time.perf_counter() - t0, 1e-9))
                    for cb in callbacks:
                        cb.on_step(info)
            synchronize(device)
            epoch_seconds = time.perf_counter() - t0
            check_finite(epoch)
            result.train_seconds += epoch_seconds
            result.steps, result.epochs_run, result.samples = step, epoch, result.samples + seen

            model.eval()
            with torch.no_grad(), amp():
                metrics = bound.evaluate(model, "val")
            record = EpochRecord(epoch, step, float(loss_sum) / max(seen, 1), scheduler.get_last_lr()[0],
                                 result.train_seconds, time.perf_counter() - start, seen / epoch_seconds, metrics)
            for cb in callbacks:
                cb.on_evaluate(model, bound, record)
            result.history.append(record)
            value = metrics[task.primary.name]
            if result.best_value is None or task.primary.better(value, result.best_value):
                result.best_epoch, result.best_value, result.best_metrics = epoch, value, dict(metrics)
                result.best_diversity = dict(record.diversity)
                result.best_train_seconds, result.best_wall_seconds = record.train_seconds, record.wall_seconds
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                if run_dir is not None:
                    save_checkpoint(best_state, run_dir / CHECKPOINT, {"epoch": str(epoch), "task": task.name})
            if t.target is not None and result.seconds_to_target is None and not task.primary.better(t.target, value):
                result.seconds_to_target = record.train_seconds
            if run_dir is not None:
                append_line(run_dir / "metrics.jsonl", json.dumps(asdict(record)))
            try:
                for cb in callbacks:
                    cb.on_epoch_end(record)
            except Exception as e:
                stopped_by = e
                raise
    except KeyboardInterrupt:
        result.status = "interrupted"
        _finish(result, run_dir, start)
        raise
    except Diverged as e:
        result.status, result.error = "diverged", str(e)
        _finish(result, run_dir, start)
        raise
    except Exception as e:  # keep what was done; a callback stopping the run (pruning) is not a failure
        result.status = "stopped" if e is stopped_by else "failed"
        result.error = f"{type(e).__name__}: {e}"
        _finish(result, run_dir, start)
        raise

    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    with torch.no_grad(), amp():
        result.test_metrics = bound.evaluate(model, "test")
    if run_dir is not None:
        bound.write_outputs(run_dir)
    _finish(result, run_dir, start)
    return result


def _finish(result: TrainResult, run_dir: Path | None, start: float) -> None:
    result.wall_seconds = time.perf_counter() - start
    result.samples_per_s = result.samples / result.train_seconds if result.train_seconds else 0.0
    if run_dir is not None:
        write_atomic(run_dir / "final.json", json.dumps(result.to_dict(), indent=2) + "\n")
