"""The task registry, and the one way a run's configuration is resolved.

Registering is cheap: torch and the data libraries are only imported when a task binds to data
(`Task.setup`), so `headsearch tasks` answers at once.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable, Mapping

from headsearch.config import ArchConfig, RunConfig, TrainConfig, is_run_config, load_yaml
from headsearch.errors import ConfigError, HeadsearchError
from headsearch.tasks.base import Task

_REGISTRY: dict[str, Task] = {}


def register(task: Task) -> Task:
    """Add (or replace) a task; a test or a plug-in module can register its own."""
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


def apply_overrides(task: Task, cfg: RunConfig, overrides: Mapping[str, Any]) -> RunConfig:
    """Merge a mapping with optional `arch`, `train`, `data` sections and `seed` over `cfg`."""
    if not isinstance(overrides, Mapping):
        raise ConfigError("a config must be a mapping of sections (task, seed, arch, train, data) to values")
    unknown = set(overrides) - {"task", "arch", "train", "data", "seed"}
    if unknown:
        raise ConfigError(f"unknown config section(s) {', '.join(sorted(unknown))}: use task, seed, arch, train, data")
    if overrides.get("task", task.name) != task.name:
        raise ConfigError(f"the config is for task {overrides['task']!r}, not {task.name!r}: pass --task {overrides['task']}")
    for section in ("arch", "train", "data"):
        if overrides.get(section) is not None and not isinstance(overrides[section], Mapping):
            raise ConfigError(f"config section {section!r} must be a mapping of keys to values (or left out),"
                              f" not {overrides[section]!r}")
    unknown_data = sorted(set(overrides.get("data") or {}) - {f.name for f in fields(task.data_options)})
    if unknown_data:
        raise ConfigError(f"unknown data option(s) {', '.join(unknown_data)} for task {task.name}: known are"
                          f" {', '.join(f.name for f in fields(task.data_options))}")
    return RunConfig(
        task=task.name,
        arch=ArchConfig.from_dict(overrides.get("arch") or {}, base=cfg.arch),
        train=TrainConfig.from_dict(overrides.get("train") or {}, base=cfg.train),
        data=task.data_options.from_dict(overrides.get("data") or {}, base=cfg.data),
        seed=overrides.get("seed", cfg.seed),
    )


def flag_overrides(*, seed: int | None = None, **train: Any) -> dict[str, Any]:
    """Command-line flags as an overrides mapping: `seed`, and training fields (epochs, compile,
    diversity_samples, ...); flags left at None are not given."""
    out: dict[str, Any] = {}
    given = {k: v for k, v in train.items() if v is not None}
    if given:
        out["train"] = given
    if seed is not None:
        out["seed"] = seed
    return out


def resolve_config(
    task: str | Task,
    *,
    preset: str | None = None,
    search: bool = False,
    config: Path | Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> RunConfig:
    """The one resolution of a run's configuration, used by train, run, export and analyze.

    Precedence: the task's defaults < `preset` (with its `search` section when `search`, the smaller
    per-trial budget of a search) < `config` (a YAML path or a mapping: a full run config, as written
    into run directories and by `export`, or architecture fields only) < `overrides` (command-line flags,
    see `flag_overrides`). Every value is validated on the way, before any data loads.
    """
    task = task if isinstance(task, Task) else get_task(task)
    cfg = task.default_config()
    if preset is not None:
        if preset not in task.presets:
            raise ConfigError(f"task {task.name} has no preset {preset!r}: use one of {', '.join(task.presets)}")
        sections = dict(task.presets[preset])
        search_sections = sections.pop("search", None)
        cfg = apply_overrides(task, cfg, sections)
        if search and search_sections:
            cfg = apply_overrides(task, cfg, search_sections)
    if config is not None:
        d = config if isinstance(config, Mapping) else load_yaml(config)
        cfg = apply_overrides(task, cfg, d if is_run_config(d) else {"arch": d})
    return apply_overrides(task, cfg, overrides) if overrides else cfg
