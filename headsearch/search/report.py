"""`headsearch report`: what a finished (or running) search found, as data.

`summarize` reads a study written by `headsearch run` and returns a `StudyReport`: the objectives,
trial counts by state, the Pareto front (or the single best trial), parameter importances for each
objective, what pruning saved, the front's hypervolume as the trials came in (the anytime curve), and
one row per trial. Objectives (names, directions, units) are those
of `headsearch.search.objectives`. No Rich here: the CLI renders it, and
`StudyReport.to_dict()` is JSON-able as is.

Opening a study never creates anything: a sqlite or journal URL must name an existing file
(`open_existing_storage`), and a sqlite file must already hold Optuna's tables.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import sqlite3
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import optuna
from optuna.importance import PedAnovaImportanceEvaluator
from optuna.trial import TrialState

from headsearch.config import stable_key
from headsearch.errors import HeadsearchError
from headsearch.io import hide_passwords
from headsearch.jsonsafe import json_safe
from headsearch.search.costs import study_cost_summary
from headsearch.search.hypervolume import dominates, front_indices, hypervolume, minimised, scale_minimised
from headsearch.search.objectives import Objective, directions_of, objectives_of
from headsearch.search.ranks import metric_direction, spearman
from headsearch.search.record import epochs_trained, is_paused, resumed_by, resumes, was_trained
from headsearch.search.rungcheck import RungCorrelation, check_rungs
from headsearch.search.snapshot import count_states, trial_state
from headsearch.search.storage import check_sqlite_file, journal_path, open_storage, sqlite_path
from headsearch.search.study import StudyStorage


# -- opening a study without creating anything ----------------------------------------------

def open_existing_storage(url: str):
    """An Optuna storage for a URL that already holds studies; never creates a database or file."""
    where = "pass the --storage that `headsearch run` wrote to"
    if (db := sqlite_path(url)) is not None:
        if not db.parent.is_dir():
            raise HeadsearchError(f"storage {url}: the folder {db.parent} does not exist: {where}")
        if not db.exists():
            raise HeadsearchError(f"storage {url}: no database file {db}: {where}")
        check_sqlite_file(url, db)
        try:
            with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
                tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.Error as e:
            raise HeadsearchError(f"storage {url}: {db} is not a SQLite database ({e}): {where}") from None
        if "studies" not in tables:
            raise HeadsearchError(f"storage {url}: {db} holds no Optuna studies: {where}")
    elif url.startswith("sqlite:"):
        raise HeadsearchError(f"storage {url!r} is not a sqlite URL with a file: write sqlite:///FILE.db")
    elif (path := journal_path(url)) is not None and not path.exists():
        raise HeadsearchError(f"storage {url}: no journal file {path}: {where}")
    return open_storage(url, heartbeat=None)  # checks an existing journal file's records (check_journal_file)


def study_names(storage) -> list[str]:
    return [s.study_name for s in storage.get_all_studies()]


def load_study(storage_url: str, study_name: str | None):
    """Load `study_name` (or the only study) from an existing storage, with one-line errors."""
    return load_study_stored(storage_url, study_name)[0]


def load_study_stored(storage_url: str, study_name: str | None):
    """`load_study`, and the study's `StudyStorage` (the storage object it was loaded from)."""
    storage = open_existing_storage(storage_url)
    try:
        names = study_names(storage)
    except Exception as e:  # a broken database: SQLAlchemy errors come in many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HeadsearchError(f"cannot read storage {storage_url}: {first}") from None
    if not names:
        raise HeadsearchError(f"storage {storage_url} holds no studies: run `headsearch run` first")
    if study_name is None:
        if len(names) > 1:
            raise HeadsearchError(f"storage {storage_url} holds several studies: pass --study, one of {', '.join(names)}")
        study_name = names[0]
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        raise HeadsearchError(f"unknown study {study_name} in {storage_url}: studies there are {', '.join(names)}") from None
    return study, StudyStorage(storage, study_name)


# -- the report -------------------------------------------------------------------------------

@dataclass
class FrontRow:
    """A Pareto-optimal (or, single-objective, the best) trial."""

    number: int
    schedule: list[int] | None  # enc_heads, one count per layer
    skip: str | None
    fusion: str | None
    arch: str
    values: dict[str, float]  # objective name -> value
    val_metrics: dict[str, float]
    test_metrics: dict[str, float]
    best_epoch: int | None
    run_dir: str | None
    duplicates: list[int] = field(default_factory=list)  # trials that reused this trial's results


@dataclass
class TrialRow:
    number: int
    state: str  # one of TRIAL_STATES
    arch: str
    values: dict[str, float | None]
    epochs_run: int | None
    note: str  # why pruned / rejected / failed; "duplicate of N"
    duplicate_of: int | None = None


