"""What trains a search's trials: a backend with slots that the search's one loop (`headsearch.search.loop`)
fills, trains an epoch at a time, and empties as trials end.

Three backends share that shape (Syne Tune's scheduler/backend split; Salinas et al. 2022): `SoloBackend`,
one slot that trains its trial to the end through `train_bound` (a plain search's worker);
`headsearch.training.cohort.Cohort`, K trials trained together as one stacked model; and
`headsearch.search.simulate.TableCohort`, which looks each epoch up in a table. Each has `free`,
`occupied`, `refusal(cfg)`, `resumes` (whether `add(..., resume=True)` goes on from a paused run), `add(...) -> slot`,
`train_epoch() -> [ends]` and `interrupt() -> [ends]`; an end has `slot`, `tag` (the trial's `TrialRun`), `result`
and `error`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headsearch.config import RunConfig
from headsearch.training import train_bound
from headsearch.training.records import SlotEnd, TrainResult

if TYPE_CHECKING:
    from headsearch.machine.fairtime import Seat
    from headsearch.search.definition import SearchDefinition
    from headsearch.tasks import DataSource, Task


@dataclass
class _Pending:
    cfg: RunConfig
    bound: Any
    run_dir: Path
    argv: list[str] | None
    clock: Any
    tag: Any
    callbacks: list
    resume: bool = False


class SoloBackend:
    """One slot whose trial trains to its end in one `train_epoch` (a pruner or an error ends it sooner)."""

    size = 1
    needs_data = True
    resumes = True  # `add(..., resume=True)`: the trial goes on from its paused state (headsearch.training.pause)

    def __init__(self, device):
        self.device = device
        self._pending: _Pending | None = None

    @property
    def free(self) -> bool:
        return self._pending is None

    @property
    def occupied(self) -> bool:
        return self._pending is not None

    def refusal(self, cfg: RunConfig) -> str | None:
        return None

    def add(self, cfg: RunConfig, bound, run_dir: Path, *, argv=None, clock=None, tag=None, callbacks=(),
            resume: bool = False) -> int:
        if self._pending is not None:
            raise ValueError("the solo backend's slot is taken")
        self._pending = _Pending(cfg, bound, run_dir, argv, clock, tag, list(callbacks), resume)
        return 0

    def train_epoch(self) -> list[SlotEnd]:
        """Train the trial in the slot to its end; the exception that ended it, if one did, is handed back."""
        p, self._pending = self._pending, None
        result, error = None, None
        try:
            result = train_bound(p.bound, p.run_dir, device=self.device, argv=p.argv, clock=p.clock,
                                 callbacks=p.callbacks, resume=p.resume)
        except BaseException as e:
            error = e
        try:
            return [SlotEnd(0, p.tag, result, error)]
        finally:
            # This frame -> `error` -> its traceback -> this frame (and fit's, holding the model, its graphs and
            # its optimizer state): a cycle only the cyclic collector would break. Without it, a pruned or failed
            # trial's GPU memory is free as soon as the loop lets its end go.
            error = None

    def interrupt(self) -> list[SlotEnd]:
        p, self._pending = self._pending, None
        return [] if p is None else [SlotEnd(0, p.tag, TrainResult(status="interrupted", primary_metric="", params=0))]


class DataCache:
    """The task's data bound to a trial's config: loaded once per worker, rebound for later trials."""

    def __init__(self, task: "Task", source: "DataSource"):
        self.task, self.source = task, source
        self._key: str | None = None
        self._bound = None
        self._cpu_bound = None

    def bound_for(self, cfg: RunConfig, device):
        key = cfg.key("data", "seed")
        if key != self._key:
            self._bound = self.task.setup(cfg, self.source, device)
            self._key = key
            return self._bound
        return self._bound.rebind(cfg)

    def cpu_data(self, base: RunConfig):
        """The data of `base` (the search's base config) loaded on the CPU: the plan's `step_footprint` loads
        it, and the data check that follows (`check`, `prepare`) reuses it and lets it go."""
        import torch

        if self._cpu_bound is None:
            self._cpu_bound = self.task.setup(base, self.source, torch.device("cpu"))
        return self._cpu_bound

    def check(self, base: RunConfig) -> None:
        """Load the data once on the CPU and let it go: missing or malformed data fails here (worker processes
        load their own)."""
        self.cpu_data(base)
        self._cpu_bound = None

    def prepare(self, base: RunConfig, device) -> None:
        """Load the data now, so that missing or malformed data fails before a study is created."""
        self.bound_for(base, device)
        self._cpu_bound = None  # a copy the plan loaded on the CPU is not needed any more


def soft_columns(definition: "SearchDefinition") -> int | None:
    """The soft-branch width a cohort keeps (None: the space never fuses): enough for the fewest heads it may sample."""
    from headsearch.models.cohort import soft_width
    from headsearch.models.variants import fusion_of

    space = definition.space
    if all(fusion_of(f).soft is None for f in (*space.fusions, definition.base.arch.fusion)):
        return None
    fewest = min(space.heads)
    if {"halving", "doubling"} & set(space.families):
        fewest = min(fewest, space.min_heads)
    return soft_width(definition.base.arch, max(1, fewest))


def machine_backend(definition: "SearchDefinition", seat: "Seat", cohort_size: int) -> Any:
    """The backend a worker's plan asks for on its `seat`'s device: one slot, or a cohort of `cohort_size` (held
    shared under the seat's hold on the device's lock)."""
    if cohort_size <= 1:
        return SoloBackend(seat.device)
    from headsearch.training.cohort import Cohort  # torch: not loaded by a worker that never trains a cohort

    return Cohort(definition.task, cohort_size, seat.device, soft_columns=soft_columns(definition), share=seat.share)

