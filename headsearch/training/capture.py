"""CUDA-graph capture's helpers: memory pool, stream, recovery from a failed capture, and batches as a graph sees them."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch

from headsearch.environment import env_flag


class CaptureBrokeCuda(RuntimeError):
    """A failed capture left CUDA unusable in this process (its RNG stuck in capture mode): no fallback can
    run here, so the trainer raises this instead of falling back. Restart the process."""


def shared_graph_pool() -> bool:
    """Whether a run's graphs share one memory pool (HEADSEARCH_SHARED_GRAPH_POOL=1). Off by default: sharing
    is argued safe (`GraphSteps._capture`) and saves memory on tasks with many shapes, but it has not yet run
    on a GPU; `benchmarks/gpu.sh checks` runs its test."""
    return env_flag("HEADSEARCH_SHARED_GRAPH_POOL")


_CAPTURE_STREAMS: dict[int, Any] = {}  # device index -> the stream every capture on that device uses


def capture_stream(device: torch.device):
    """The stream captures on `device` use, one per device for the process: a new stream per run would come
    round the stream pool's 32 and allocate a cuBLAS workspace (keyed by handle and stream) for each."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(torch.device("cuda", index))
    return _CAPTURE_STREAMS[index]


@contextlib.contextmanager
def recover_failed_capture(device: torch.device):
    """Around `torch.cuda.graph(...)` on `device` (the current device): when the capture fails, put back
    the current stream and the default CUDA generator's state, check that random numbers can be drawn, and
    re-raise the capture's error (the trainer then falls back, with a note), or raise `CaptureBrokeCuda`.

    Why:
    - `torch.cuda.graph.__exit__` calls `capture_end()` before `stream_ctx.__exit__` (torch/cuda/graphs.py,
      as of 2.14 too), so when `capture_end` throws (cudaStreamEndCapture fails because the captured code
      synchronised or read the device) the capture stream stays the current one: later work would run on it.
    - `CUDAGraph::capture_end` throws there before `capture_epilogue` takes the default generator's state
      out of capture mode (aten/src/ATen/cuda/CUDAGraph.cpp), and up to torch 2.12 that state stays in
      capture mode for good: every later draw raises "Offset increment outside graph capture encountered
      unexpectedly" (CUDAGeneratorState::increase), so dropout in the eager fallback and in every later
      trial of the worker fails. `Generator.clone_state()` returns a new Generator holding a copy of the
      state's seed and offset (CUDAGeneratorState::clone; the copy is not in capture mode), and
      `graphsafe_set_state(saved)` makes the default generator use that state (CUDAGeneratorImpl; both are
      in torch/_C/__init__.pyi's Generator, checked with hasattr). Graphs captured earlier for other shapes
      keep the old state, but they belong to the failed run's steps, which the trainer drops.
    - The probe tells whether that was enough; if not, going on would fail later with a baffling error.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(device)  # initialises CUDA: default_generators is filled from here on
    generators = getattr(torch.cuda, "default_generators", ())
    generator = generators[index] if index < len(generators) else None
    saved = None
    if generator is not None and hasattr(generator, "clone_state") and hasattr(generator, "graphsafe_set_state"):
        try:
            saved = generator.clone_state()  # taken before capture begins: not in capture mode
        except RuntimeError:  # a torch whose CUDA generator cannot clone: capture as before, unguarded
            saved = None
    try:
        yield
    except BaseException as error:
        torch.cuda.set_stream(stream)
        if saved is not None:
            generator.graphsafe_set_state(saved)
        if not isinstance(error, Exception):
            raise  # KeyboardInterrupt and the like: as they are, with the stream and RNG put back
        broken = None
        try:
            torch.rand(1, device=device)
        except torch.cuda.OutOfMemoryError:
            pass  # too little memory left to tell: the trainer drops the failed attempt and falls back
        except RuntimeError as probe:
            broken = " ".join(str(probe).split())[:120]
        if broken is not None:
            raise CaptureBrokeCuda(
                "a failed CUDA graph capture left CUDA's random number generator unusable in this process"
                f" (torch older than 2.13; {broken}): restart the process") from error
        raise


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of a batch (a tuple or list of tensors, a dataclass or a mapping), in field order."""
    if dataclasses.is_dataclass(batch):
        values = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    elif isinstance(batch, dict):
        values = list(batch.values())
    else:
        values = list(batch)
    return [v for v in values if isinstance(v, torch.Tensor)]


def batch_numel(batch: Any) -> int:
    """How many elements a batch's tensors hold: its size, for capturing the largest shape first."""
    return sum(v.numel() for v in batch_tensors(batch))


def signature(batch: Any) -> tuple:
    """Shapes and dtypes of a batch's tensors: batches with equal signatures replay the same graph."""
    return tuple((tuple(v.shape), v.dtype) for v in batch_tensors(batch))


def clone_batch(batch: Any) -> Any:
    """The same batch in new memory (a graph's input buffers); plain values are kept as they are."""
    copy: Callable[[Any], Any] = lambda v: v.clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    if dataclasses.is_dataclass(batch):
        return dataclasses.replace(batch, **{f.name: copy(getattr(batch, f.name)) for f in dataclasses.fields(batch)})
    if isinstance(batch, dict):
        return {k: copy(v) for k, v in batch.items()}
    return list(map(copy, batch)) if isinstance(batch, list) else tuple(map(copy, batch))
