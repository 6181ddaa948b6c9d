"""How a run's steps run, behind one call: `prepare_steps` resolves the step mode (`fastpath.resolve_mode`),
compiles the blocks (`fastpath.compile_blocks`), builds the steps and warms them up (captured and verified
against the same step uncaptured: `steps.GraphSteps.warm_up`, `steps.verify_step`), and falls back a mode at
a time when any of that fails, returning ready steps, the warm-up seconds and a one-line note."""
from __future__ import annotations

import gc
import time

import torch

from headsearch.config import TrainConfig
from headsearch.errors import ConfigError, Diverged, device_fault
from headsearch.tasks import BoundTask, Task
from headsearch.training.capture import CaptureBrokeCuda
from headsearch.training.fastpath import StepMode, compile_blocks, resolve_mode
from headsearch.training.steps import Steps, make_steps


def prepare_steps(task: Task, t: TrainConfig, bound: BoundTask, model: torch.nn.Module, device: torch.device,
                  spe: int) -> tuple[Steps, float, str | None]:
    """The run's steps, warmed up (compiled, captured) before the clock starts: (steps, warm-up seconds,
    note). If compiling or capturing fails, fall back a step at a time (compiled blocks without the
    graph... eager with the graph, then plain eager) and say so in `note`, one line.

    Running out of device memory while warming up a fast mode falls back too: compiling and capturing
    need memory that eager steps do not (each graph's pool holds its temporaries for good), so a model
    that fits eagerly must not fail its trial there. The failed attempt's steps (its graphs, their pool,
    its optimizer state) are dropped and CUDA's cache emptied before the next mode. Out of memory in
    eager steps is the run's own, and raised. A capture that left CUDA unusable (`CaptureBrokeCuda`) is
    raised too: no fallback can run in this process. `t`: the run's training section, all a step needs."""
    mode = resolve_mode(t, task, device)
    notes: list[str] = []
    seconds = 0.0
    for candidate in fallbacks(mode):
        out_of_memory = False
        try:
            step_model = compile_blocks(model, candidate, dynamic=None if task.static_shapes else True)
            steps = make_steps(candidate, model, step_model, bound, t, device, spe)
            started = time.perf_counter()
            try:
                seconds += steps.warm_up(bound.warmup_batches(spe))  # 0 when nothing compiles or captures
            except BaseException:
                seconds += time.perf_counter() - started  # a failed attempt's time is warm-up time too
                raise
            return steps, seconds, "; ".join(notes) or None
        except (KeyboardInterrupt, Diverged, ConfigError, CaptureBrokeCuda):
            raise  # not the fast path's fault (a slower mode would meet it too), or nothing can run after it
        except Exception as e:  # torch.cuda.OutOfMemoryError included: a RuntimeError
            if candidate.name == "off" or device_fault(e) is not None:
                raise  # the last mode's, or the device unusable (a sticky CUDA error): no other mode can run
            out_of_memory = isinstance(e, torch.cuda.OutOfMemoryError)
            reason = " ".join(str(e).split())[:160] or type(e).__name__
            failed = "ran out of device memory" if out_of_memory else "failed"
            notes.append(f"{candidate.describe()} {failed} ({type(e).__name__}: {reason})")
        # Here the exception and its traceback (whose frames hold the failed steps) are gone; drop the rest: the
        # steps, and the grads they left on the model (a failed capture's live in its graphs' memory pool).
        steps = step_model = None
        model.zero_grad(set_to_none=True)
        if out_of_memory and device.type == "cuda":
            gc.collect()  # reference cycles among the failed attempt's objects would keep their memory
            torch.cuda.empty_cache()
    raise AssertionError("the eager mode is always the last fallback")


def fallbacks(mode: StepMode) -> list[StepMode]:
    """`mode`, then what to try if it fails: without compiling (keeping the graph), then plain eager."""
    chain = [mode]
    if mode.inductor is not None and mode.cuda_graph:
        chain.append(StepMode("graphs", None, True))
    if mode.name != "off":
        chain.append(StepMode("off", None, False))
    return chain
