"""The GPU fast path of the trainer: torch.compile (optionally with CUDA graphs) and its warm-up.

Compiling happens on the first calls of the compiled model, so `warm_up` makes those calls before the
clock starts: training seconds, throughput and the convergence figures then measure training alone,
and the warm-up time is reported on its own (`compile_seconds`). The warm-up runs forward and
backward but never steps the optimizer, and restores the global RNG, so a compiled run starts from
the same weights, the same data order and the same random state as an eager one. Without dropout the
two train alike to float tolerance (tests/test_fastpath.py). With dropout they cannot match exactly:
compiled code draws its dropout masks with its own generator (seeded from torch's), so a compiled run
reproduces other compiled runs of the same seed, not the eager run.

torch is imported inside the functions: `check_compile` runs where only the config is known.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from headsearch.config import TrainConfig
from headsearch.errors import ConfigError

# Calls per input shape before the timed steps. CUDA graphs (reduce-overhead) are recorded on a
# later call than the compiling one, so they need more.
WARMUP_CALLS = {"default": 1, "max-autotune": 1, "reduce-overhead": 3}


def check_compile(t: TrainConfig, task: Any) -> None:
    """Refuse CUDA graphs for a task whose batches change shape.

    A task declares `static_shapes = True` when every training batch has the same shape (up to the
    epoch's last, partial one, which its `warmup_batches` covers); `shape_note` says why not otherwise.
    """
    if t.compile == "reduce-overhead" and not task.static_shapes:
        raise ConfigError(f"compile: reduce-overhead uses CUDA graphs, which need static shapes; {task.shape_note}: use compile: default")


def compile_model(model: Any, t: TrainConfig, task: Any) -> Any:
    """The compiled model (sharing `model`'s parameters), or `model` itself when compile is off.

    Static-shape tasks leave `dynamic` to torch (specialise, and go dynamic only if a shape changes);
    others compile for dynamic shapes from the start instead of recompiling for each new length.
    """
    if t.compile == "off":
        return model
    import torch

    dynamic = None if task.static_shapes else True
    return torch.compile(model, mode=t.compile, dynamic=dynamic)


def mark_step(t: TrainConfig) -> None:
    """Tell CUDA graphs a new training step begins (the previous replay's outputs may be reused)."""
    if t.compile != "reduce-overhead":
        return
    import torch

    if hasattr(torch, "compiler") and hasattr(torch.compiler, "cudagraph_mark_step_begin"):
        torch.compiler.cudagraph_mark_step_begin()


def kept_loss(loss: Any, t: TrainConfig) -> Any:
    """The step's loss detached, as a tensor that may outlive the step.

    Under CUDA graphs a later replay may overwrite what the graph returned, so keep a copy there.
    """
    detached = loss.detach().float()
    return detached.clone() if t.compile == "reduce-overhead" else detached


def warm_up(step_model: Any, optimizer: Any, bound: Any, batches: Sequence, t: TrainConfig, device: Any,
            amp: Callable[[], Any]) -> float:
    """Compile (and record CUDA graphs) on `batches`; return the seconds it took.

    Forward and backward as in a training step, gradients dropped, no optimizer step: the weights are
    unchanged. The global RNG (dropout) is restored afterwards.
    """
    import torch

    from headsearch.training.trainer import synchronize

    cuda = [device] if device.type == "cuda" else []
    synchronize(device)
    start = time.perf_counter()
    with torch.random.fork_rng(devices=cuda):
        for batch in batches:
            for _ in range(WARMUP_CALLS[t.compile]):
                mark_step(t)
                with amp():
                    loss, _ = bound.loss(step_model, batch, t.label_smoothing)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    return time.perf_counter() - start
