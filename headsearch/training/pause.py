"""A paused run: everything `trainer.fit` needs to go on from the end of an epoch as if it had never stopped.

A callback stops a run for later by raising `PauseRun` from `on_epoch_end` (a search's pruning rule that pauses
rather than kills: `headsearch.search.trial_pruning`). `fit` then writes `records.PAUSE` in the run directory,
atomically:

- the weights, and the best weights so far (the final test is measured on those);
- the steps' state (`Steps.state_dict`): the optimizer's moments and step counts, the learning-rate schedule's
  position, the step counters;
- every random state a later epoch draws from: torch's (CPU, and the run's CUDA device), Python's, NumPy's, and
  the task's own data order where it carries one across epochs (`data_state`: the ViT's generator of shuffles
  and augmentations; translation shuffles each epoch from (seed, epoch) and carries none);
- the result so far (`TrainResult`, its history included) and the wall time spent.

`fit(..., resume=True)` builds and warms the run up as usual, then puts all of that back before its next epoch,
and writes the run directory's metrics.jsonl and best checkpoint again from it: a resumption that died midway
leaves nothing behind that the next one would read twice. On the CPU the continued run equals an uninterrupted
one bit for bit (tests/test_pause.py).
"""
from __future__ import annotations

import io
import json
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headsearch.errors import HeadsearchError
from headsearch.io import write_atomic
from headsearch.training.records import EpochRecord, TrainResult
FORMAT = 1  # the layout of PAUSE's dict; a file of another is refused in one line


def save_pause(path: Path, *, epoch: int, model: torch.nn.Module, steps, bound, result: TrainResult,
               best_state: dict[str, torch.Tensor] | None, wall_seconds: float) -> None:
    """Write the run's state at the end of `epoch` to `path` (atomically: a crash while writing leaves the
    previous pause, if any, whole)."""
    device = next(iter(model.parameters())).device
    data_state = getattr(bound, "data_state", None)
    saved = {
        "format": FORMAT,
        "epoch": epoch,
        "model": _on_cpu(model.state_dict()),
        "best_state": _on_cpu(best_state) if best_state is not None else None,
        "steps": steps.state_dict(),
        "rng": _random_states(device),
        "data": data_state() if data_state is not None else None,
        "result": result.to_dict(with_history=True),
        "wall_seconds": wall_seconds,
    }
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    write_atomic(path, buffer.getvalue())


def load_pause(path: Path, device: torch.device) -> dict[str, Any]:
    """The state `save_pause` wrote to `path`; a missing, unreadable or foreign file is one HeadsearchError line."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise HeadsearchError(f"{path}: no paused run to resume here (it was removed, or the run never paused)") from None
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HeadsearchError(f"{path}: not a paused run's state ({first}): remove it and train the run again from"
                              " the start") from None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise HeadsearchError(f"{path}: a paused run's state of another format than this headsearch reads"
                              f" ({saved.get('format') if isinstance(saved, dict) else type(saved).__name__}):"
                              " train the run again from the start")
    return saved


def resume_run(saved: dict[str, Any], *, model: torch.nn.Module, steps, bound, run, device: torch.device) -> int:
    """Put `saved` back into a built and warmed-up run (`trainer.Run` `run`, its `model` and `steps`): the epoch
    after the pause is returned. The run directory's metrics.jsonl and best checkpoint are written again from it."""
    with torch.no_grad():
        model.load_state_dict(saved["model"])
    steps.load_state_dict(saved["steps"])
    _set_random_states(saved["rng"], device)
    load_data_state = getattr(bound, "load_data_state", None)
    if saved["data"] is not None:
        if load_data_state is None:
            raise HeadsearchError(f"task {bound.cfg.task}: its paused run saved a data order this task cannot load"
                                  " (no load_data_state)")
        load_data_state(saved["data"])
    now = run.result
    result = result_from_dict(saved["result"])
    # This run's warm-up is its own: its step mode, and its seconds added to the first part's.
    result.step_mode, result.step_note = now.step_mode, now.step_note
    result.compile_seconds += now.compile_seconds
    result.resumed_at = int(saved["epoch"])
    run.result = result
    run.best_state = {k: v.to(device) for k, v in saved["best_state"].items()} if saved["best_state"] else None
    run.started -= float(saved["wall_seconds"])  # the wall clock goes on from where it stopped
    run.rewrite_kept()
    return int(saved["epoch"]) + 1


def result_from_dict(d: dict[str, Any]) -> TrainResult:
    """A `TrainResult` from its `to_dict(with_history=True)`."""
    return TrainResult(**{**d, "history": [EpochRecord(**h) for h in d.get("history", [])]})


def history_lines(result: TrainResult) -> str:
    """metrics.jsonl's text for `result`'s history: one JSON line an epoch, as `Run.keep_epoch` appends them."""
    return "".join(json.dumps(asdict(record)) + "\n" for record in result.history)


def _on_cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def _random_states(device: torch.device) -> dict[str, Any]:
    """Every generator a later epoch may draw from, as plain values and tensors (`torch.load(weights_only=True)`
    reads them back)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(mt), gauss],
        "numpy": [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _set_random_states(states: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    version, mt, gauss = states["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