@dataclass
class Importance:
    """Parameter importances for one objective, or the reason they could not be computed."""

    objective: str
    importances: dict[str, float] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Savings:
    """Epochs trained with pruning vs. what the same trials would have cost without it."""

    trials: int  # trained trials: complete + pruned, not rejected, not duplicates
    epochs_run: int
    epochs_without_pruning: int
    epochs_saved: int
    saved_fraction: float


@dataclass
class AnytimePoint:
    """The search after its first `trials` trained trials, in the order they ended: the fair seconds they
    trained (epochs run x each one's epoch seconds alone, summed over workers; None when a trial has no fair
    time) and the hypervolume of the front of those complete by then, over the whole study's front's."""

    trials: int
    fair_seconds: float | None
    hypervolume: float


@dataclass
class StudyReport:
    study: str
    storage: str  # its password hidden (`io.hide_passwords`): the report is printed and written
    task: str | None
    primary_metric: str | None
    epochs: int | None  # epochs per trial
    objectives: list[Objective]
    counts: dict[str, int]
    front: list[FrontRow]
    importances: list[Importance]
    savings: Savings
    trials: list[TrialRow]
    settings: dict[str, Any] = field(default_factory=dict)  # sampler, pruner, seed, trials budget, data
    # Spearman rank correlation across complete trials: {diversity metric: {objective: rho}}, when tracked
    diversity_vs_quality: dict[str, dict[str, float | None]] = field(default_factory=dict)
    # The front's hypervolume after each trained trial (the simulator's score, on the study's own points):
    # a curve still rising at its end says more trials would still move the front.
    anytime: list[AnytimePoint] = field(default_factory=list)
    # Spearman's rho between each epoch's values and the final values of the trials that ran to the end, the
    # pruner's rungs marked (`headsearch.search.rungcheck`): do early ranks predict final ones, as pruning at
    # the rungs assumes? `rung_warning`: one line when the first rung ranks them poorly.
    rung_check: list[RungCorrelation] = field(default_factory=list)
    rung_warning: str | None = None
    # The cost-aware sampler's costs measured before training (`headsearch.search.costs`): architectures, seconds.
    costs: dict[str, Any] | None = None

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    def to_dict(self) -> dict[str, Any]:
        return json_safe(dataclasses.asdict(self))

    def csv_rows(self) -> tuple[list[str], list[list[Any]]]:
        """The all-trials table: a header and one row per trial."""
        header = ["number", "state", "arch", *[o.name for o in self.objectives], "epochs_run", "duplicate_of", "note"]
        rows = [[r.number, r.state, r.arch, *[r.values.get(o.name) for o in self.objectives],
                 r.epochs_run, r.duplicate_of, r.note] for r in self.trials]
        return header, rows


def pruned_text(p: dict[str, Any], direction: str | None = None) -> str:
    """One line for a `user_attrs["pruned"]` record."""
    text = f"{p.get('rule', '?')} rule at epoch {p.get('epoch', '?')}"
    value, threshold = p.get("value"), p.get("threshold")
    if value is not None:
        text += f": {value:.4g}"
        if threshold is not None:
            worse = {"maximize": "<", "minimize": ">"}.get(direction or "", "vs")
            text += f" {worse} {threshold:.4g}"
    if p.get("n_compared"):
        text += f" ({p['n_compared']} trials compared)"
    if p.get("note"):
        text += f"; {p['note']}"
    return text


def trial_note(t, state: str, primary_direction: str | None) -> str:
    """Why a finished trial ended as it did (`state`: snapshot.trial_state's name); "" for a complete one."""
    a = t.user_attrs
    if state == "pruned" and isinstance(a.get("pruned"), dict):
        return pruned_text(a["pruned"], primary_direction)
    if state == "rejected":
        return str(a["rejected"])
    if state == "failed":
        return str(a.get("fail_reason", "failed (no reason recorded)"))
    if state == "duplicate":
        return f"proposed trial {a['duplicate_of']}'s architecture again: not trained, not counted"
    if state == "over_budget":
        return f"asked when {a['over_budget']} earlier trials filled the budget already: not trained, not counted"
    if a.get("duplicate_of") is not None:  # studies before headsearch 0.x reused a twin's results
        return f"duplicate of trial {a['duplicate_of']} (results reused)"
    return ""


def pause_words(t, resumed_by: int | None) -> str:
    """What the report's note says first of a paused trial (--pruner-pause) or a resumption, e.g. "resumes trial 9
    after epoch 3; paused, state kept, not resumed" ("" for any other trial): the state column says pruned for
    both, as Optuna's record does (docs/searching.md), and the counts count them so."""
    parts = []
    if (n := resumes(t)) is not None:
        parts.append(f"resumes trial {n} after epoch {t.user_attrs.get('resumed_at', '?')}")
    if is_paused(t):
        parts.append("paused, state kept, " + (f"resumed by trial {resumed_by}" if resumed_by is not None else "not resumed"))
    return "; ".join(parts)


