"""What a study holds right now: counts by state and the best value of each objective."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from optuna.study import StudyDirection
from optuna.trial import TrialState


@dataclass
class Snapshot:
    counts: dict[str, int]
    best: dict[str, float] = field(default_factory=dict)  # each objective's best among complete trials
    running: list[dict[str, Any]] = field(default_factory=list)  # number, arch, last epoch
    resumptions: int = 0  # of the complete and pruned trials, those that resume a paused one (--pruner-pause)

    @property
    def finished(self) -> int:
        """The places of --trials filled by finished trials: a resumption takes none (its paused trial holds it)."""
        return self.counts["complete"] + self.counts["pruned"] + self.counts["rejected"] - self.resumptions

    def resumption_words(self) -> str:
        """"; 3 of them resumptions" when some finished trials resume paused ones, else ""."""
        return f"; {self.resumptions} of them resumptions" if self.resumptions else ""


TRIAL_STATES = ("complete", "pruned", "rejected", "failed", "running", "waiting", "duplicate", "over_budget")


def trial_state(t) -> str:
    """A trial's state as headsearch names it (one of TRIAL_STATES): a rejected architecture is stored
    PRUNED with user_attr "rejected"; a proposal of an architecture another trial holds, FAIL with
    user_attr "duplicate_of" (never trained, not counted toward --trials); a trial asked when the budget was
    full already (the budget's fence, headsearch.search.runner), FAIL with user_attr "over_budget" (the same)."""
    if t.state == TrialState.PRUNED:
        return "rejected" if "rejected" in t.user_attrs else "pruned"
    if t.state == TrialState.FAIL and t.user_attrs.get("duplicate_of") is not None:
        return "duplicate"
    if t.state == TrialState.FAIL and t.user_attrs.get("over_budget") is not None:
        return "over_budget"
    return {TrialState.COMPLETE: "complete", TrialState.FAIL: "failed", TrialState.RUNNING: "running",
            TrialState.WAITING: "waiting"}[t.state]


def count_states(trials) -> dict[str, int]:
    counts = dict.fromkeys(TRIAL_STATES, 0)
    for t in trials:
        counts[trial_state(t)] += 1
    return counts


def snapshot(study, trials=None) -> Snapshot:
    """The study's snapshot; of `trials` (the study's, read already) when given."""
    if trials is None:
        trials = study.get_trials(deepcopy=False)
    snap = Snapshot(count_states(trials), running=[
        {"number": t.number, "arch": t.user_attrs.get("arch", ""), "epoch": max(t.intermediate_values, default=0)}
        for t in trials if t.state == TrialState.RUNNING],
        resumptions=sum(1 for t in trials if "resumes" in t.user_attrs and t.state in (TrialState.COMPLETE, TrialState.PRUNED)))
    names = study.metric_names or [f"objective {i}" for i in range(len(study.directions))]
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.values is not None]
    for i, (name, direction) in enumerate(zip(names, study.directions)):
        if complete:
            pick = max if direction == StudyDirection.MAXIMIZE else min
            snap.best[name] = pick(t.values[i] for t in complete)
    return snap
