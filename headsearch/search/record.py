"""The trial record: the user attributes a search writes on each trial, and what a trial's record says.

Optuna keeps a trial's state, parameters, values and intermediate values; everything else headsearch knows
of a trial is a user attribute named in `KEYS`. Every reader (report, compare, export, the notes, the audit)
asks the predicates here whether a trial counts, holds an architecture or was trained, so the answer is
the same everywhere.
"""
from __future__ import annotations

from pathlib import Path

from typing import Any

from headsearch.config import RunConfig, stable_key
from headsearch.search.objectives import CONVERGENCE

# Each user attribute a search writes on a trial, with what it means.
KEYS: dict[str, str] = {
    "worker": "host:pid of the worker that began it",
    "config": "the sampled run config (a dict): what it trains",
    "arch": "the head schedule, skip and fusion in one line",
    "run_dir": "its run directory, absolute",
    "rejected": "why its sampled config is invalid (told PRUNED, never trained; still counted)",
    "duplicate_of": "the trial holding the same architecture (told FAIL, neither trained nor counted)",
    "over_budget": "trials created before it that filled the budget (told FAIL, never trained)",
    "fail_reason": "why it failed (an 'interrupted ...' reason is retried; any other is for good)",
    "pruned": "the pruning decision: rule, epoch, point, threshold, the trials ahead",
    "paused": "stopped by its rule with its state kept (--pruner-pause): the epoch, its run's pause checkpoint; told"
              " PRUNED, and resumed by a later trial if the rule, asked again, lets it go on",
    "resumes": "the paused trial it goes on from (same architecture and run directory; it takes no place of the"
               " budget, its curve holds the paused trial's epochs too)",
    "resumed_at": "the epoch after which it goes on (its paused trial's)",
    "resumed_because": "why its paused trial was resumed: the rule asked again let it go on, or its projected end"
                       " could still reach the front",
    "cohort": "the cohort it trained in (size, slot, worker), or why it trained alone",
    "alone_key": "the architecture and step mode its fair epoch seconds were measured in",
    "epoch_seconds_alone": "one epoch's seconds with the device to itself (the fair clock)",
    "epochs_run": "epochs it trained",
    "params": "its parameter count",
    "val_metrics": "the validation metrics at its best epoch",
    "test_metrics": "the test metrics of its best checkpoint",
    "diversity": "the head-diversity metrics at its best epoch (when tracked)",
    "best_epoch": "the epoch of its best validation metric",
    "best_seconds_alone": "best epoch x epoch_seconds_alone: the fair time to its best epoch (objective time)",
    "best_train_seconds": "training seconds to its best epoch, as measured beside whatever shared the device",
    "train_seconds": "training seconds in all",
    "compile_seconds": "the warm-up (compilation, graph capture), timed apart",
    "seconds_to_target": "training seconds to the task's target metric, if reached",
    "samples_per_s": "training throughput",
    "step_mode": "how its steps ran (eager, compiled, CUDA graphs)",
    "step_note": "why its step mode fell back, if it did",
}

# TrainResult fields a complete trial keeps under the same names (with every convergence objective's).
RECORDED = ("epochs_run", "best_epoch", "best_train_seconds", "train_seconds", "compile_seconds", "seconds_to_target",
            "params", "samples_per_s", "epoch_seconds_alone", "step_mode", "step_note")
# The states of the trials that fill the budget (a rejected architecture is PRUNED: counted too).
COUNTED_STATES = ("COMPLETE", "PRUNED", "RUNNING", "WAITING")


def counts_toward_budget(t) -> bool:
    """Whether trial `t` fills a place of --trials: finished (complete, pruned, rejected), running, or waiting
    to run (enqueued, a retry). A failed trial never does: a retry takes its place. A resumption never does
    either: its paused trial holds the place."""
    return t.state.name in COUNTED_STATES and "resumes" not in t.user_attrs


def is_paused(t) -> bool:
    """Whether trial `t` was paused (PRUNED with its state kept, `paused`): resumable unless a trial resumes it."""
    return t.state.name == "PRUNED" and "paused" in t.user_attrs


