"""Cohorts: K runs trained together as one stacked model, each exactly as it would train alone.

A `Cohort` has K slots. `add` puts a run in a free slot (its config, data, run directory and callbacks):
its model is built as a solo run builds it (same seed, same initial weights) and loaded into the stacked
model (`headsearch.models.cohort`); its optimizer state starts at zero. `train_epoch` trains one epoch of
every occupied slot in one stacked step per batch. Each slot has its own data order and augmentation
draws (its bound task's generator), its own learning rate and schedule position, its own Adam state and
gradient clipping (`StackedAdam`); the loss is the sum of the slots' losses, so each slot's gradient is
that of its own loss. Slots need not be at the same epoch: every epoch has the same number of steps, so
a run that joins later starts at its own epoch 1 beside the others.

After the epoch each occupied slot is evaluated as a solo model (a copy of its weights), recorded as a
solo run records it (`trainer.Run`: metrics.jsonl, the best checkpoint, final.json at the end) and
handed to its callbacks, which may stop it (a pruner raises). `train_epoch` returns the slots that ended
(completed, stopped, diverged); those slots are free again. An empty slot computes on a copy of another
slot's batch with its loss weighted 0, so its weights take no gradient; nothing else waits for it.

The fair time: a slot's `epoch_seconds_alone` is its architecture's speed alone on the device
(`clock.measure_alone`, or a value measured before), never the cohort's: an architecture's `time` does
not depend on the company it trained in. The raw seconds (`train_seconds`) are the cohort's epochs'.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from headsearch.config import RunConfig, stable_key
from headsearch.errors import Diverged
from headsearch.models.cohort import soft_width, stack_signature
from headsearch.models.variants import fusion_of
from headsearch.tasks import BoundTask, Task
from headsearch.training.cohort_optim import StackedAdam
from headsearch.training.rundir import create_run_dir
from headsearch.training.steps import autocast_context, lr_multiplier, lr_multiplier_tensor, synchronize
from headsearch.training.clock import AloneClock, measure_alone
from headsearch.training.devicelock import Share
from headsearch.training.runtime import seed_everything, steps_per_epoch
from headsearch.training.records import SlotEnd
from headsearch.training.trainer import Callback, Run, TrainResult


def cohort_key(cfg: RunConfig) -> str:
    """What every run of a cohort shares: the config without the head schedule, skip, fusion, learning rate and
    seed (all per slot). Two configs with the same key can share a cohort (if their task stacks them)."""
    d = cfg.to_dict()
    d.pop("seed", None)
    d["train"] = {k: v for k, v in d["train"].items() if k != "lr"}
    d["arch"] = list(stack_signature(cfg.arch))
    return stable_key(d)


@dataclass(kw_only=True)
class Slot(Run):
    """One run of a cohort: what a solo `fit` keeps (`trainer.Run`), its config, and where it stands."""

    cfg: RunConfig
    tag: Any = None  # the caller's (the search: its trial)
    epoch: int = 0  # epochs finished
    steps: int = 0  # optimizer steps taken


class Cohort:
    """K slots of one task trained as one stacked model on `device`. `soft_columns`: the width to keep for
    soft-attention weights (`headsearch.models.cohort.soft_width`; None when no run will fuse).
    `share`: the device lock every epoch is held shared under (None: none)."""

    needs_data = True  # each run's data is bound to its config (the simulator's table needs none)
    resumes = False  # every slot starts from the beginning: a paused run's resumption trains alone

    def __init__(self, task: Task, size: int, device: torch.device, soft_columns: int | None = None, share: Share | None = None,
                 keep_step_losses: bool = False):
        if task.stack_refusal is None:
            raise ValueError(f"task {task.name} does not train cohorts")
        self.task, self.size, self.device, self.soft_columns, self.share = task, size, device, soft_columns, share
        self.slots: list[Slot | None] = [None] * size
        self.key: str | None = None
        self.model = None  # the StackedViT, built with the first run
        self.optimizer: StackedAdam | None = None
        # Every step's (K,) losses, kept on the device when asked (the equality tests compare them with solo runs').
        self.step_losses: list[torch.Tensor] | None = [] if keep_step_losses else None
        self.unreported: list[SlotEnd] = []  # runs that ended in an epoch an exception interrupted (see train_epoch)

    # -- slots -----------------------------------------------------------------------------------
    @property
    def occupied(self) -> list[int]:
        return [k for k, s in enumerate(self.slots) if s is not None]

    @property
    def free(self) -> list[int]:
        return [k for k, s in enumerate(self.slots) if s is None]

    def refusal(self, cfg: RunConfig) -> str | None:
        """Why `cfg` cannot join this cohort (None: it can, when a slot is free)."""
        if (why := self.task.stack_refusal(cfg)) is not None:
            return why
        if self.occupied and cohort_key(cfg) != self.key:
            return "its config differs from the cohort's in more than the head schedule, skip, fusion, lr and seed"
        if fusion_of(cfg.arch.fusion).soft is not None:
            need = soft_width(cfg.arch, min(cfg.arch.enc_heads))
            if self.soft_columns is None or need > self.soft_columns:
                return f"its soft branch needs {need} columns and the cohort keeps {self.soft_columns}"
        return None

    def add(self, cfg: RunConfig, bound: BoundTask, run_dir: Path | None = None, *, callbacks: Sequence[Callback] = (),
            argv: list[str] | None = None, clock: AloneClock | None = None, tag: Any = None, resume: bool = False) -> int:
        """Put a run in a free slot (its run directory made as `headsearch train` makes one) and return the slot.
        With a `clock`, the architecture's speed alone is the clock's known value or measured now.
        `bound` is bound under `cfg` (`bound.cfg`); the config comes apart from it because the simulator's
        table, which the search drives the same way, has no bound data."""
        if (why := self.refusal(cfg)) is not None:
            raise ValueError(f"this run cannot join the cohort: {why}")
        if resume:
            raise ValueError("a cohort cannot resume a paused run: it trains alone")
        if not self.free:
            raise ValueError("the cohort is full")
        k = self.free[0]
        if run_dir is not None:
            create_run_dir(run_dir, cfg.to_yaml(), argv)
            bound.write_artifacts(run_dir)
        seed_everything(cfg.seed)
        solo = bound.build_model().to(self.device)  # the solo run's initial weights
        result = TrainResult(status="completed", primary_metric=self.task.primary.name,
                             params=sum(p.numel() for p in solo.parameters()), target=cfg.train.target,
                             step_mode=f"cohort of {self.size}: eager")
        if clock is not None:
            result.epoch_seconds_alone = clock.known
            if clock.known is None:
                result.epoch_seconds_alone = measure_alone(self.task, bound, self.device, clock)
        if self.model is None:
            self.model = bound.build_cohort([solo] * self.size, self.soft_columns)
            self.optimizer = StackedAdam(list(self.model.parameters()), self.size, kind=cfg.train.optimizer,
                                         betas=cfg.train.betas, eps=cfg.train.eps, weight_decay=cfg.train.weight_decay)
        else:
            self.model.load_slot(k, solo)
        self.optimizer.reset_slot(k)
        self.key = cohort_key(cfg)
        self.slots[k] = Slot(self.task, bound, run_dir, callbacks, result, cfg=cfg, tag=tag)
        spe = steps_per_epoch(bound, cfg.train)
        for cb in callbacks:
            cb.on_start(spe, cfg.train.epochs)
            cb.on_prepared(result.step_mode, 0.0, None)
        return k

    # -- training --------------------------------------------------------------------------------
    def train_epoch(self) -> list[SlotEnd]:
        """One epoch of every occupied slot, then each slot evaluated, recorded and judged. Returns the runs
        that ended (their slots are free again)."""
        occupied = self.occupied
        if not occupied:
            return []
        first = self.slots[occupied[0]]
        spe = steps_per_epoch(first.bound, first.cfg.train)
        hold = self.share.shared() if self.share is not None else contextlib.nullcontext()
        ends: list[SlotEnd] = []
        try:
            with hold:
                losses, seconds, seen = self.train_steps(spe)
                for k in occupied:
                    end = self._close_epoch(k, losses, seconds, seen)
                    if end is not None:
                        ends.append(end)
                        self.slots[k] = None
        except BaseException:
            self.unreported.extend(ends)  # runs that ended before the interruption: the caller still reports them
            raise
        return ends

    def train_steps(self, spe: int) -> tuple[torch.Tensor, float, int]:
        """The stacked steps of one epoch: (each slot's loss sum (K,) on the device, seconds, samples per slot).
        `train_epoch` runs them between its slots' bookkeeping; benchmarks/cohort.py times them alone."""
        occupied = self.occupied
        t = self.slots[occupied[0]].cfg.train
        total = spe * t.epochs
        warmup = round(t.warmup_epochs * spe)
        weight = torch.tensor([float(s is not None) for s in self.slots], device=self.device)  # (K,) empty slots: 0
        base_lr = torch.tensor([s.cfg.train.lr if s is not None else 0.0 for s in self.slots], dtype=torch.float64,
                               device=self.device)
        step = torch.tensor([s.steps if s is not None else 0 for s in self.slots], dtype=torch.float64, device=self.device)
        iters = {k: itertools.islice(self.slots[k].bound.train_batches(self.slots[k].epoch + 1), spe) for k in occupied}
        loss_sum = torch.zeros(self.size, device=self.device)
        self.model.train()
        synchronize(self.device)
        start, seen = time.perf_counter(), 0
        for _ in range(spe):
            batches = {k: next(it) for k, it in iters.items()}
            filler = batches[occupied[0]]
            stacked = [batches.get(k, filler) for k in range(self.size)]
            with autocast_context(t, self.device):
                losses, n = self.slots[occupied[0]].bound.cohort_loss(self.model, stacked, t.label_smoothing)
            self.optimizer.zero_grad()
            (losses * weight).sum().backward()
            if t.grad_clip:
                self.optimizer.clip_(t.grad_clip)
            lr = base_lr * lr_multiplier_tensor(step, total, warmup, t.schedule, t.min_lr_ratio)
            self.optimizer.step(lr)
            step += 1
            loss_sum += losses.detach().float() * n  # a non-finite loss stays in its slot's sum
            if self.step_losses is not None:
                self.step_losses.append(losses.detach().clone())
            seen += n
        synchronize(self.device)
        return loss_sum, time.perf_counter() - start, seen

    def _close_epoch(self, k: int, loss_sum: torch.Tensor, seconds: float, seen: int) -> SlotEnd | None:
        """Slot k's epoch as a solo run closes one: evaluate, keep, call back; its end, if this was it."""
        slot = self.slots[k]
        t = slot.cfg.train
        spe = steps_per_epoch(slot.bound, t)
        slot.epoch += 1
        slot.steps += spe
        epoch_loss = float(loss_sum[k]) / max(seen, 1)
        if not math.isfinite(epoch_loss):
            return self._end(k, Diverged(step=slot.steps, epoch=slot.epoch, loss=epoch_loss), "diverged",
                             f"loss {epoch_loss} is not finite in epoch {slot.epoch}")
        model = self.model.slot_model(k)
        try:
            lr = t.lr * lr_multiplier(slot.steps, spe * t.epochs, round(t.warmup_epochs * spe), t.schedule, t.min_lr_ratio)
            record = slot.close_epoch(model, autocast_context(t, self.device), slot.epoch, slot.steps, epoch_loss, lr,
                                      seconds, seen)
        except Exception as e:  # this slot's evaluation or recording failed: this slot only
            return self._end(k, e, "failed", f"{type(e).__name__}: {e}")
        try:
            for cb in slot.callbacks:
                cb.on_epoch_end(record)
        except Exception as e:  # a pruner stopping the run (not a failure), as in a solo fit
            return self._end(k, e, "stopped", f"{type(e).__name__}: {e}")
        if slot.epoch < t.epochs:
            return None
        slot.evaluate_test_on_best(model, autocast_context(t, self.device))
        return self._end(k, None, "completed")

    def _end(self, k: int, error: BaseException | None, status: str, why: str | None = None) -> SlotEnd:
        """Slot k's run ended with `status` (`why`: its result's error) and `error`, the exception that ended it."""
        slot = self.slots[k]
        return SlotEnd(k, slot.tag, slot.end(status, why), error)

    def interrupt(self) -> list[SlotEnd]:
        """After an exception in `train_epoch`: the runs that had ended before it (as they ended), then every run
        still in a slot, ended as interrupted (what it did is kept, as a solo run keeps it)."""
        ends, self.unreported = self.unreported, []
        for k in self.occupied:
            ends.append(self._end(k, KeyboardInterrupt(), "interrupted"))
            self.slots[k] = None
        return ends
