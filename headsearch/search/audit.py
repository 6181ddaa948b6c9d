"""A pruning audit of a finished (or running) study: its stored learning curves replayed under other rules.

A study keeps every trained trial's curve of the primary metric (Optuna intermediate values, epoch e at
step e, from 1), its epoch seconds alone and its parameter count: enough to ask, without training anything,
what another pruning rule, or the same rule with other rungs, would have done with these very trials. For
each rule `pruning_audit` replays asynchronous successive halving as ASHA runs it (Li et al. 2020, "A
System for Massively Parallel Hyperparameter Tuning", MLSys): the trained trials in the order they started
(trial number); each is judged after every epoch it ran by the rule's own `decide`, against the trials
before it that have a value at that epoch, running or finished alike (each rule's `compares` in `pruning.RULES`; the median
rules compare finished trials only), each seen with its stored curve cut where the replay stopped it; its
last epoch is never judged (pruning it would save nothing, as in the search); the first prune stops it.

What the replay cannot know: a trial the study pruned at epoch p has no curve past p. A rule that keeps it
past p lets it run on ("unknown"): it is counted with the epochs known (p), unless the rule cannot judge it
again before its last epoch, when it surely runs to the end (so "none" costs every trial's full epochs,
exactly); `epochs_at_most` counts every unknown trial to its end. Later trials see its curve up to p only.

The replay is one worker's: the study may have run several, whose trials saw fewer finished ones (and, for
the median rules, only COMPLETE ones). Replaying the study's own rule shows how far that matters:
`Audit.own_differs` lists the trials whose replayed fate is not the one the study gave them.

Per rule: the epochs it would have trained, the epochs saved against no pruning, the trials it prunes, and
the members of the study's reported front (`report.pareto_front`) it would have pruned ("front lost").

And its false-prune rate, where it can be known: of the trials it stops whose end the study holds (they ran to
their last epoch: trials the study did not stop, and with --pruner-pause the paused runs it resumed to the end),
the share on the reported front, with a Wilson interval. A trial the study pruned for good has no end to look at,
so a study that killed is not counted there; one that paused is measured by the runs it resumed.

A paused run and its resumptions are one run here: the last resumption's curve, in the place of its first trial.
No printing here: the CLI renders an `Audit` (`headsearch report --pruning-audit`), `Audit.to_dict()` is
JSON-able.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from optuna.trial import TrialState

from headsearch.errors import HeadsearchError
from headsearch.jsonsafe import json_safe
from headsearch.search import rungcheck
from headsearch.search.pruning import (RULES, Progress, PrunerOptions, judges_progress, make_curve_pruner, progress_of,
                                       rung_epochs)
from headsearch.search.objectives import progress_kinds
from headsearch.analysis.stats import wilson_interval
from headsearch.search.record import epochs_trained, resumed, resumes, was_trained
from headsearch.search.report import pareto_front

# The rungs (min_epochs, reduction_factor) the audit tries the Pareto rule with: the first rung after 1, 2,
# 3, 4 or 9 epochs, the top half or third going on. benchmarks/search_quality.py measured these on tables.
AUDIT_RUNGS = ((1, 3), (2, 2), (3, 3), (4, 2), (9, 3))


# -- what is replayed -------------------------------------------------------------------------------

@dataclass(frozen=True)
class RuleSpec:
    """A rule to replay: a pruner name (a row of `headsearch.search.pruning.RULES`) and, for the rung rules, its
    rungs (None: the study's stored option, else the rule's default)."""

    name: str
    min_epochs: int | None = None
    reduction_factor: int | None = None


@dataclass
class Stop:
    """A trial the replayed rule prunes, and the epoch it prunes it at."""

    number: int
    epoch: int


@dataclass
class RuleAudit:
    """One rule's replay of the study."""

    rule: str
    min_epochs: int | None  # the rungs, for the rung rules (pareto, asha); None for the others
    reduction_factor: int | None
    rungs: list[int] | None  # the epochs before the last it judges at; None: every epoch (after any warm-up)
    own: bool  # the study's own rule, with its own rungs
    epochs: int  # epochs it would have trained (unknown trials: up to what is known, see the module docstring)
    epochs_at_most: int  # the same with every unknown trial run to its last epoch
    epochs_saved: int  # against no pruning
    fewer_than_none: float | None  # no pruning's epochs / this rule's (1.0 for none); None when it trains none
    pruned: list[Stop]
    front_lost: list[int]  # the study's front members it would have pruned
    unknown: int  # trials it keeps past the epoch the study pruned them at: what they would have reached is not stored
    unknown_trials: list[int] = field(default_factory=list)
    # Of the trials it stops whose end is known (they ran to their last epoch in the study), how many, and how many of
    # those are on the front: the false-prune rate and its 95% Wilson interval (None: none such).
    stopped_known: int = 0
    false_prunes: int = 0
    false_prune_rate: float | None = None
    false_prune_interval: tuple[float, float] | None = None

    @property
    def rungs_text(self) -> str:
        """The judged epochs in words: "3, 9 (top 1/3)", "every epoch", "-"."""
        if self.rule == "none":
            return "-"
        if self.min_epochs == "auto":
            return f"auto, then x{self.reduction_factor} (top 1/{self.reduction_factor})"
        if self.rungs is None:
            return "every epoch"
        if not self.rungs:
            return "none before the last epoch"
        top = f" (top 1/{self.reduction_factor})" if self.reduction_factor else ""
        return ", ".join(map(str, self.rungs)) + top


