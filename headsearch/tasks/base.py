"""What a task is: its metrics, presets and data options, and the protocol of a task bound to its data.

Training, analysis and search ask a task everything they need through `Task` and `BoundTask`; none
of them tests a task's name or attributes. Adding a task is one module that builds a `Task`, named by an
entry point in the group `headsearch.tasks` or by `--task package.module:attr` (docs/architecture.md);
`register` reaches only the calling process, so it serves tests, not worker processes.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol

from headsearch.config import RunConfig
from headsearch.errors import ConfigError


@dataclass(frozen=True)
class Metric:
    name: str
    direction: str  # "maximize" or "minimize"
    description: str = ""

    def better(self, a: float, b: float) -> bool:
        """True when `a` is strictly better than `b`."""
        return a > b if self.direction == "maximize" else a < b


@dataclass(frozen=True)
class DataSource:
    """Where a task reads its data: a local directory, a local file, or (neither) the real download."""

    data_dir: Path | None = None
    data_file: Path | None = None

    def describe(self) -> str:
        return str(self.data_dir or self.data_file or "download")


# -- what analysis draws: attention views a task returns ----------------------------------------


@dataclass
class PatchAttention:
    """An image model's attention with one class token before a square grid of patches.

    `weights`/`soft`: per attention layer (N, H, T, T) with T = 1 + grid**2 (soft: the soft-attention
    branch's weights of a fusion model, None without fusion). Analysis derives the class token's
    maps over the grid and the attention rollout from them.
    """

    images: Any  # (N, height, width, channels) uint8, as stored
    labels: list[str]
    predictions: list[str]
    weights: list[Any]
    soft: list[Any]
    grid: int


@dataclass
class TokenAttention:
    """Attention between two token sequences of one example, e.g. a translation's output tokens
    (rows, queries) over its source tokens (columns, keys), per layer (H, len(output), len(source))."""

    source_tokens: list[str]
    output_tokens: list[str]
    layers: list[Any]


AnalysisBatch = Mapping[str, Any]  # {"inputs": tuple of model inputs, "masks": {...}, "targets": tensor}


class BoundTask(Protocol):
    """A task bound to its loaded data on a device: all that training, analysis and search use.

    Training: `build_model`, `batches_per_epoch`, `train_batches`, `warmup_batches` (one batch of each
    shape an epoch will show, for compiling before the clock starts), `loss`, `evaluate`,
    `write_artifacts` (before training: splits, tokenizers) and `write_outputs` (after the test
    evaluation). Search: `rebind` (the same data under another config). Analysis: `with_eval_limit`,
    `analysis_batches` (fixed evaluation batches with padding masks), `summed_loss` (for head
    importance) and `attention_views` (what the attention maps show).

    A training step (`loss` on a batch of `train_batches`, then backward and the optimizer) must be pure
    device work: nothing read back to the host (no `.item()`, `bool()` of a tensor, data-dependent
    shapes), so that the trainer can capture it in a CUDA graph; batches of equal tensor shapes must be
    interchangeable for `loss` (plain numbers in a batch are not used by it).

    A task whose `train_batches` draw from a generator that goes on across epochs (rather than one seeded by the
    epoch) also has `data_state()` and `load_data_state(state)`, so that a paused run resumes with the same data
    order (`headsearch.training.pause`; the ViT's). They are optional, and not in this protocol for that reason.
    """

    cfg: RunConfig  # the config it is bound to: what training reads (`rebind` gives another)
    n_train: int  # training samples per epoch

    def build_model(self) -> Any: ...
    def batches_per_epoch(self) -> int: ...
    def train_batches(self, epoch: int) -> Iterator[Any]: ...
    def warmup_batches(self, steps_per_epoch: int) -> list[Any]: ...
    def loss(self, model: Any, batch: Any, label_smoothing: float) -> tuple[Any, int]: ...
    def evaluate(self, model: Any, split: str) -> dict[str, float]: ...
    def write_artifacts(self, run_dir: Path) -> None: ...
    def write_outputs(self, run_dir: Path) -> None: ...
    def rebind(self, cfg: RunConfig) -> "BoundTask": ...
    def with_eval_limit(self, n: int | None) -> "BoundTask": ...
    def analysis_batches(self, split: str, samples: int | None, batch_size: int) -> list[AnalysisBatch]: ...
    def summed_loss(self, model: Any, batch: AnalysisBatch) -> tuple[Any, int]: ...
    def attention_views(self, model: Any, samples: int = ...) -> list[PatchAttention | TokenAttention]: ...


@dataclass(frozen=True)
class Task:
    """A registered task. `setup(cfg, source, device, run_dir=None)` loads the data and returns a
    `BoundTask` (`run_dir`: reload a trained run's own artifacts, e.g. its tokenizers).

    `data_options` is the task's frozen dataclass of data options (validated on construction, with
    `from_dict(d, base)` and `to_dict()`); `static_shapes` says whether every training batch has the same
    shape (up to an epoch's last), which CUDA graphs need, and `shape_note` why not. A task whose
    `stack_refusal` is set can train cohorts.
    """

    name: str
    description: str
    metrics: tuple[Metric, ...]
    default_config: Callable[[], RunConfig]
    presets: Mapping[str, Mapping[str, Any]]  # name -> {"arch": {...}, "train": {...}, "data": {...}, "search": {...}}
    data_options: type
    check_source: Callable[[DataSource], None]
    setup: Callable[..., BoundTask] = field(repr=False)
    static_shapes: bool = False
    shape_note: str = "this task's batches vary in shape"
    # Checks of a resolved config that need the task but not its data (run before data loads).
    check_config: Callable[[RunConfig], None] = field(default=lambda cfg: None, repr=False)
    # The model's size for a config, before any data loads (headsearch.models.size): training checks
    # it against the device's memory. None: no size guard for this task.
    footprint: Callable[[RunConfig], Any] | None = field(default=None, repr=False)
    # The footprint of an average training step on the loaded data, for a task whose step cost depends on
    # it (translation: its sentences' padded lengths, mostly far below max_len): `data_footprint(cfg, bound)`
    # on a bound task (loaded on the CPU). The search's plan uses it for its rule; None: `footprint` alone.
    data_footprint: Callable[[RunConfig, Any], Any] | None = field(default=None, repr=False)
    # Whether its bound task can train several architectures as one stacked model (a cohort,
    # headsearch.training.cohort): then it has `build_cohort(models, soft_columns)` and
    # `cohort_loss(stacked, batches, label_smoothing)`, and `stack_refusal(cfg)` says which configs cannot.
    stack_refusal: Callable[[RunConfig], str | None] | None = field(default=None, repr=False)

    @property
    def primary(self) -> Metric:
        return self.metrics[0]

    def metric(self, name: str) -> Metric:
        for m in self.metrics:
            if m.name == name:
                return m
        raise ConfigError(f"task {self.name} has no metric {name!r}: its metrics are {', '.join(m.name for m in self.metrics)}")


# -- helpers the tasks share --------------------------------------------------------------------


def seeded_subset(indices: Any, limit: int | None, seed: int, what: str = "training samples") -> Any:
    """`limit` of `indices`, drawn with `seed + 1` (independent of a split drawn with `seed`), sorted;
    all of them when `limit` is None."""
    import numpy as np

    if not limit:
        return indices
    if not 0 < limit <= len(indices):
        raise ConfigError(f"train_limit = {limit} must be between 1 and {len(indices)} (the {what} available)")
    return np.sort(np.random.default_rng(seed + 1).permutation(indices)[:limit])


def rebound(bound: Any, cfg: RunConfig, **fresh: Any) -> Any:
    """A shallow copy of a bound task under another config, sharing its loaded data; `fresh` sets the
    attributes that must not be shared (random generators, per-run outputs)."""
    new = copy.copy(bound)
    new.cfg = cfg
    for name, value in fresh.items():
        setattr(new, name, value)
    return new


def limited(bound: Any, n: int | None, cut: Callable[[Any, int], Any]) -> Any:
    """A shallow copy whose evaluation sets (`bound.eval_sets`, split -> data) keep their first `n` items,
    cut by `cut(data, n)`; the same sets when `n` is None."""
    new = copy.copy(bound)
    if n:
        new.eval_sets = {split: cut(data, n) for split, data in bound.eval_sets.items()}
    return new