def pareto_front(study) -> list:
    """Study.best_trials (several objectives) or [best_trial] (one); checked to be non-dominated."""
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values is not None]
    if not complete:
        return []
    front = list(study.best_trials) if len(study.directions) > 1 else [study.best_trial]
    directions = directions_of(study)
    for f in front:
        for t in complete:
            if dominates(minimised(t.values, directions), minimised(f.values, directions)):
                raise RuntimeError(f"bug: Pareto trial {f.number} {f.values} is dominated by trial {t.number} {t.values}")
    return sorted(front, key=lambda t: t.number)


def _front_rows(front, objectives: list[Objective]) -> list[FrontRow]:
    """Rows of the front; a duplicate (results reused from an identical trial on the front) is folded into it."""
    rows: dict[int, FrontRow] = {}
    numbers = {t.number for t in front}
    for t in front:
        a = t.user_attrs
        twin = a.get("duplicate_of")
        if twin is not None and twin in numbers:
            continue
        arch = (a.get("config") or {}).get("arch") or {}
        rows[t.number] = FrontRow(
            number=t.number, schedule=list(arch["enc_heads"]) if "enc_heads" in arch else None,
            skip=arch.get("skip"), fusion=arch.get("fusion"), arch=a.get("arch", ""),
            values={o.name: v for o, v in zip(objectives, t.values)},
            val_metrics=dict(a.get("val_metrics") or {}), test_metrics=dict(a.get("test_metrics") or {}),
            best_epoch=a.get("best_epoch"), run_dir=a.get("run_dir"),
        )
    for t in front:
        twin = t.user_attrs.get("duplicate_of")
        if twin is not None and twin in rows:
            rows[twin].duplicates.append(t.number)
    return list(rows.values())


def param_importances(study, objectives: list[Objective]) -> list[Importance]:
    """Importances per objective, or the reason they cannot be computed.

    PED-ANOVA (`importance_evaluator`, Optuna 5's default; no scikit-learn needed) ranks parameters by how much
    they matter for reaching the best values of `target`, which it takes as lower-is-better: a
    maximised objective is negated here.
    """
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values is not None]
    out = []
    for i, obj in enumerate(objectives):
        imp = Importance(obj.name)
        sign = -1.0 if obj.direction == "maximize" else 1.0
        if len(complete) < 2:
            imp.error = f"needs at least 2 complete trials ({len(complete)} so far)"
        elif len({stable_key(t.params) for t in complete}) < 2:
            imp.error = "every complete trial has the same parameters"
        elif len({t.values[i] for t in complete}) < 2:
            imp.error = f"{obj.name} is the same ({complete[0].values[i]:.4g}) in every complete trial"
        else:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # PED-ANOVA warns about the target's direction and few trials
                    raw = optuna.importance.get_param_importances(
                        study, evaluator=importance_evaluator(), target=lambda t, i=i, sign=sign: sign * t.values[i])
                imp.importances = {k: float(v) for k, v in raw.items()}
                if not imp.importances:
                    imp.error = "no parameter is shared by all complete trials"
                elif not all(math.isfinite(v) for v in imp.importances.values()):
                    imp.error = f"importances of {obj.name} are not finite"
                    imp.importances = {}
            except Exception as e:  # Optuna raises ValueError/RuntimeError/ImportError for what it cannot do
                imp.error = f"{type(e).__name__}: {e}"
        out.append(imp)
    return out


def importance_evaluator():
    """PED-ANOVA (Watanabe et al. 2023), named rather than left to Optuna's default: that is PED-ANOVA from
    Optuna 5 but fANOVA, which needs scikit-learn, before it (Optuna 3.6 to 4.x have PED-ANOVA too)."""
    return PedAnovaImportanceEvaluator()


def pruning_savings(trials, default_epochs: int | None) -> Savings:
    """Epochs trained by complete and pruned trials (not rejected, not duplicates) vs. all of them run to the end.
    A resumption's epochs are its paused trial's run's: they add to the epochs run, not to the trials."""
    run = without = n = 0
    for t in trials:
        if not was_trained(t):
            continue
        epochs = ((t.user_attrs.get("config") or {}).get("train") or {}).get("epochs", default_epochs)
        if epochs is None:
            continue
        run += epochs_trained(t)
        if resumes(t) is None:
            n += 1
            without += int(epochs)
    saved = without - run
    return Savings(trials=n, epochs_run=run, epochs_without_pruning=without, epochs_saved=saved,
                   saved_fraction=saved / without if without else 0.0)


ANYTIME_REFERENCE = 1.1  # objectives scaled to [0, 1] over the study's complete trials: 10% beyond the worst