@dataclass
class Audit:
    """The study's curves replayed under each rule (see the module docstring)."""

    study: str
    epochs: int | None  # epochs per trial (the study's setting)
    trials: int  # trained trials replayed: complete (not duplicates) and pruned (not rejected)
    front: list[int]  # the study's reported front
    own_rule: str | None  # the study's pruner
    options: dict[str, Any]  # the pruner options every replay was given (n_startup_trials, ...)
    options_stored: bool  # False: the study did not record them, the replays use `headsearch run`'s defaults
    rules: list[RuleAudit]
    own_differs: list[int] = field(default_factory=list)  # trials whose replay under the own rule differs from the study
    note: str = ""  # why the study's own rule is not replayed, when it is not

    def to_dict(self) -> dict[str, Any]:
        return json_safe(dataclasses.asdict(self))

    def rule(self, name: str, min_epochs: int | None = None, reduction_factor: int | None = None) -> RuleAudit:
        """The audit of rule `name` (with those rungs, for a rung rule): KeyError when not replayed."""
        for r in self.rules:
            if r.rule == name and (min_epochs is None or r.min_epochs == min_epochs) and (
                    reduction_factor is None or r.reduction_factor == reduction_factor):
                return r
        raise KeyError(f"rule {name} ({min_epochs}, {reduction_factor}) was not replayed")


@dataclass(frozen=True)
class _Trained:
    """A trained trial as the replay needs it."""

    number: int
    curve: dict[int, float]  # its stored intermediate values
    last: int  # its last epoch (the study's epochs, or its own config's)
    epochs_run: int  # epochs it trained in the study
    pruned_in_study: bool
    progress: Progress  # its whole stored progress (curve, params, epoch seconds)
    duplicates: tuple[int, ...] = ()  # older studies' COMPLETE duplicates of it (they share its fate)


@dataclass
class _Fate:
    stopped_at: int | None = None  # the epoch the replay prunes it at
    unknown: bool = False  # kept past the epoch the study pruned it at
    epochs: int = 0
    epochs_at_most: int = 0

    def seen_until(self, t: _Trained) -> int:
        """The last epoch of `t`'s curve that later trials see."""
        return self.stopped_at if self.stopped_at is not None else max(t.curve, default=0)


# -- the study's settings -------------------------------------------------------------------------------

