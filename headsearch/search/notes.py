"""Notes for optuna-dashboard: why each trial was pruned, and the study's pruning plan and savings.

optuna-dashboard shows a Markdown note on each trial's page and on the study's (`optuna_dashboard.save_note`,
kept in the study's system attrs). `write_dashboard_notes` writes one on each trial headsearch pruned (not
the rejected ones, stored PRUNED too), from its ``user_attrs["pruned"]`` record: the epoch and rung, the rule,
the trial's point there (its quality and time so far) and the trials ranked ahead of it; and one on the study:
the pruner with its rungs, and what pruning saved (`report.pruning_savings`).

The notes are the user's to edit in the dashboard: a note is written when it is empty or still the one
headsearch wrote last (a digest of each is kept in the study system attr `NOTES_KEY`), never over a note
someone changed; an unchanged note is not written again, so calling this on every `dashboard` and
`report --plots` costs a read.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from optuna.trial import TrialState

from headsearch.search.optuna_private import TrialNoteTarget, note_body, study_storage
from headsearch.search.pruning import rule_rungs, rung_epochs
from headsearch.search.record import resumed_by, resumes
from headsearch.search.report import pruned_text, pruning_savings
from headsearch.search.rungcheck import primary_direction

NOTES_KEY = "headsearch:notes"  # {"study" | "trial:<number>": digest of the note headsearch wrote there}


@dataclass
class NotesWritten:
    """What `write_dashboard_notes` did: notes written, notes already up to date, notes left alone because
    someone edited them (by target: "study", "trial 3")."""

    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """What was written, in a few words: "the study's note, 2 pruned trials' notes"."""
        trials = sum(1 for w in self.written if w != "study")
        parts = (["the study's note"] if "study" in self.written else []) + (
            [f"{trials} pruned trial{'s' if trials != 1 else ''}' notes"] if trials else [])
        if self.kept:
            parts.append(f"{len(self.kept)} edited note{'s' if len(self.kept) != 1 else ''} left as they are")
        return ", ".join(parts) or "nothing new"


# -- the texts ---------------------------------------------------------------------------------------

def _num(v: float) -> str:
    return f"{v:.4g}"


def _rungs(meta: Mapping[str, Any], rule: str | None) -> list[int] | None:
    """The study's rungs before its last epoch, when its rule is a rung rule and they are recorded."""
    options = meta.get("pruner_options") or {}
    m, r, epochs = options.get("min_epochs"), options.get("reduction_factor"), meta.get("epochs")
    if rule_rungs(rule) is None or not isinstance(m, int) or not isinstance(r, int) or not isinstance(epochs, int):
        return None
    return rung_epochs(m, r, epochs)


def _ordinal(n: int) -> str:
    return {1: "first", 2: "second", 3: "third", 4: "fourth"}.get(n, f"{n}th")


def rung_words(epoch: int, rungs: Sequence[int] | None) -> str:
    """"the first rung; rungs 3, 9" for an epoch at a rung; "" when the rungs are not known or it is not one."""
    if not rungs or epoch not in rungs:
        return ""
    return f"the {_ordinal(list(rungs).index(epoch) + 1)} rung; rung{'s' if len(rungs) > 1 else ''} {', '.join(map(str, rungs))}"


def point_words(trial, epoch: int, meta: Mapping[str, Any], direction: str | None) -> str:
    """The trial's point at `epoch` on the study's objectives, in their units: its primary metric's best so far,
    its training time so far (epochs x seconds alone), its parameter count; "" when none is known."""
    primary = meta.get("primary_metric")
    curve = [float(v) for e, v in trial.intermediate_values.items() if e <= epoch and not math.isnan(float(v))]
    seconds, params = trial.user_attrs.get("epoch_seconds_alone"), trial.user_attrs.get("params")
    names = [o.get("name") for o in meta.get("objectives") or []] or [primary]
    parts = []
    for name in names:
        if name == primary and curve:
            best = min(curve) if direction == "minimize" else max(curve)
            parts.append(f"{name} {_num(best)} so far")
        elif name == "time" and seconds is not None:
            parts.append(f"time {_num(epoch * float(seconds))} s so far ({epoch} epochs x {_num(float(seconds))} s alone)")
        elif name == "params" and params is not None:
            parts.append(f"{int(params):,} parameters")
    return ", ".join(parts)


def pruned_note(trial, meta: Mapping[str, Any], direction: str | None = None, resumed_by: int | None = None) -> str:
    """The Markdown note of a trial headsearch pruned, from its ``user_attrs["pruned"]`` (older records lack
    "ahead" and "margin": those sentences are left out); of a paused one (`paused`), with the trial that resumed
    it (`resumed_by`), if any."""
    p = trial.user_attrs.get("pruned") or {}
    paused = trial.user_attrs.get("paused")
    epoch, rule = p.get("epoch"), p.get("rule") or meta.get("pruner") or "?"
    if not isinstance(epoch, int):
        epoch = max(trial.intermediate_values, default=None)
    where = rung_words(epoch, _rungs(meta, rule)) if isinstance(epoch, int) else ""
    at = f"{'Paused' if paused else 'Pruned'} at epoch {epoch if epoch is not None else '?'}"
    head = f"**{at}** ({where}) **by the {rule} rule.**" if where else f"**{at} by the {rule} rule.**"
    lines = [head, ""]
    point = point_words(trial, epoch, meta, direction) if isinstance(epoch, int) else ""
    if point:
        lines.append(f"Its point there: {point}.")
    ahead = sorted(a for a in p.get("ahead") or [] if isinstance(a, int))
    if ahead:
        lines.append(f"Ranked behind trials {', '.join(f'#{a}' for a in ahead)} (those ahead of it at epoch {epoch}).")
    margin = p.get("margin")
    if isinstance(margin, (int, float)) and margin > 0:
        lines.append(f"Its {meta.get('primary_metric') or 'value'} was given a noise margin of {_num(margin)} first.")
    if resumes(trial) is not None:
        lines.append(f"Resumes trial #{resumes(trial)} after epoch {trial.user_attrs.get('resumed_at', '?')}"
                     f" (its curve's first epochs are that trial's){_because(trial)}.")
    if paused:
        lines.append("Its state was kept (`pause.pt` in its run directory): "
                     + (f"trial #{resumed_by} resumed it after epoch {epoch}." if resumed_by is not None else
                        "not resumed: neither the rule, asked again before each later trial, nor its curve projected"
                        " to the last epoch once the budget was spent gave it a chance at the front."))
    lines += ["", f"The rule's record: {pruned_text(p, direction)}."]
    return "\n".join(lines)