def _fair_seconds_trained(t) -> float | None:
    """The fair seconds a trained trial spent: its epochs run x its epoch seconds alone."""
    alone = t.user_attrs.get("epoch_seconds_alone")
    return None if alone is None else float(epochs_trained(t)) * float(alone)


def anytime_curve(trials, directions: Sequence[str]) -> list[AnytimePoint]:
    """The front's hypervolume after each trained trial (complete or pruned; not duplicates, not rejected),
    in the order they ended, relative to the whole study's front: 1.0 at the last point once the front is
    complete. Every objective is minimised and scaled to [0, 1] over the study's complete trials, the
    reference point 10% beyond the worst (as the simulator scores a replay). A study with no complete
    trial has no curve."""
    latest = datetime.datetime.max
    trained = sorted((t for t in trials if was_trained(t)), key=lambda t: (t.datetime_complete or latest, t.number))
    complete = [t for t in trained if t.state == TrialState.COMPLETE and t.values is not None]
    if not complete:
        return []
    scaled = dict(zip((t.number for t in complete), scale_minimised([t.values for t in complete], directions)))
    reference = [ANYTIME_REFERENCE] * len(directions)
    final = hypervolume(_front_points(scaled.values()), reference)
    seconds = [_fair_seconds_trained(t) for t in trained]
    fair = None if any(s is None for s in seconds) else 0.0
    points: list[AnytimePoint] = []
    so_far: list[list[float]] = []
    for n, (t, spent) in enumerate(zip(trained, seconds), start=1):
        if t.number in scaled:
            so_far.append(scaled[t.number])
        if fair is not None:
            fair += spent
        hv = hypervolume(_front_points(so_far), reference)
        points.append(AnytimePoint(trials=n, fair_seconds=fair, hypervolume=hv / final if final > 0 else 1.0))
    return points


def _front_points(points) -> list[list[float]]:
    points = list(points)
    return [points[i] for i in front_indices(points)]


def summarize(storage_url: str, study_name: str | None = None, *, study=None) -> "StudyReport":
    """Everything `headsearch report` shows, for one study. Pass `study` to skip loading it again."""
    if study is None:
        study = load_study(storage_url, study_name)
    meta = study.user_attrs.get("headsearch") or {}
    objectives = objectives_of(study)
    trials = study.get_trials(deepcopy=False)
    primary = meta.get("primary_metric")
    primary_direction = metric_direction(meta.get("task"), primary)

    rows = []
    resumptions = resumed_by(trials)
    for t in trials:
        state = trial_state(t)
        values = {o.name: (t.values[i] if t.values is not None else None) for i, o in enumerate(objectives)}
        note = ": ".join(x for x in (pause_words(t, resumptions.get(t.number)), trial_note(t, state, primary_direction)) if x)
        rows.append(TrialRow(number=t.number, state=state, arch=t.user_attrs.get("arch", ""), values=values,
                             epochs_run=t.user_attrs.get("epochs_run"), note=note,
                             duplicate_of=t.user_attrs.get("duplicate_of")))
    counts = count_states(trials)
    if sum(counts.values()) != len(trials):
        raise RuntimeError(f"bug: state counts {counts} do not add up to {len(trials)} trials")
    settings = {k: meta[k] for k in ("sampler", "pruner", "seed", "trials", "data", "run_root") if k in meta}
    if "space" in meta:
        settings["space"] = meta["space"].get("name")
    rung_check, rung_warning = check_rungs(trials, meta)
    costs = study_cost_summary(study)
    return StudyReport(
        study=study.study_name, storage=hide_passwords(storage_url), task=meta.get("task"), primary_metric=primary,
        epochs=meta.get("epochs"), objectives=objectives, counts=counts,
        front=_front_rows(pareto_front(study), objectives),
        importances=param_importances(study, objectives),
        savings=pruning_savings(trials, meta.get("epochs")), trials=rows, settings=settings,
        diversity_vs_quality=diversity_correlations(trials, objectives),
        anytime=anytime_curve(trials, [o.direction for o in objectives]),
        rung_check=rung_check, rung_warning=rung_warning,
        costs={"architectures": costs.architectures, "seconds": costs.seconds, "line": costs.line()} if costs else None,
    )


def diversity_correlations(trials, objectives) -> dict[str, dict[str, float | None]]:
    """How each tracked diversity scalar (docs/design.md §5) relates to each objective across complete trials."""
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("diversity")
            and "duplicate_of" not in t.user_attrs]
    if not done:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    for metric in done[0].user_attrs["diversity"]:
        pairs = [(t.user_attrs["diversity"].get(metric), t.values) for t in done]
        pairs = [(d, v) for d, v in pairs if d is not None]
        out[metric] = {o.name: spearman([d for d, _ in pairs], [v[i] for _, v in pairs]) for i, o in enumerate(objectives)}
    return out
