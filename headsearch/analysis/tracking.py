"""Head diversity tracked over training (the "X-raying multi-head attention" article tracks the
metrics epoch by epoch; docs/design.md §5): a trainer callback that search or the CLI adds."""
from __future__ import annotations

import math
from typing import Any

from headsearch.config import RunConfig
from headsearch.training.records import Callback

BATCH_SIZE = 64


class DiversityTracker(Callback):
    """After each validation, the model-level diversity scalars (mean over layers) on the same fixed
    `samples` validation items, written into the epoch's record (outside the training time)."""

    def __init__(self, samples: int):
        self.samples = samples
        self.batches: list | None = None

    def on_evaluate(self, model: Any, bound: Any, record: Any) -> None:
        from headsearch.analysis.diversity import diversity_summary, head_diversity

        if self.batches is None:
            self.batches = bound.analysis_batches("val", self.samples, BATCH_SIZE)
        summary = diversity_summary(head_diversity(model, self.batches))
        record.diversity = {k: (float(v) if math.isfinite(v) else None) for k, v in summary.items()}


def diversity_callbacks(cfg: RunConfig) -> list[Callback]:
    """The tracker when the config asks for it (`train.diversity_samples` > 0), else nothing."""
    return [DiversityTracker(cfg.train.diversity_samples)] if cfg.train.diversity_samples else []