def resumed_note(trial) -> str:
    """The Markdown note of a resumption (`resumes`): whose run it goes on with, from which epoch."""
    a = trial.user_attrs
    return (f"**Resumes trial #{a['resumes']} after epoch {a.get('resumed_at', '?')}**, in its run directory, exactly"
            f" where its rule paused it: epochs 1-{a.get('resumed_at', '?')} of this curve are that trial's."
            + (f"\n\nResumed because {a['resumed_because']}." if a.get("resumed_because") else ""))


def _because(trial) -> str:
    """ ", resumed because the pareto rule, asked again ..., lets it go on" (older records say nothing)."""
    because = trial.user_attrs.get("resumed_because")
    return f", resumed because {because}" if because else ""


def plan_line(meta: Mapping[str, Any]) -> str:
    """The pruning plan in one line: the rule, its rungs, startup and noise margin, and the workers, as recorded."""
    rule = meta.get("pruner")
    if rule is None:
        return "The study does not record its pruner."
    if rule == "none":
        text = "No pruning"
    else:
        text = f"{rule} pruning"
        options = meta.get("pruner_options") or {}
        rungs = _rungs(meta, rule)
        if rungs:
            listed = f"rung{'s' if len(rungs) > 1 else ''} {', '.join(map(str, rungs))}"
            text += f" at {listed} of {meta['epochs']} epochs (the top 1/{options['reduction_factor']} go on at each)"
        elif rungs is not None:
            text += f": no rung before the last of {meta['epochs']} epochs"
        elif meta.get("epochs"):
            text += f" of {meta['epochs']}-epoch trials"
        if options.get("n_startup_trials") is not None:
            text += f", judging once {options['n_startup_trials']} trials reached an epoch"
        if options.get("noise_margin"):
            noise = options.get("noise")
            text += (f", quality given a noise margin of {_num(options['noise_margin'])} sigma"
                     + (f" (sigma {_num(noise)})" if noise is not None else " (sigma from the curves)"))
    workers = meta.get("workers")
    if isinstance(workers, int):
        text += f"; {workers} worker{'s' if workers != 1 else ''}"
    return text + "."


def study_note(study, meta: Mapping[str, Any]) -> str:
    """The study's Markdown note: the pruning plan and what pruning saved."""
    trials = study.get_trials(deepcopy=False)
    s = pruning_savings(trials, meta.get("epochs"))
    pruned = [t for t in trials if _pruned_by_headsearch(t)]
    complete = sum(1 for t in trials if t.state == TrialState.COMPLETE)
    lines = ["## Pruning (headsearch)", "", f"Plan: {plan_line(meta)}", "",
             f"Saved: {_count(s.trials, 'trained trial')} ran {s.epochs_run} epochs; without pruning {s.epochs_without_pruning}"
             f" -> {s.epochs_saved} epochs saved ({s.saved_fraction:.0%}). {_count(len(pruned), 'trial')} pruned,"
             f" {complete} complete.", ""]
    if pruned:
        lines.append("Each pruned trial's note says why it was pruned. `headsearch report --pruning-audit` replays these"
                     " curves under other rules and rungs.")
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _pruned_by_headsearch(t) -> bool:
    return t.state == TrialState.PRUNED and "rejected" not in t.user_attrs and isinstance(t.user_attrs.get("pruned"), dict)


# -- writing them ------------------------------------------------------------------------------------

def _digest(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def write_dashboard_notes(study) -> NotesWritten:
    """Write the notes (see the module docstring) into `study`'s storage. ImportError without optuna-dashboard."""
    from optuna_dashboard import save_note

    meta = study.user_attrs.get("headsearch") or {}
    direction = primary_direction(meta)
    storage, study_id = study_storage(study)
    attrs = storage.get_study_system_attrs(study_id)
    ours = dict(attrs.get(NOTES_KEY) or {})
    done = NotesWritten()

    def write(key: str, name: str, target, trial_id: int | None, body: str) -> None:
        current = note_body(attrs, trial_id)
        if current == body:
            done.unchanged.append(name)
        elif current and ours.get(key) != _digest(current):
            done.kept.append(name)  # someone wrote this note: theirs stays
        else:
            save_note(target, body)
            ours[key] = _digest(body)
            done.written.append(name)

    trials = study.get_trials(deepcopy=False)
    resumptions = resumed_by(trials)
    for t in trials:
        if _pruned_by_headsearch(t) or resumes(t) is not None:
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
            body = resumed_note(t) if resumes(t) is not None and not _pruned_by_headsearch(t) else \
                pruned_note(t, meta, direction, resumptions.get(t.number))
            write(f"trial:{t.number}", f"trial {t.number}", TrialNoteTarget(storage, study, trial_id), trial_id, body)
    if meta:
        write("study", "study", study, None, study_note(study, meta))
    if done.written:
        storage.set_study_system_attr(study_id, NOTES_KEY, ours)
    return done
