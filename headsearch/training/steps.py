"""The training step, eager or captured whole in a CUDA graph, with its bookkeeping on the device.

A step is: the task's loss on a batch (for the ViT this includes the augmentation, from random
numbers drawn with the batch), backward, gradient clipping, the optimizer with the learning-rate
schedule, and the loss bookkeeping (the epoch's loss sum, the first non-finite loss). Nothing in it
reads a value back to the host, so the host never waits for the device inside an epoch.

- `EagerSteps` launches each of these from Python every step: the CPU path, and `compile: off` or
  `default` on a GPU. Its learning rate comes from a `LambdaLR` scheduler (a Python float).
- `GraphSteps` computes the learning rate on the device from a step counter (`lr_multiplier_tensor`,
  equal to `lr_multiplier`), uses an optimizer that accepts that tensor (fused AdamW, `capturable`
  on CUDA), and on CUDA captures the whole step once per batch shape (PyTorch's whole-network
  capture: warm-up iterations on a side stream, then `torch.cuda.graph`, on the run's device whichever
  is current; with HEADSEARCH_SHARED_GRAPH_POOL=1 all shapes' graphs in one memory pool; see
  `GraphSteps._capture`). A step is then a copy of the batch into the graph's input buffers and one replay.
  On the CPU the same step runs uncaptured, which is how the tests check it against `EagerSteps`.

Both warm up before the clock starts (compiling, capturing) and put the weights, the optimizer
state and the global RNG back as they were, so the timed run starts from the same point as an
un-warmed one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import torch
# Imported here, with nothing of a run on the stack: its first import (which torch otherwise does inside the
# first optimizer's constructor) keeps the frames that imported it alive for good, so the first trial of a
# worker would keep its model, and on a GPU its memory, for the life of the process.
import torch._dynamo  # noqa: F401,E402

from headsearch.config import TrainConfig
from headsearch.errors import Diverged
from headsearch.training.capture import (CaptureBrokeCuda, batch_numel, batch_tensors, capture_stream,  # noqa: F401
                                         clone_batch, recover_failed_capture, shared_graph_pool, signature)
from headsearch.training.fastpath import StepMode

# Warm-up calls of each batch shape before capture: the first compiles, later ones settle lazy state
# (optimizer moments, cuBLAS workspaces, autotuning) so that the captured call allocates nothing new.
CAPTURE_WARMUP_CALLS = 3


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, schedule: str, min_ratio: float) -> float:
    """Linear warm-up from ~0 to 1 over `warmup_steps`, then constant or cosine down to `min_ratio`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_multiplier_tensor(step: torch.Tensor, total_steps: int, warmup_steps: int, schedule: str,
                         min_ratio: float) -> torch.Tensor:
    """`lr_multiplier` of a step held in a device tensor, computed on the device (float64): no host sync,
    so it can sit inside a captured graph."""
    s = step.to(torch.float64)
    if schedule == "constant":
        main = torch.ones_like(s)
    else:
        progress = ((s - warmup_steps) / max(1, total_steps - warmup_steps)).clamp(max=1.0)
        main = min_ratio + (1 - min_ratio) * 0.5 * (1 + torch.cos(math.pi * progress))
    if warmup_steps <= 0:
        return main
    return torch.where(s < warmup_steps, (s + 1) / warmup_steps, main)


