"""`headsearch export`: write the full run config of chosen trials as YAML, ready for `headsearch train`.

Each file (`trial-00012.yaml`) holds the trial's `RunConfig` (task, seed, arch, train, data) exactly
as the search trained it, under a comment header with the study, the trial's objective values and
metrics, and the command that retrains it. Retraining with the same seed on the same machine
reproduces the trial's validation and test metrics.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml
from optuna.trial import TrialState

from headsearch.errors import HeadsearchError
from headsearch.io import hide_passwords, write_atomic
from headsearch.search.objectives import CONVERGENCE, Objective, known_names, objective_for, objectives_of
from headsearch.search.report import load_study, pareto_front, trial_state
from headsearch.tasks import get_task, resolve_config


def export_configs(
    storage_url: str,
    study_name: str | None,
    *,
    trial: int | None = None,
    pareto: bool = False,
    best: str | None = None,
    out_dir: Path,
) -> list[Path]:
    """Write one YAML per selected trial into `out_dir`; return the paths.

    Exactly one selector: `trial` (a trial number), `pareto` (every trial on the Pareto front, or
    the best trial of a single-objective study) or `best` (an objective or metric name: the complete
    trial best on it, by its direction; metrics are compared on the validation split).
    Everything is checked before `out_dir` is created.
    """
    chosen = [s for s, on in (("--trial", trial is not None), ("--pareto", pareto), ("--best", best is not None)) if on]
    if len(chosen) != 1:
        raise HeadsearchError(
            f"pass exactly one of --trial N, --pareto, --best METRIC (got {', '.join(chosen) if chosen else 'none'})")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise HeadsearchError(f"--out {out_dir} is a file: pass a folder")
    study = load_study(storage_url, study_name)
    if trial is not None:
        trials = [_one_trial(study, trial)]
    elif pareto:
        front = pareto_front(study)
        numbers = {f.number for f in front}
        # A duplicate of a trial on the front has the same config: one file is enough.
        trials = [t for t in front if t.user_attrs.get("duplicate_of") not in numbers]
        if not trials:
            raise HeadsearchError(f"study {study.study_name} has no complete trials yet: nothing is on its Pareto front")
    else:
        trials = [_best_on(study, best)]
    for t in trials:
        if not isinstance(t.user_attrs.get("config"), dict):
            raise HeadsearchError(f"trial {t.number} of study {study.study_name} has no recorded config"
                                  f" (was the study written by `headsearch run`?)")
    # Every file's text first (each config resolved, so validated, as `train --config` will read it),
    # then the folder: a config that no longer resolves leaves nothing behind.
    paths = [out_dir / f"trial-{t.number:05d}.yaml" for t in trials]
    texts = [trial_yaml(study, t, storage_url, path) for t, path in zip(trials, paths)]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HeadsearchError(f"cannot create {out_dir}: {e.strerror}") from None
    for path, text in zip(paths, texts):
        write_atomic(path, text)
    return paths


def _one_trial(study, number: int):
    trials = study.get_trials(deepcopy=False)
    t = next((t for t in trials if t.number == number), None)
    if t is None:
        span = f"0 to {len(trials) - 1}" if trials else "none yet"
        raise HeadsearchError(f"study {study.study_name} has no trial {number} (its trials are {span}):"
                              f" see `headsearch report --study {study.study_name}`")
    if t.state != TrialState.COMPLETE:
        state = trial_state(t)
        why = {"pruned": "was pruned before it finished", "rejected": "was rejected (an invalid architecture)",
               "failed": "failed", "running": "is still running", "waiting": "has not started",
               "duplicate": f"proposed trial {t.user_attrs.get('duplicate_of')}'s architecture again and was not trained",
               "over_budget": "was asked when the budget was full already and was not trained"}[state]
        raise HeadsearchError(
            f"trial {number} of study {study.study_name} {why}: only complete trials have results to reproduce;"
            f" pick a complete one (--pareto, --best METRIC, or a number from `headsearch report`)")
    return t


def _best_on(study, name: str):
    """The complete trial best on an objective of the study (its value), else on a validation metric
    of its task or a convergence objective (their values recorded in the trial)."""
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values is not None]
    objectives = objectives_of(study)
    meta = study.user_attrs.get("headsearch") or {}
    task = None
    if meta.get("task"):
        try:
            task = get_task(meta["task"])
        except HeadsearchError:
            pass
    names = [o.name for o in objectives]
    objective: Objective | None
    if name in names:
        i = names.index(name)
        objective, key = objectives[i], (lambda t, i=i: t.values[i])
    else:
        # A metric of the task (recorded on the validation split), or time/epochs/params.
        objective = objective_for(task, name)
        if objective is None:
            known = list(dict.fromkeys(names + (known_names(task) if task is not None else list(CONVERGENCE))))
            raise HeadsearchError(f"--best {name}: not an objective or metric of study {study.study_name}: use one of {', '.join(known)}")
        key = objective.trial_value
    scored = [(key(t), t) for t in complete]
    scored = [(v, t) for v, t in scored if v is not None]
    if not scored:
        raise HeadsearchError(f"study {study.study_name} has no complete trial with a value of {name} yet")
    sign = -1.0 if objective.direction == "maximize" else 1.0
    return min(scored, key=lambda vt: (sign * vt[0], vt[1].number))[1]  # ties: the earliest trial


def retrain_command(study, t, path: Path) -> str:
    meta = study.user_attrs.get("headsearch") or {}
    task = t.user_attrs["config"].get("task") or meta.get("task", "TASK")
    argv = ["headsearch", "train", "--task", task, "--config", str(path)]
    data = meta.get("data")
    if data and data != "download":
        argv += [data_flag(data), data]
    return shlex.join(argv)


def data_flag(data: str) -> str:
    """The flag a study's recorded data path goes with: --data-dir for a folder (or a missing path without
    a suffix), --data-file otherwise."""
    p = Path(data)
    return "--data-dir" if p.is_dir() or (not p.exists() and not p.suffix) else "--data-file"


def trial_yaml(study, t, storage_url: str, path: Path) -> str:
    """The trial's config as YAML under a comment header."""
    a = t.user_attrs
    objectives = objectives_of(study)
    lines = [
        f"headsearch export: study {study.study_name}, trial {t.number} ({trial_state(t)})",
        f"storage: {hide_passwords(storage_url)}",
        f"architecture: {a.get('arch', '')}",
        "objectives: " + ", ".join(f"{o.name} = {_num(v)} ({o.direction})" for o, v in zip(objectives, t.values or [])),
    ]
    if a.get("val_metrics"):
        lines.append(f"validation (best epoch {a.get('best_epoch')}): {_metrics(a['val_metrics'])}")
    if a.get("test_metrics"):
        lines.append(f"test (best checkpoint): {_metrics(a['test_metrics'])}")
    if a.get("params") is not None:
        lines.append(f"parameters: {a['params']:,}; training seconds to best: {_num(a.get('best_train_seconds'))}")
    if a.get("duplicate_of") is not None:
        lines.append(f"results reused from the identical trial {a['duplicate_of']}")
    if a.get("run_dir"):
        lines.append(f"run directory: {a['run_dir']}")
    lines.append(f"retrain: {retrain_command(study, t, path)}")
    header = "".join(f"# {line}\n" for line in lines)
    config = resolve_config(str(a["config"].get("task")), config=a["config"])
    return header + yaml.safe_dump(config.to_dict(), sort_keys=False)


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)


def _metrics(m: dict[str, Any]) -> str:
    return ", ".join(f"{k} {_num(v)}" for k, v in m.items())
