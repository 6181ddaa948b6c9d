"""Tasks: what a task is (`base`), the registry and config resolution (`registry`), and the built-in
tasks (`vit_cifar10`, `translation`), each one module over its data module."""
from headsearch.tasks.base import (AnalysisBatch, BoundTask, DataSource, Metric, PatchAttention, Task, TokenAttention,
                                   limited, rebound, seeded_subset)
from headsearch.tasks.registry import all_tasks, apply_overrides, flag_overrides, get_task, register, resolve_config

__all__ = ["AnalysisBatch", "BoundTask", "DataSource", "Metric", "PatchAttention", "Task", "TokenAttention",
           "all_tasks", "apply_overrides", "flag_overrides", "get_task", "limited", "rebound", "register",
           "resolve_config", "seeded_subset"]