def study_pruner_options(meta: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The pruner options a study recorded (``pruner_options`` in its ``headsearch`` user attrs, as
    `Search.pruner_options` writes them: the rule's settings with its defaults filled in), and whether it
    recorded any (studies before issue 39 did not). Only the options a rule takes (`PrunerOptions`) are kept, so a
    setting it learns later comes along by itself. Where the startup count is not recorded, `headsearch run`'s
    default (a quarter of the trial budget, 2 to 5: `Search.make_pruner`)."""
    accepted = {f.name for f in dataclasses.fields(PrunerOptions)}
    stored = dict(meta.get("pruner_options") or {})
    options = {k: v for k, v in stored.items() if k in accepted and v is not None}
    recorded = bool(options)
    if options.get("n_startup_trials") is None and isinstance(meta.get("trials"), int):
        options["n_startup_trials"] = max(2, min(5, meta["trials"] // 4))
    return options, recorded


def primary_direction(study, meta: Mapping[str, Any]) -> str:
    """The direction of the study's primary metric: its objective's, else its task's."""
    direction = rungcheck.primary_direction(meta)
    if direction is None:
        primary = meta.get("primary_metric")
        raise HeadsearchError(f"study {study.study_name}: the direction of its primary metric {primary!r} is not"
                              " recorded: it was not written by `headsearch run`")
    return direction


def rungs_of(pruner, last: int) -> tuple[int | None, int | None, list[int] | None]:
    """(min_epochs, reduction_factor, the epochs before `last` it judges at; None: every epoch) of a built
    pruner; no pruner judges none. A rule with a warm-up judges no epoch within it."""
    if pruner is None:
        return None, None, []
    warmup = getattr(pruner, "n_warmup_epochs", 0) or 0
    if getattr(pruner, "base", "asha") == "median" or not hasattr(pruner, "min_epochs"):
        # every epoch: the percentile rules (an interval aside) and multi-metric's median base
        return None, None, None
    m, r = pruner.min_epochs, pruner.reduction_factor
    if m == "auto":  # its first rung moves with the finished trials: every epoch is asked, the rule answers
        return m, r, None
    return m, r, [e for e in rung_epochs(m, r, last) if e > warmup]


# -- the trials -----------------------------------------------------------------------------------

def trained_trials(study, default_epochs: int | None) -> list[_Trained]:
    """The trials that trained (COMPLETE, not duplicates; PRUNED, not rejected), by trial number; an older
    study's COMPLETE duplicate (user_attr ``duplicate_of``) rides along with its twin."""
    twins: dict[int, list[int]] = {}
    kept = []
    all_trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    gone_on = resumed(all_trials)  # paused trials whose run goes on in a later trial: that one stands for the run
    for t in all_trials:
        a = t.user_attrs
        if t.state == TrialState.COMPLETE and a.get("duplicate_of") is not None:
            twins.setdefault(int(a["duplicate_of"]), []).append(t.number)
        elif was_trained(t) and t.intermediate_values and t.number not in gone_on:
            kept.append(t)
    first = _first_trials(all_trials)
    out = []
    for t in sorted(kept, key=lambda t: first.get(t.number, t.number)):  # a run in the place it started
        curve = {int(e): float(v) for e, v in t.intermediate_values.items()}
        last = _last_epoch(t, default_epochs, curve)
        out.append(_Trained(number=t.number, curve=curve, last=last,
                            epochs_run=epochs_trained(t) + int(t.user_attrs.get("resumed_at") or 0),
                            pruned_in_study=t.state == TrialState.PRUNED, progress=progress_of(t),
                            duplicates=tuple(twins.get(t.number, ()))))
    return out


def _first_trials(trials) -> dict[int, int]:
    """Each resumption's first trial: the one its run began in (a chain of pauses followed back)."""
    resuming = {t.number: n for t in trials if (n := resumes(t)) is not None}
    first = {}
    for number in resuming:
        root = number
        while root in resuming:
            root = resuming[root]
        first[number] = root
    return first


def _last_epoch(t, default_epochs: int | None, curve: Mapping[int, float]) -> int:
    """A trial's last epoch: its config's epochs, else the study's; a complete trial's curve at the least."""
    epochs = ((t.user_attrs.get("config") or {}).get("train") or {}).get("epochs", default_epochs)
    return int(epochs) if epochs is not None else max(curve)


# -- one replay -----------------------------------------------------------------------------------

def replay_rule(pruner, trials: Sequence[_Trained], compares_pruned: bool = True) -> dict[int, _Fate]:
    """Each trial's fate under `pruner` (a built curve pruner; None: no pruning), ASHA's way (see the module
    docstring). `compares_pruned`: whether the trials it prunes are compared with later (the rung rules:
    yes; the median rules, which read COMPLETE trials only: no)."""
    last_judged = rungs_of(pruner, max((t.last for t in trials), default=1))[2]
    fates: dict[int, _Fate] = {}
    earlier: list[tuple[_Trained, _Fate]] = []
    for t in trials:
        fate = _Fate()
        if pruner is not None:
            fate.stopped_at = _first_prune(pruner, t, earlier, compares_pruned)
        _count_epochs(t, fate, pruner, last_judged)
        fates[t.number] = fate
        earlier.append((t, fate))
    return fates


def _first_prune(pruner, t: _Trained, earlier, compares_pruned: bool) -> int | None:
    """The first epoch `pruner` prunes `t` at, judged at each epoch it ran but its last; None: kept."""
    progress_rule = judges_progress(pruner)

    def judged(s: _Trained, curve: dict[int, float]):
        """What the rule is handed of trial `s` with `curve`: its progress (`judges_progress`), else the curve alone."""
        return dataclasses.replace(s.progress, curve=curve) if progress_rule else curve

    # Each earlier trial as the replay left it: its curve up to where it stopped (or where the study's record ends).
    visible = [(f.seen_until(s), judged(s, _cut(s.curve, f.seen_until(s)))) for s, f in earlier
               if compares_pruned or f.stopped_at is None]
    mine: dict[int, float] = {}
    for epoch in sorted(t.curve):
        mine[epoch] = t.curve[epoch]
        if epoch >= t.last:
            break
        decision = pruner.decide(epoch, judged(t, dict(mine)), [seen for until, seen in visible if until >= epoch])
        if decision.prune:
            return epoch
    return None


def _cut(curve: Mapping[int, float], until: int) -> dict[int, float]:
    return {e: v for e, v in curve.items() if e <= until}


def _count_epochs(t: _Trained, fate: _Fate, pruner, judged: list[int] | None) -> None:
    if fate.stopped_at is not None:
        fate.epochs = fate.epochs_at_most = fate.stopped_at
        return
    if not t.pruned_in_study:
        fate.epochs = fate.epochs_at_most = t.epochs_run
        return
    # Kept past the epoch the study pruned it at: its later curve was never trained.
    fate.unknown = True
    known = max(t.curve)
    could_stop_later = pruner is not None and (
        judged is None and known + 1 < t.last or judged is not None and any(known < e < t.last for e in judged))
    fate.epochs = known if could_stop_later else t.last
    fate.epochs_at_most = t.last


# -- the audit -------------------------------------------------------------------------------------

def default_rules(own: RuleSpec | None, epochs: int | None, multi_objective: bool) -> list[RuleSpec]:
    """No pruning, the study's own rule, the Pareto rule (asha with one objective) at each of `AUDIT_RUNGS`
    whose first rung comes before the last epoch, then asha at its default rungs and multi-metric (several
    objectives) or median (one)."""
    family = "pareto" if multi_objective else "asha"
    rules = [RuleSpec("none")] + ([own] if own is not None else [])
    rules += [RuleSpec(family, m, r) for m, r in AUDIT_RUNGS if epochs is None or m < epochs]
    rules += [RuleSpec("asha"), RuleSpec("multi-metric")] if multi_objective else [RuleSpec("median")]
    return rules


def pruning_audit(study, rules: Sequence[RuleSpec | str] | None = None) -> Audit:
    """Replay `study`'s stored curves under `rules` (RuleSpecs or pruner names; default: `default_rules`)
    and no pruning (the baseline the savings are measured against); see the module docstring. Rules judge
    with the study's recorded pruner options (`study_pruner_options`), rungs aside. A rule that is the
    study's own (its pruner with its rungs) is marked `own`."""
    meta = study.user_attrs.get("headsearch") or {}
    epochs = meta.get("epochs")
    options, recorded = study_pruner_options(meta)
    direction = primary_direction(study, meta)
    kinds = progress_kinds(meta.get("objectives") or [], meta.get("primary_metric"))
    multi = len(study.directions) > 1
    build = _builder(direction, kinds, options)
    own_name = meta.get("pruner")
    own, note = _own_spec(own_name, options, build)
    specs = default_rules(own, epochs, multi) if rules is None else [RuleSpec(r) if isinstance(r, str) else r for r in rules]
    if not any(s.name == "none" for s in specs):
        specs = [RuleSpec("none"), *specs]
    trials = trained_trials(study, epochs)
    last = max((t.last for t in trials), default=epochs or 1)
    front = [t.number for t in pareto_front(study)]

    audits: list[RuleAudit] = []
    own_differs: list[int] = []
    seen: set[tuple] = set()
    for spec in specs:
        pruner = build(spec)
        key = _key(spec.name, pruner)
        if key in seen:  # the own rule again among the defaults, say
            continue
        seen.add(key)
        fates = replay_rule(pruner, trials, _compares_pruned(spec.name))
        is_own = own is not None and key == _key(own.name, build(own))
        audits.append(_rule_audit(spec.name, pruner, fates, trials, front, last, is_own))
        if is_own:
            own_differs = _differs(fates, trials)
    baseline = next(a for a in audits if a.rule == "none")
    for a in audits:
        a.epochs_saved = baseline.epochs - a.epochs
        a.fewer_than_none = baseline.epochs / a.epochs if a.epochs else None
    return Audit(study=study.study_name, epochs=epochs, trials=len(trials), front=front, own_rule=own_name,
                 options=options, options_stored=recorded, rules=audits, own_differs=own_differs, note=note)


def _builder(direction: str, kinds: list[str | None], options: Mapping[str, Any]):
    """`RuleSpec` -> its curve pruner, with the study's options (startup, warm-up, noise margin, ...) but its
    own rungs: the study's rungs belong to the study's rule (`_own_spec`), the other rules keep their defaults."""
    shared = {k: v for k, v in options.items() if k not in ("min_epochs", "reduction_factor")}

    def build(spec: RuleSpec):
        opts = dict(shared, min_epochs=spec.min_epochs, reduction_factor=spec.reduction_factor)
        opts.setdefault("kinds", kinds)
        return make_curve_pruner(spec.name, direction, **opts)
    return build


def _own_spec(name: str | None, options: Mapping[str, Any], build) -> tuple[RuleSpec | None, str]:
    """The study's own rule as a RuleSpec with its stored rungs, or why it is not replayed."""
    if name is None:
        return None, "the study does not record its pruner"
    spec = RuleSpec(name, options.get("min_epochs"), options.get("reduction_factor"))
    try:
        build(spec)
    except HeadsearchError as e:  # hyperband: Optuna's own brackets, not a curve rule
        return None, f"the study's {name} pruner is not replayed: {e}"
    return spec, ""


def _key(name: str, pruner) -> tuple:
    m, r, _ = rungs_of(pruner, 1)
    return name, m, r


def _compares_pruned(name: str) -> bool:
    rule = RULES.get(name)
    return rule is None or not rule.compares or TrialState.PRUNED in rule.compares


def _rule_audit(name: str, pruner, fates: Mapping[int, _Fate], trials: Sequence[_Trained], front: Sequence[int],
                last: int, own: bool) -> RuleAudit:
    m, r, rungs = rungs_of(pruner, last)
    stops = [Stop(t.number, fates[t.number].stopped_at) for t in trials if fates[t.number].stopped_at is not None]
    lost_numbers = {n for t in trials if fates[t.number].stopped_at is not None for n in (t.number, *t.duplicates)}
    unknown = [t.number for t in trials if fates[t.number].unknown]
    known = [t for t in trials if fates[t.number].stopped_at is not None and not t.pruned_in_study]
    on_front = sum(1 for t in known if {t.number, *t.duplicates} & set(front))
    return RuleAudit(rule=name, min_epochs=m, reduction_factor=r, rungs=rungs, own=own,
                     epochs=sum(f.epochs for f in fates.values()), epochs_at_most=sum(f.epochs_at_most for f in fates.values()),
                     epochs_saved=0, fewer_than_none=None, pruned=stops,
                     front_lost=[n for n in front if n in lost_numbers], unknown=len(unknown), unknown_trials=unknown,
                     stopped_known=len(known), false_prunes=on_front,
                     false_prune_rate=on_front / len(known) if known else None,
                     false_prune_interval=wilson_interval(on_front, len(known)) if known else None)


def _differs(fates: Mapping[int, _Fate], trials: Sequence[_Trained]) -> list[int]:
    """The trials whose replayed fate is not the study's: pruned at another epoch, or pruned in one and not the other."""
    return [t.number for t in trials if fates[t.number].stopped_at != (max(t.curve) if t.pruned_in_study else None)]
