"""What a training run hands back and the hooks it calls, apart from the trainer that imports torch: a trial
looked up in a table (`headsearch.search.simulate`, the light workers of `headsearch.search.light`) makes the
same records and calls the same callbacks without loading torch. `headsearch.training.trainer` re-exports them."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from headsearch.tasks import BoundTask


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
    epoch_seconds_alone: float | None = None  # the run's epoch seconds with the device to itself (AloneClock), if known
    params: int | None = None  # the model's parameter count


@dataclass
class TrainResult:
    status: str  # "completed", "interrupted", "diverged", "stopped" or "paused" (by a callback) or "failed"
    primary_metric: str
    params: int
    epochs_run: int = 0
    steps: int = 0
    best_epoch: int | None = None
    best_value: float | None = None
    best_train_seconds: float | None = None  # raw: as measured, whatever else shared the device
    best_wall_seconds: float | None = None
    epoch_seconds_alone: float | None = None  # one epoch's training seconds with the device to itself (AloneClock)
    best_seconds_alone: float | None = None  # best_epoch x epoch_seconds_alone: the search's `time`
    target: float | None = None
    seconds_to_target: float | None = None  # training seconds when the validation metric first reached target
    train_seconds: float = 0.0
    wall_seconds: float = 0.0
    compile_seconds: float = 0.0  # warm-up before training (compiling, capturing graphs); outside every other timing
    step_mode: str = ""  # how steps ran (headsearch.training.fastpath.StepMode.describe)
    step_note: str | None = None  # why a faster mode was given up, if one was
    uncaptured_steps: int = 0  # steps of a batch shape no warm-up showed (run outside the CUDA graphs)
    samples: int = 0  # training samples processed
    samples_per_s: float = 0.0  # samples / train_seconds
    best_metrics: dict[str, float] = field(default_factory=dict)
    best_diversity: dict[str, float] = field(default_factory=dict)  # at the best epoch, when tracked
    test_metrics: dict[str, float] = field(default_factory=dict)
    history: list[EpochRecord] = field(default_factory=list)
    error: str | None = None
    resumed_at: int | None = None  # the epoch it was paused after and resumed from (`headsearch.training.pause`)

    def to_dict(self, with_history: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_history:
            d.pop("history")
        return d


PAUSE = "pause.pt"  # a paused run's state, in its run directory (`headsearch.training.pause`)


class PauseRun(Exception):
    """Raised by a callback's `on_epoch_end` to stop the run with its state kept, so that it can go on later as if
    it had never stopped (`headsearch.training.pause`): a search's trial paused rather than pruned. The trainer
    sets `kept` to the file it kept the state in (None: it kept none, e.g. a run without a directory)."""

    kept: str | None = None


class Callback:
    """Hooks into training. Raising from `on_epoch_end` stops the run (a pruner raises TrialPruned; `PauseRun`
    stops it with its state kept).

    `on_evaluate` runs after each validation, before the epoch's record is kept and written: a
    callback may add measurements of the model to it (the diversity tracker of `headsearch.analysis`
    fills `record.diversity`), outside the training time.
    """

    def on_start(self, steps_per_epoch: int, epochs: int) -> None: ...
    def on_prepared(self, step_mode: str, warm_up_seconds: float, note: str | None) -> None: ...
    def on_step(self, info: StepInfo) -> None: ...
    def on_evaluate(self, model: torch.nn.Module, bound: BoundTask, record: EpochRecord) -> None: ...
    def on_epoch_end(self, record: EpochRecord) -> None: ...


@dataclass
class SlotEnd:
    """A run that left its slot: its result (status completed, stopped, diverged or failed) and, unless it
    completed, the exception that ended it (a pruner's, `Diverged`, a callback's error)."""

    slot: int
    tag: Any
    result: TrainResult | None
    error: BaseException | None = None
