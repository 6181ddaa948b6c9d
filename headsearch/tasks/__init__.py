"""The task registry.

A task names its metrics (the first is the one selected on), its presets, its seed's default
configuration, and how to bind to data. Registering is cheap: torch and the data libraries are only
imported when a task binds to data (`Task.setup`), so `headsearch tasks` answers at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol

from headsearch.config import ArchConfig, RunConfig, TrainConfig
from headsearch.errors import ConfigError, HeadsearchError


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


class BoundTask(Protocol):
    """A task bound to loaded data on a device: what the trainer drives."""

    n_train: int  # training samples per epoch

    def build_model(self) -> Any: ...
    def train_batches(self, epoch: int) -> Iterator[Any]: ...
    def loss(self, model: Any, batch: Any, label_smoothing: float) -> tuple[Any, int]: ...
    def evaluate(self, model: Any, split: str) -> dict[str, float]: ...
    def write_artifacts(self, run_dir: Path) -> None: ...
    def rebind(self, cfg: RunConfig) -> "BoundTask": ...  # same data (same data options and seed), new config
    def with_eval_limit(self, n: int | None) -> "BoundTask": ...  # validation/test cut to n samples
    # Optional, for torch.compile (headsearch/training/fastpath.py): `static_shapes` (bool, default False),
    # `shape_note` (why not), `warmup_shapes(batch, steps_per_epoch)` (one batch per shape an epoch sees).


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    metrics: tuple[Metric, ...]
    default_config: Callable[[], RunConfig]
    presets: Mapping[str, Mapping[str, Any]]  # name -> {"arch": {...}, "train": {...}, "data": {...}}
    data_options: Mapping[str, Any]  # known data option -> default
    check_source: Callable[[DataSource], None]
    setup: Callable[..., BoundTask] = field(repr=False)  # (cfg, source, device, run_dir=None): run_dir reloads a run's artifacts
    # Checks of a resolved config that need the task but not its data (run before data loads).
    check_config: Callable[[RunConfig], None] = field(default=lambda cfg: None, repr=False)

    @property
    def primary(self) -> Metric:
        return self.metrics[0]

    def metric(self, name: str) -> Metric:
        for m in self.metrics:
            if m.name == name:
                return m
        raise ConfigError(f"task {self.name} has no metric {name!r}: its metrics are {', '.join(m.name for m in self.metrics)}")

    def config(self, preset: str | None = None, *, search: bool = False) -> RunConfig:
        """The seed's configuration, with a preset's overrides applied.

        A preset may carry a `search` section, applied on top for search trials only: a search
        trains dozens of models, so its per-trial budget is smaller than a single run's.
        """
        cfg = self.default_config()
        if preset is None:
            return cfg
        if preset not in self.presets:
            raise ConfigError(f"task {self.name} has no preset {preset!r}: use one of {', '.join(self.presets)}")
        overrides = dict(self.presets[preset])
        search_overrides = overrides.pop("search", None)
        cfg = apply_overrides(self, cfg, overrides)
        return apply_overrides(self, cfg, search_overrides) if search and search_overrides else cfg


def apply_overrides(task: Task, cfg: RunConfig, overrides: Mapping[str, Any]) -> RunConfig:
    """Merge a mapping with optional `arch`, `train`, `data` sections and `seed` over `cfg`."""
    unknown = set(overrides) - {"task", "arch", "train", "data", "seed"}
    if unknown:
        raise ConfigError(f"unknown config section(s) {', '.join(sorted(unknown))}: use task, seed, arch, train, data")
    if overrides.get("task", task.name) != task.name:
        raise ConfigError(f"the config is for task {overrides['task']!r}, not {task.name!r}: pass --task {overrides['task']}")
    for section in ("arch", "train", "data"):
        if section in overrides and not isinstance(overrides[section] or {}, Mapping):
            raise ConfigError(f"config section {section!r} must be a mapping of keys to values")
    data = dict(cfg.data)
    new_data = dict(overrides.get("data") or {})
    unknown = set(new_data) - set(task.data_options)
    if unknown:
        raise ConfigError(
            f"unknown data option(s) {', '.join(sorted(unknown))} for task {task.name}: known are {', '.join(task.data_options)}"
        )
    data.update({k: _data_value(k, v, task.data_options[k]) for k, v in new_data.items()})
    seed = overrides.get("seed", cfg.seed)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed = {seed!r} must be a non-negative integer")
    return RunConfig(
        task=task.name,
        arch=ArchConfig.from_dict(overrides.get("arch") or {}, base=cfg.arch),
        train=TrainConfig.from_dict(overrides.get("train") or {}, base=cfg.train),
        data=data,
        seed=seed,
    )


def _data_value(name: str, value: Any, default: Any) -> Any:
    """Data options take the type of their default: a list, or a number (None allowed where the default is None)."""
    if isinstance(default, list):
        if not isinstance(value, list):
            raise ConfigError(f"data.{name} = {value!r} must be a list, e.g. {default}")
        return value
    if value is None:
        if default is None:
            return None
        raise ConfigError(f"data.{name} must be a number (default {default})")
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"data.{name} = {value!r} must be a number") from None
    return int(number) if number.is_integer() and not (isinstance(value, float) and 0 < value < 1) else number


_REGISTRY: dict[str, Task] = {}


def register(task: Task) -> Task:
    _REGISTRY[task.name] = task
    return task


def get_task(name: str) -> Task:
    _load_builtin()
    if name not in _REGISTRY:
        raise HeadsearchError(f"unknown task {name!r}: use one of {', '.join(sorted(_REGISTRY))} (see `headsearch tasks`)")
    return _REGISTRY[name]


def all_tasks() -> Iterable[Task]:
    _load_builtin()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def _load_builtin() -> None:
    # Importing registers; these modules import only light things at module level.
    from headsearch.tasks import translation, vit_cifar10  # noqa: F401
