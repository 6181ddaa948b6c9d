"""Tasks: what a task is (`base`), the registry and config resolution (`registry`), and the built-in
tasks (`vit_cifar10`, `translation`), each one module over its data module, found the way plugins are
(entry point group `headsearch.tasks`; docs/plugins.md).

What a task of your own needs is importable from here: `Task`, `Metric`, `DataSource`, the attention
views, the config classes (`RunConfig`, `ArchConfig`, `TrainConfig`, `DataOptions`) and the helpers for
data options (`coerce_fields`, `whole_number`, `path_problem`) and bound tasks (`limited`, `rebound`,
`seeded_subset`)."""
from headsearch.config import ArchConfig, DataOptions, RunConfig, TrainConfig, coerce_fields, path_problem, whole_number
from headsearch.tasks.base import (AnalysisBatch, BoundTask, DataSource, Metric, PatchAttention, Task, TokenAttention,
                                   limited, rebound, seeded_subset)
from headsearch.tasks.registry import (ENTRY_POINT_GROUP, all_tasks, apply_overrides, flag_overrides, get_task, parse_sets,
                                       register, resolve_config, task_reference, task_references)

__all__ = ["ENTRY_POINT_GROUP", "AnalysisBatch", "ArchConfig", "BoundTask", "DataOptions", "DataSource", "Metric",
           "PatchAttention", "RunConfig", "Task", "TokenAttention", "TrainConfig", "all_tasks", "apply_overrides",
           "coerce_fields", "flag_overrides", "get_task", "limited", "parse_sets", "path_problem", "rebound", "register",
           "resolve_config", "seeded_subset", "task_reference", "task_references", "whole_number"]
