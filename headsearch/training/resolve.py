"""Resolve a run's configuration from the task's seed defaults, a preset, a YAML file and CLI overrides."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from headsearch.config import RunConfig, is_run_config, load_yaml
from headsearch.tasks import apply_overrides, get_task


def resolve_config(
    task_name: str,
    config_path: Path | None = None,
    preset: str | None = None,
    *,
    epochs: int | None = None,
    seed: int | None = None,
    compile_mode: str | None = None,
) -> RunConfig:
    """Seed defaults < preset < config file < command-line flags (epochs, seed, compile mode).

    The file may be a full run config (task/seed/arch/train/data, as written into run directories and
    by `export`) or hold architecture fields only.
    """
    task = get_task(task_name)
    cfg = task.config(preset)
    if config_path is not None:
        d = load_yaml(config_path)
        cfg = apply_overrides(task, cfg, d if is_run_config(d) else {"arch": d})
    flags: dict[str, Any] = {}
    train = {k: v for k, v in (("epochs", epochs), ("compile", compile_mode)) if v is not None}
    if train:
        flags["train"] = train
    if seed is not None:
        flags["seed"] = seed
    return apply_overrides(task, cfg, flags) if flags else cfg
