"""What `headsearch bench` measured on a machine, kept in headsearch's cache for `headsearch run` to plan from.

A measurement is a table of ways to run a search's trials (`Way`: K processes in a step mode, with or
without NVIDIA MPS, or a cohort of K trials stacked into one model; on a CPU, processes x threads), each
verified before it was timed, with its samples per second in aggregate and per trial. It is saved under
`$HEADSEARCH_CACHE/bench/<key>.json`, keyed by what the speed depends on (`bench_key`): the device's
model, torch's version, the task, and the base configuration's architecture, data options and the
training fields that change a step's cost. `run` uses the fastest verified way of the measurement with
its key (`load_measurement`); a way that failed or did not match its reference is never chosen.

This module is data only (no torch): the plan reads it, `headsearch.machine.bench` writes it.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from headsearch.environment import cache_root
from headsearch.io import write_atomic

PROCESSES, COHORT = "processes", "cohort"
# Training fields that change what one step costs (the learning rate and the like do not).
STEP_COST_FIELDS = ("batch_size", "amp", "channels_last", "grad_clip", "optimizer")


@dataclass(frozen=True)
class Way:
    """One way to run a search's trials on one device: `k` trials at once as `k` processes (`kind`
    "processes") or as one stacked model (`kind` "cohort"), their steps in `step_mode` (a
    `train.compile` value), under NVIDIA MPS or not, with `threads` CPU threads per process (a CPU's
    choice; None on a GPU)."""

    kind: str
    k: int
    step_mode: str
    mps: bool = False
    threads: int | None = None

    def describe(self) -> str:
        if self.kind == COHORT:
            what = f"a cohort of {self.k} (one stacked model, eager)"
        else:
            what = f"{self.k} process{'es' * (self.k > 1)}, {self.step_mode}"
        if self.threads is not None:
            what += f", {self.threads} thread{'s' * (self.threads > 1)} each"
        return what + (" + MPS" if self.mps else "")


@dataclass(frozen=True)
class WayResult:
    """A way as measured: `verified` (it ran as asked and computed what its reference computes), else
    `reason` (one line); samples per second over all its trials (`samples_per_s`) and per trial, and
    the warm-up seconds (compiling, capturing) of one trial."""

    way: Way
    verified: bool
    reason: str | None = None
    samples_per_s: float = 0.0
    per_trial: float = 0.0
    compile_seconds: float = 0.0


@dataclass(frozen=True)
class Measurement:
    """`headsearch bench`'s result on one machine for one task and base architecture."""

    key: str
    date: str  # ISO date of the measurement
    device: str  # the GPU's model, or "cpu <arch> x<cores>"
    torch: str
    task: str
    results: tuple[WayResult, ...]
    seconds: float = 0.0  # how long the bench took
    what: dict[str, Any] = field(default_factory=dict)  # what the key was computed from

    def choice(self, cohorts: bool = True) -> WayResult | None:
        """The fastest verified way (aggregate samples per second), or None when no way was verified;
        without `cohorts`, the fastest that is not one (`--cohort 1`, or a base config that cannot stack)."""
        verified = [r for r in self.results if r.verified and (cohorts or r.way.kind != COHORT)]
        return max(verified, key=lambda r: r.samples_per_s) if verified else None

    def to_dict(self) -> dict[str, Any]:
        choice = self.choice()
        return {**asdict(self), "choice": asdict(choice) if choice else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Measurement":
        d = {k: v for k, v in d.items() if k != "choice"}
        results = tuple(WayResult(**{**r, "way": Way(**r["way"])}) for r in d["results"])
        return cls(**{**d, "results": results})


def cpu_name() -> str:
    """A CPU machine as speed sees it: its architecture and core count."""
    import platform

    return f"cpu {platform.machine()} x{os.cpu_count()}"


def key_inputs(device: str, torch_version: str, cfg: Any, fields: tuple[str, ...] = STEP_COST_FIELDS) -> dict[str, Any]:
    """What a measurement's speed depends on, for the run config `cfg` (the search's base config): the training
    `fields` that change a step's cost (or, for the fair clock's `alone_key`, an epoch's)."""
    train = cfg.train.to_dict()
    return {"device": device, "torch": torch_version, "task": cfg.task, "arch": cfg.arch.to_dict(),
            "data": cfg.data.to_dict() if hasattr(cfg.data, "to_dict") else cfg.data,
            "train": {k: train[k] for k in fields}}


def bench_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:20]


def measurement_path(key: str) -> Path:
    return cache_root() / "bench" / f"{key}.json"


def save_measurement(m: Measurement) -> Path:
    path = measurement_path(m.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(m.to_dict(), indent=2) + "\n")
    return path


def load_measurement(key: str) -> Measurement | None:
    """The saved measurement with `key`, or None (none saved, or a file this version cannot read)."""
    try:
        return Measurement.from_dict(json.loads(measurement_path(key).read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None