@dataclasses.dataclass
class StepState:
    """What steps record, as device tensors updated in place (a captured graph writes them on replay)."""

    step: torch.Tensor  # () long: optimizer steps taken
    loss_sum: torch.Tensor  # () float32: this epoch's sum of loss x samples
    last_loss: torch.Tensor  # () float32: the last step's loss
    first_bad: torch.Tensor  # () long: the step (1-based) of the first non-finite loss, -1 while none
    bad_loss: torch.Tensor  # () float32: that loss

    @classmethod
    def on(cls, device: torch.device) -> "StepState":
        long = dict(dtype=torch.long, device=device)
        real = dict(dtype=torch.float32, device=device)
        return cls(torch.zeros((), **long), torch.zeros((), **real), torch.zeros((), **real),
                   torch.full((), -1, **long), torch.zeros((), **real))

    def reset(self) -> None:
        for t in (self.step, self.loss_sum, self.last_loss, self.bad_loss):
            t.zero_()
        self.first_bad.fill_(-1)

    def record(self, loss: torch.Tensor, n: int) -> None:
        """After the optimizer step: count it, add the loss to the epoch's sum, note a first non-finite loss."""
        detached = loss.detach().float()
        self.step.add_(1)
        newly_bad = (~torch.isfinite(detached)) & (self.first_bad < 0)
        self.first_bad.copy_(torch.where(newly_bad, self.step, self.first_bad))
        self.bad_loss.copy_(torch.where(newly_bad, detached, self.bad_loss))
        self.loss_sum.add_(detached * n)
        self.last_loss.copy_(detached)

    def check_finite(self, epoch: int) -> None:
        """Raise Diverged if a loss was not finite. Reads the device: call it where a sync is fine."""
        bad_step = int(self.first_bad)
        if bad_step >= 0:
            raise Diverged(step=bad_step, epoch=epoch, loss=float(self.bad_loss))


