"""The task registry, and the one way a run's configuration is resolved.

Registering is cheap: torch and the data libraries are only imported when a task binds to data
(`Task.setup`), so `headsearch tasks` answers at once.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from headsearch.config import ArchConfig, RunConfig, TrainConfig, is_run_config, load_yaml
from headsearch.errors import ConfigError, HeadsearchError
from headsearch.tasks.base import Task

ENTRY_POINT_GROUP = "headsearch.tasks"
# The built-in tasks, found the way plugins are (the same references are the package's own entry points in
# pyproject.toml); listed here too so that a source tree that was never installed still has them.
BUILTIN = {"vit-cifar10": "headsearch.tasks.vit_cifar10:TASK", "translation-en-es": "headsearch.tasks.translation:TASK"}

_REGISTRY: dict[str, Task] = {}
# How a task loaded from a `module:attr` reference is found again by another process (a worker, a later
# `report`): its configs, studies and run directories name it by this reference.
_REFERENCES: dict[str, str] = {}


def register(task: Task) -> Task:
    """Add (or replace) a task in this process (a test, a notebook). Other processes (workers, later
    commands) find a task by an entry point in the `headsearch.tasks` group or a `module:attr` reference."""
    if not isinstance(task, Task):
        raise ConfigError(f"register() takes a headsearch.tasks.Task, not {type(task).__name__}")
    _REGISTRY[task.name] = task
    return task


def get_task(name: str) -> Task:
    """The task called `name`: registered in this process, a built-in, an installed plugin (entry point
    group `headsearch.tasks`), or a `package.module:attr` reference to a `Task` (imported here)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    for task_name, reference in _REFERENCES.items():
        if reference == name and task_name in _REGISTRY:
            return _REGISTRY[task_name]
    if ":" in name:
        return _load_reference(name)
    references = task_references()
    if name in references:
        return _load_named(name, references[name])
    raise HeadsearchError(f"unknown task {name!r}: use one of {', '.join(sorted(set(references) | set(_REGISTRY)))}"
                          " (see `headsearch tasks`), or a plugin as --task package.module:attr (docs/plugins.md)")


def all_tasks() -> Iterable[Task]:
    """Every task this process can reach: the built-ins, the installed plugins and those registered here."""
    for name, ref in task_references().items():
        if name not in _REGISTRY:
            _load_named(name, ref)
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def task_reference(task: Task | str) -> str:
    """What names `task` in configs, studies and run directories: its name, or the `module:attr` reference
    it was loaded from when no entry point gives that name (so any process can load it again)."""
    name = task.name if isinstance(task, Task) else task
    return _REFERENCES.get(name, name)


def task_references() -> dict[str, str]:
    """Task name -> `module:attr`, for the built-ins and every installed entry point of the group."""
    from importlib.metadata import entry_points

    found = dict(BUILTIN)
    claimed: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        where = getattr(getattr(ep, "dist", None), "name", None) or ep.value
        if ep.name in found and found[ep.name] != ep.value:
            raise HeadsearchError(f"two installed packages name the task {ep.name!r} ({claimed.get(ep.name, 'headsearch')}:"
                                  f" {found[ep.name]}; {where}: {ep.value}): uninstall one of them")
        found[ep.name] = ep.value
        claimed[ep.name] = where
    return found


def _load_named(name: str, reference: str) -> Task:
    task = _import_task(reference, f"task {name!r}")
    if task.name != name:
        raise HeadsearchError(f"the entry point {name!r} ({reference}) gives a task named {task.name!r}: name the entry"
                              " point after the task")
    return register(task)


def _load_reference(reference: str) -> Task:
    task = _import_task(reference, f"--task {reference}")
    if task.name in BUILTIN:
        raise HeadsearchError(f"--task {reference}: its task is named {task.name!r}, a built-in task's name: rename it")
    _REFERENCES[task.name] = reference
    return register(task)


def _import_task(reference: str, what: str) -> Task:
    """Import `package.module:attr` and return the `Task` it names."""
    import importlib

    module_name, _, attr = reference.partition(":")
    if not module_name or not attr:
        raise HeadsearchError(f"{what}: write package.module:attr, e.g. my_tasks.speech:TASK")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise HeadsearchError(f"{what}: cannot import {module_name} ({e}): install the package or put it on PYTHONPATH") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise HeadsearchError(f"{what}: {module_name} has no {attr}")
        obj = getattr(obj, part)
    if not isinstance(obj, Task):
        raise HeadsearchError(f"{what}: {attr} is a {type(obj).__name__}, not a headsearch.tasks.Task")
    return obj


def apply_overrides(task: Task, cfg: RunConfig, overrides: Mapping[str, Any]) -> RunConfig:
    """Merge a mapping with optional `arch`, `train`, `data` sections and `seed` over `cfg`."""
    if not isinstance(overrides, Mapping):
        raise ConfigError("a config must be a mapping of sections (task, seed, arch, train, data) to values")
    unknown = set(overrides) - {"task", "arch", "train", "data", "seed"}
    if unknown:
        raise ConfigError(f"unknown config section(s) {', '.join(sorted(unknown))}: use task, seed, arch, train, data")
    if overrides.get("task", task.name) not in (task.name, task_reference(task)):
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
        task=task_reference(task),
        arch=ArchConfig.from_dict(overrides.get("arch") or {}, base=cfg.arch),
        train=TrainConfig.from_dict(overrides.get("train") or {}, base=cfg.train),
        data=task.data_options.from_dict(overrides.get("data") or {}, base=cfg.data),
        seed=overrides.get("seed", cfg.seed),
    )


def parse_sets(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`--set SECTION.KEY=VALUE` items (values read as YAML: 0, 1e-3, [flip], null; quoted: a string) as config
    overrides."""
    import yaml

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, eq, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not eq or not dot or section not in ("arch", "train", "data") or not name:
            raise ConfigError(f"--set {item}: write SECTION.KEY=VALUE with SECTION arch, train or data, e.g. data.val_size=0")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"--set {item}: {value!r} is not a value (numbers, true/false, null, [lists])") from None
        quoted = value.strip()[:1] in ("'", '"')  # a quoted value stays a string: --set "data.revision='1.10'"
        out.setdefault(section, {})[name] = parsed if quoted else _number(parsed)
    return out


def _number(v: Any) -> Any:
    """YAML 1.1 reads 1e-2 (no dot) as a string; a researcher means the number."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def flag_overrides(*, seed: int | None = None, sets: Mapping[str, Mapping[str, Any]] | None = None,
                   **train: Any) -> dict[str, Any]:
    """Command-line flags as an overrides mapping: `sets` (`parse_sets`: `--set SECTION.KEY=VALUE`), then
    over them `seed` and training fields (epochs, compile, diversity_samples, ...); flags left at None are
    not given."""
    out: dict[str, Any] = {section: dict(values) for section, values in (sets or {}).items()}
    given = {k: v for k, v in train.items() if v is not None}
    if given:
        out["train"] = {**out.get("train", {}), **given}
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