def resumes(t) -> int | None:
    """The number of the paused trial that trial `t` goes on from, or None."""
    n = t.user_attrs.get("resumes")
    return None if n is None else int(n)


def resumed(trials) -> set[int]:
    """The numbers of the paused trials some trial resumes: waiting, running or ended, not interrupted (an
    interrupted resumption's retry carries `resumes` too; one stopped by Ctrl-C is not retried, and its paused
    trial can be resumed again). Their curves go on in those trials."""
    return {n for t in trials if (n := resumes(t)) is not None and (t.state.name != "FAIL" or failed_for_good(t))}


def resumed_by(trials) -> dict[int, int]:
    """Each paused trial's number -> the number of its latest resumption (any state)."""
    return {n: t.number for t in trials if (n := resumes(t)) is not None}


def kept_pauses(trials) -> list[Path]:
    """The pause checkpoints a study keeps on disk: those of its paused trials no trial resumes (yet), that exist
    here (a relative path is the run root's, as the worker that wrote it saw it from its working directory)."""
    gone_on = resumed(trials)
    paths = (Path(t.user_attrs["paused"].get("checkpoint") or "") for t in trials
             if is_paused(t) and t.number not in gone_on)
    return [path for path in paths if path.name and path.is_file()]


def failed_for_good(t) -> bool:
    """A FAIL that will not be retried (diverged, out of memory, an error): not an interruption, a duplicate
    proposal or an over-budget ask (those record no fail_reason)."""
    reason = t.user_attrs.get("fail_reason")
    return t.state.name == "FAIL" and reason is not None and not str(reason).startswith("interrupted")


def holds_architecture(t) -> bool:
    """Whether trial `t` holds its architecture: it ran or runs it (complete, pruned, running) or failed for
    good (diverged, out of memory). Not: a rejected config, a duplicate proposal, an interrupted run (retried)."""
    a = t.user_attrs
    if "config" not in a or "rejected" in a or "duplicate_of" in a:
        return False
    return t.state.name in ("COMPLETE", "PRUNED", "RUNNING") or failed_for_good(t)


def holds_point(t) -> bool:
    """Whether trial `t` holds its grid point (a comparison's config x seed): finished, running, waiting (a
    retry is enqueued for it) or failed for good."""
    return counts_toward_budget(t) or failed_for_good(t)


def was_trained(t) -> bool:
    """Whether trial `t` trained to its end or to its pruning (not a rejected config or a duplicate)."""
    a = t.user_attrs
    return t.state.name in ("COMPLETE", "PRUNED") and "rejected" not in a and a.get("duplicate_of") is None


def epochs_trained(t) -> int:
    """The epochs trial `t` trained: its record, else (older records) its intermediate values, one per epoch; a
    resumption's own, after its paused trial's (`resumed_at`)."""
    ran = t.user_attrs.get("epochs_run")
    ran = int(ran) if ran is not None else len(t.intermediate_values)
    return ran - int(t.user_attrs.get("resumed_at") or 0)


def config_key(config: Any) -> str:
    """A stored config dict as one string: two trials with equal keys train the same thing (seed included);
    `RunConfig.key()` of the config it was stored from."""
    return stable_key(config)


def arch_summary(cfg: RunConfig) -> str:
    a = cfg.arch
    heads = "-".join(map(str, a.enc_heads))
    return f"{heads} skip={a.skip} fusion={a.fusion}"


def record_result(trial, result) -> None:
    """What a complete trial keeps of its training (`Objective.trial_value` reads the objectives back)."""
    for name in dict.fromkeys([*RECORDED, *(c.attr for c in CONVERGENCE.values())]):
        trial.set_user_attr(name, getattr(result, name))
    trial.set_user_attr("val_metrics", result.best_metrics)
    if result.best_diversity:
        trial.set_user_attr("diversity", result.best_diversity)
    trial.set_user_attr("test_metrics", result.test_metrics)