def autocast_context(t: TrainConfig, device: torch.device, cache: bool = True):
    """bf16 autocast on CUDA (train.amp auto) or when asked. `cache=False` inside CUDA graphs: autocast's
    cache of cast weights would hold tensors from the capture that replays never refresh."""
    use_bf16 = t.amp == "bf16" or (t.amp == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Steps:
    """What the trainer drives: `warm_up` once, then `step` per batch; `state` on the device, `lr()` on the host.

    It owns the run's training section (`t`, given here once, with `spe` steps an epoch): the trainer asks it
    for what it needs of it (`lr()` and the schedule, `autocast()`) and a step for `loss()` and `update()`."""

    mode: StepMode
    state: StepState
    optimizer: torch.optim.Optimizer

    def __init__(self, model: torch.nn.Module, step_model: torch.nn.Module, bound: Any, t: TrainConfig,
                 device: torch.device, mode: StepMode, spe: int):
        self.model, self.step_model, self.bound, self.t, self.device = model, step_model, bound, t, device
        self.mode, self.total_steps, self.warmup_steps = mode, spe * t.epochs, round(t.warmup_epochs * spe)
        self.state = StepState.on(device)
        self.steps_taken = 0  # host count, for lr() without reading the device
        self.uncaptured = 0  # steps of a batch shape no warm-up showed, run outside the CUDA graphs

    def lr(self, step: int | None = None) -> float:
        """The learning rate of step `step` (0-based; by default the next step's), warm-up included."""
        step = self.steps_taken if step is None else step
        t = self.t
        return t.lr * lr_multiplier(step, self.total_steps, self.warmup_steps, t.schedule, t.min_lr_ratio)

    def update(self, loss: torch.Tensor) -> None:
        """Backward from `loss` into grads set to None first (no accumulation), clipped (`train.grad_clip`), and
        the optimizer's step."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.t.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.t.grad_clip)
        self.optimizer.step()

    def autocast(self, cache: bool = True):
        """The run's autocast (`autocast_context` of its `train.amp` on its device): its steps' and evaluations'."""
        return autocast_context(self.t, self.device, cache)

    def loss(self, batch: Any, cache: bool = True) -> tuple[torch.Tensor, int]:
        """The task's loss of `batch` on the step model, under the run's autocast and label smoothing."""
        with self.autocast(cache):
            return self.bound.loss(self.step_model, batch, self.t.label_smoothing)

    def warm_up(self, batches: Sequence) -> float:
        raise NotImplementedError

    def step(self, batch: Any) -> int:
        raise NotImplementedError

    def snapshot(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the weights and buffers, for `restore`."""
        return ([p.detach().clone() for p in self.model.parameters()], [b.detach().clone() for b in self.model.buffers()])

    def restore(self, snap: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
        """Weights and buffers from `snap`, the optimizer state and the step state back at their start, in place
        (a captured graph keeps reading the same memory)."""
        synchronize(self.device)
        with torch.no_grad():
            for tensor, saved in zip([*self.model.parameters(), *self.model.buffers()], [*snap[0], *snap[1]]):
                tensor.copy_(saved)
        reset_optimizer_state(self.optimizer)
        self.state.reset()
        self.steps_taken = 0
        synchronize(self.device)

    def state_dict(self) -> dict[str, Any]:
        """What a paused run keeps of its steps (`headsearch.training.pause`): the optimizer's state, the step
        state and the host's step count, on the CPU."""
        return {"optimizer": self.optimizer.state_dict(), "steps_taken": self.steps_taken,
                "step_state": {f.name: getattr(self.state, f.name).detach().cpu().clone()
                               for f in dataclasses.fields(self.state)}}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s `saved`, after the warm-up: the step state copied in place (a captured
        graph reads it), the optimizer's as `_load_optimizer` says."""
        synchronize(self.device)
        with torch.no_grad():
            for name, value in saved["step_state"].items():
                getattr(self.state, name).copy_(value)
        self.steps_taken = int(saved["steps_taken"])
        self._load_optimizer(saved["optimizer"])
        synchronize(self.device)

    def _load_optimizer(self, saved: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(saved)

    @contextlib.contextmanager
    def restored_afterwards(self):
        """Run warm-up work, then put back the weights, the optimizer state, the step state and the RNG."""
        snap = self.snapshot()
        cuda = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=cuda):
                yield snap
        finally:
            self.restore(snap)


def reset_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Zero every state tensor in place (Adam's step count and moments start at zero): tensors a
    captured graph reads keep their addresses. Python numbers in the state are reset to 0 too."""
    with torch.no_grad():
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                elif isinstance(value, (int, float)):
                    state[key] = type(value)(0)


def make_optimizer(model: torch.nn.Module, t: TrainConfig, device: torch.device, lr: float | torch.Tensor | None = None,
                   capturable: bool = False) -> torch.optim.Optimizer:
    """Adam or AdamW over the model's parameters. Fused on CUDA (one kernel for the whole update), and
    wherever the learning rate is a tensor (fused AdamW reads it on the device)."""
    cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    kwargs: dict[str, Any] = dict(lr=t.lr if lr is None else lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    if device.type == "cuda" or isinstance(lr, torch.Tensor):
        kwargs["fused"] = True
    if capturable:
        kwargs["capturable"] = True
    return cls(model.parameters(), **kwargs)


class EagerSteps(Steps):
    """Each step launched from Python, the learning rate from a LambdaLR scheduler."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.optimizer = make_optimizer(self.model, self.t, self.device)
        total, warmup, t = self.total_steps, self.warmup_steps, self.t
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_multiplier(s, total, warmup, t.schedule, t.min_lr_ratio))

    def warm_up(self, batches: Sequence) -> float:
        """Compile on each batch shape (forward and backward, no optimizer step); nothing when eager."""
        if self.step_model is self.model:
            return 0.0
        synchronize(self.device)
        start = time.perf_counter()
        with self.restored_afterwards():
            for batch in batches:
                loss, _ = self.loss(batch)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
            self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        super().load_state_dict(saved)
        self.scheduler.load_state_dict(saved["scheduler"])

    def step(self, batch: Any) -> int:
        loss, n = self.loss(batch)
        self.update(loss)
        self.scheduler.step()
        self.state.record(loss, n)
        self.steps_taken += 1
        return n


class GraphSteps(Steps):
    """The whole step as device work: the learning rate from a device step counter, a fused optimizer
    reading it as a tensor; captured in one CUDA graph per batch shape on CUDA, run as is elsewhere."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.capture = self.mode.cuda_graph and self.device.type == "cuda"
        self.lr_tensor = torch.tensor(self.t.lr, dtype=torch.float32, device=self.device)
        self.optimizer = make_optimizer(self.model, self.t, self.device, lr=self.lr_tensor, capturable=self.capture)
        self.graphs: dict[tuple, tuple[Any, Any, int]] = {}  # batch signature -> (graph, static batch, samples)
        # One memory pool for all of this run's graphs (see `_capture`) when asked for; None: a private pool per
        # graph, as torch.cuda.graph gives by default (and where torch has no pool handles).
        self.pool = (torch.cuda.graph_pool_handle() if self.capture and shared_graph_pool()
                     and hasattr(torch.cuda, "graph_pool_handle") else None)

    def step_body(self, batch: Any) -> int:
        """One step, all on the device: the code a graph captures."""
        t, s = self.t, self.state
        mult = lr_multiplier_tensor(s.step, self.total_steps, self.warmup_steps, t.schedule, t.min_lr_ratio)
        self.lr_tensor.copy_(t.lr * mult)
        loss, n = self.loss(batch, cache=not self.capture)
        # Under capture the grads become the graph's own buffers, in the pool all of this run's graphs share, so
        # another shape's capture may reuse their memory: safe, since a step writes its grads (backward into grads
        # set to None: no accumulation) before it reads them, and nothing reads them between steps.
        self.update(loss)
        s.record(loss, n)
        return n

    def warm_up(self, batches: Sequence) -> float:
        """Compile and capture on each batch shape, and check the first graph against the uncaptured step;
        then weights, optimizer state, step state and RNG as before."""
        synchronize(self.device)
        start = time.perf_counter()
        with self.restored_afterwards() as start_point:
            # With a shared pool, captured largest first: a smaller capture fits in the blocks a larger one freed,
            # so the pool holds about the largest shape's temporaries, not their sum.
            for batch in sorted(batches, key=batch_numel, reverse=True) if self.pool is not None else batches:
                static = clone_batch(batch)
                if self.capture:
                    graph, n = self._capture(static)
                else:
                    graph, n = None, self.step_body(static)  # compiles, if the model is compiled
                self.graphs[signature(batch)] = (graph, static, n)
            if self.capture:  # every captured shape: each is its own graph
                for batch in batches:
                    verify_step(self, self.step, batch, start_point)
        return time.perf_counter() - start

    def _capture(self, static: Any) -> tuple[Any, int]:
        """Warm up on `static` and capture one step of its shape, on this run's device whichever is current.

        - The device: `torch.cuda.graph` synchronises and makes its own capture stream on the *current* device
          (torch/cuda/graphs.py, `graph.__init__`/`__enter__`), so `--device cuda:1` while cuda:0 is current
          would capture on the wrong GPU; hence `torch.cuda.device(self.device)` around all of it.
        - The stream: an explicit one, the device's `capture_stream` (graph's own default is one stream for
          the whole class, made on whichever device was current first). The warm-up runs on it too, so the
          cuBLAS workspace PyTorch keeps per (handle, stream) for good (CublasHandlePool.cpp) is allocated by
          the warm-up, not during the capture, where it could come from the graph pool and outlive it.
        - The pool: `self.pool`, shared by every shape of this run when HEADSEARCH_SHARED_GRAPH_POOL=1 (opt-in
          until a GPU has run it: `shared_graph_pool`). Without `pool=` each graph gets a private
          pool that keeps its temporaries reserved, so graph memory is the sum over shapes (translation has up
          to 13) where eager needs the largest. Sharing is safe in any replay order because nothing a graph
          needs from one replay to the next lives in memory allocated during a capture: the weights, the
          optimizer state (made by the warm-up calls' first `optimizer.step()`), `state`, `lr_tensor` and the
          static batch are all allocated outside capture and held by Python; what a capture allocates (the
          grads, activations, temporaries) is written before it is read within each replay.
        - A failure: `recover_failed_capture` puts back the stream and the RNG a failed capture leaves broken.
        """
        with torch.cuda.device(self.device):
            stream = capture_stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the static batch's copy, the weights
            with torch.cuda.stream(stream):
                for _ in range(CAPTURE_WARMUP_CALLS):
                    self.step_body(static)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with recover_failed_capture(self.device), torch.cuda.graph(graph, pool=self.pool, stream=stream):
                n = self.step_body(static)
        return graph, n

    def _load_optimizer(self, saved: dict[str, Any]) -> None:
        """Copy the saved moments and step counts into the optimizer's own tensors, which the warm-up made and a
        captured graph reads by address (`load_state_dict` would put new tensors in their place, and a tensor
        learning rate in place of `lr_tensor`, which the step counter sets)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            for index, values in saved["state"].items():
                state = self.optimizer.state[params[int(index)]]
                for key, value in values.items():
                    if isinstance(state.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                        state[key].copy_(value)
                    else:  # a state the warm-up did not make (none for Adam): as the optimizer would hold it
                        state[key] = value.to(params[int(index)].device) if isinstance(value, torch.Tensor) else value

    def step(self, batch: Any) -> int:
        entry = self.graphs.get(signature(batch))
        if entry is None or entry[0] is None:  # the CPU, or a shape no warm-up showed (then counted)
            n = self.step_body(batch)
            if entry is None and self.capture:
                self.uncaptured += 1
        else:
            graph, static, n = entry
            for dst, src in zip(batch_tensors(static), batch_tensors(batch)):
                dst.copy_(src, non_blocking=True)
            graph.replay()
        self.steps_taken += 1
        return n


class CaptureMismatch(RuntimeError):
    """A captured step computed something else than the same step run uncaptured."""


STRAY_FRACTION = 1e-3  # the share of weights a correct capture may leave beyond half a step (see verify_step)
STRAY_STEPS = 2.5  # and how far, in steps: a gradient whose sign flipped leaves a weight two steps apart


def verify_step(steps: "GraphSteps", replay: Callable[[Any], int], batch: Any, start_point) -> None:
    """One step from `start_point` through `replay` (the captured graph), and the same step uncaptured from
    the same point: the losses must agree (relative 1e-3) and so must the weights, or CaptureMismatch.

    Adam's first step moves a weight by about the step's learning rate times the sign of its gradient. So a
    step missed, doubled or taken with stale or other gradients leaves most weights half a step apart or
    more. Kernels that add in another order (atomic adds in attention's backward, Inductor's scatters, some
    cuDNN algorithms) leave a weight far closer, except where its gradient is so near zero that the order
    flips its sign: that weight lands two steps away. Measured on an H200 (tiny translation, torch 2.11), a
    correct capture was rejected for exactly that under a single-weight bound. So the rule is: at most
    STRAY_FRACTION of the weights beyond half a step, and none beyond STRAY_STEPS steps.

    The step's learning rate is the schedule's for the first step, not `lr`: under warm-up the first step
    runs at lr / warmup_steps, and a bound of lr / 2 would pass a doubled step. A wrong capture would
    otherwise train quietly wrong; this turns it into a fallback (the trainer then runs without the graph
    and says why)."""
    runs = []
    # Both from the same RNG state: CUDA's graph-safe RNG gives a replay the numbers eager code draws from
    # the same seed and offset, so dropout masks agree too.
    rng = torch.cuda.get_rng_state(steps.device) if steps.device.type == "cuda" else None
    for run in (replay, steps.step_body):
        steps.restore(start_point)
        if rng is not None:
            torch.cuda.set_rng_state(rng, steps.device)
        run(clone_batch(batch))
        synchronize(steps.device)
        runs.append((float(steps.state.last_loss), [p.detach().float().clone() for p in steps.model.parameters()]))
    (got_loss, got), (want_loss, want) = runs
    loss_ok = abs(got_loss - want_loss) <= 1e-3 * abs(want_loss) + 1e-6
    lr = steps.lr(0)  # the run's first step (`restore` puts the step count at 0), at the schedule's value
    worst, strays, total = weights_apart(got, want, 0.5 * lr)
    if not (loss_ok and worst <= STRAY_STEPS * lr and strays <= STRAY_FRACTION * total):
        raise CaptureMismatch(f"the captured step gave loss {got_loss:.6g} against {want_loss:.6g} uncaptured"
                              f" (weights apart by up to {worst:.3g}; {strays:,} of {total:,} beyond half a step"
                              f" of {lr:.3g})")
    steps.restore(start_point)


def weights_apart(got: list[torch.Tensor], want: list[torch.Tensor], bound: float) -> tuple[float, int, int]:
    """(the largest difference, how many weights differ by more than `bound`, how many weights)."""
    worst, strays, total = 0.0, 0, 0
    for a, b in zip(got, want):
        diff = (a - b).abs()
        worst = max(worst, float(diff.max())) if diff.numel() else worst
        strays += int((diff > bound).sum())
        total += diff.numel()
    return worst, strays, total


def make_steps(mode: StepMode, model, step_model, bound, t: TrainConfig, device, spe: int) -> Steps:
    """The run's steps in `mode`, given its training section `t` (the only place it goes: ask the steps)."""
    cls = GraphSteps if mode.cuda_graph else EagerSteps
    return cls(model, step_model, bound, t, device, mode, spe)
