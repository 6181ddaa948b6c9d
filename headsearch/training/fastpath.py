"""How a training step runs: the mode (`train.compile`) resolved for a device, and regional compiling.

| mode              | the model                               | the step in one CUDA graph (CUDA, static shapes) |
| ----------------- | --------------------------------------- | ------------------------------------------------ |
| `off`             | eager                                   | no                                               |
| `graphs`          | eager                                   | yes                                              |
| `default`         | each transformer block compiled         | no                                               |
| `reduce-overhead` | each transformer block compiled         | yes                                              |
| `max-autotune`    | each block compiled, kernels autotuned  | yes                                              |
| `auto` (default)  | CUDA: `reduce-overhead`; elsewhere `off`                                                   |

"The step in one CUDA graph" is `headsearch.training.steps.GraphSteps`: augmentation, forward, loss,
backward, clipping, the optimizer with its learning-rate schedule and the loss bookkeeping are
captured once per batch shape and replayed with one call, so the host no longer limits a small
model. On the CPU there are no graphs: the graph modes compile (or not) as `default` (or `off`).

Regional compiling (the blocks, not the whole model): a search trains many architectures, and with
d_k = d_model / h they are built from a few kinds of block (a head count, a skip kind, a fusion type).
Dynamo keeps one entry per block kind for the whole worker process, and Inductor's on-disk caches
(FX graphs and AOTAutograd, shared by every worker on the machine) hold the kernels, so a new
architecture made of blocks already seen costs no new compile: the fixed cost is paid per block
kind, not per trial.

torch is imported inside the functions: `check_compile` runs where only the config is known.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

from headsearch.config import TrainConfig
from headsearch.errors import ConfigError
from headsearch.environment import cache_root

COMPILED = ("default", "reduce-overhead", "max-autotune")  # modes that torch.compile the blocks
CAPTURED = ("graphs", "reduce-overhead", "max-autotune")  # modes that capture the step in a CUDA graph
# Dynamo keeps compiled code per block kind; a search meets a few dozen kinds (head counts x skips x
# fusions x neighbours' head counts): far above torch's default of 8, after which it would silently
# run the rest eagerly.
RECOMPILE_LIMIT = 256


@dataclass(frozen=True)
class StepMode:
    """What a run's steps do on its device: compile the blocks (`inductor`: the Inductor mode, or
    None for eager) and/or capture each step in a CUDA graph."""

    name: str  # the resolved train.compile mode
    inductor: str | None
    cuda_graph: bool

    def describe(self) -> str:
        model = f"compiled blocks ({self.inductor})" if self.inductor else "eager"
        return f"{self.name}: {model}" + (", whole step in a CUDA graph" if self.cuda_graph else "")


def check_compile(t: TrainConfig, task: Any) -> None:
    """Refuse CUDA graphs for a task whose batches change shape without bound.

    A task declares `static_shapes = True` when its training batches take a few fixed shapes (which its
    `warmup_batches` all show); `shape_note` says why not otherwise. `auto` never asks for graphs there.
    """
    if t.compile in CAPTURED and not task.static_shapes:
        raise ConfigError(f"compile: {t.compile} captures CUDA graphs, which need static shapes; {task.shape_note}:"
                          " use compile: default")


def resolve_mode(t: TrainConfig, task: Any, device: Any) -> StepMode:
    """The step mode `t.compile` means on `device` for `task` (see the table above)."""
    name = t.compile
    if name == "auto":
        name = ("reduce-overhead" if task.static_shapes else "default") if device.type == "cuda" else "off"
    inductor = None
    if name in COMPILED:
        # Our own CUDA graph replaces torch's ("max-autotune" alone would add cudagraph trees inside it).
        inductor = "max-autotune-no-cudagraphs" if name == "max-autotune" else "default"
    return StepMode(name, inductor, name in CAPTURED and device.type == "cuda" and task.static_shapes)


def configure_compile_caches() -> None:
    """Keep compiled code for every block kind a worker meets, and share kernels across processes and runs:
    Inductor's FX-graph and AOTAutograd caches on (on disk, beside the other headsearch caches unless
    TORCHINDUCTOR_CACHE_DIR says otherwise)."""
    import torch

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    dynamo = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.7; set whichever exists
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), RECOMPILE_LIMIT))
    if hasattr(dynamo, "accumulated_recompile_limit"):
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
    torch._inductor.config.fx_graph_cache = True
    functorch = torch._functorch.config
    if hasattr(functorch, "enable_autograd_cache"):
        functorch.enable_autograd_cache = True


def compile_blocks(model: Any, mode: StepMode, dynamic: bool | None) -> Any:
    """A twin of `model` for training steps whose transformer blocks are compiled (`mode.inductor`),
    sharing every parameter and buffer with `model`; `model` itself stays eager for evaluation and
    analysis. Returns `model` when the mode compiles nothing.

    Static-shape tasks leave `dynamic` to torch (specialise; a second batch size makes that dimension
    dynamic); others compile for dynamic shapes from the start instead of recompiling per length.
    """
    if mode.inductor is None:
        return model
    import torch

    from headsearch.models.transformer import DecoderBlock, EncoderBlock

    configure_compile_caches()

    def twin(module):
        """`module` with its children replaced where they are (or hold) blocks; the rest shared."""
        if isinstance(module, (EncoderBlock, DecoderBlock)):
            return torch.compile(module, mode=mode.inductor, dynamic=dynamic)
        children = dict(module.named_children())
        twins = {name: twin(child) for name, child in children.items()}
        if all(twins[name] is child for name, child in children.items()):
            return module
        copied = copy.copy(module)  # a new container: its own child table, the same parameters
        copied._modules = dict(module._modules)
        copied._modules.update(twins)
        return copied

    return twin(model)
