"""`headsearch compare`: several configs, each trained with seeds 0..N-1, and how sure their differences are.

The runs live in an Optuna study like a search's trials: `ConfigGrid` takes the place of a search space
(trial = config i with seed s, parameters `config` and `seed`), so the same workers train them
(concurrently, in cohorts where the plan chooses them), the dashboard shows them, every run gets its
run directory, and running the same command again trains only what is missing. `next_point` hands the
workers the grid's points in order, (config 0, seed 0), (config 1, seed 0), ..., so an interrupted
comparison leaves whole seeds behind. A run that failed for good (it diverged) is not retried: it would
diverge again; an interrupted one is.

`comparison(study, grid)` reads the finished runs back and computes, per config and metric, the mean,
the standard deviation and the per-seed values, and per pair of configs the paired difference (b - a,
over the seeds both finished) with its bootstrap interval and paired t-test (headsearch.analysis.stats).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from optuna.trial import TrialState

from headsearch.analysis.stats import bootstrap_ci, mean_std, paired_difference
from headsearch.config import RunConfig
from headsearch.errors import ConfigError
from headsearch.io import write_atomic
from headsearch.jsonsafe import json_safe
from headsearch.search.export import data_flag
from headsearch.search.hypervolume import front_indices, minimised
from headsearch.search.record import config_key, holds_point
from headsearch.search.report import load_study, pareto_front
from headsearch.tasks import apply_overrides, flag_overrides, get_task, resolve_config
from headsearch.tasks.registry import parse_sets  # noqa: F401  (re-exported: compare's --set)
from headsearch.tasks.registry import task_reference

STUDY_PREFIX = "study:"


@dataclass(frozen=True)
class Candidate:
    """One config of a comparison: its name (the YAML's stem, or STUDY#TRIAL) and its run config (any seed)."""

    name: str
    config: RunConfig
    source: str  # the CONFIG argument it came from


def resolve_candidates(specs: Sequence[str], task, *, preset: str | None = None, epochs: int | None = None,
                       storage: str | None = None, allow_one: bool = False,
                       sets: dict[str, dict[str, Any]] | None = None) -> list[Candidate]:
    """The configs named on the command line: YAML paths (an architecture or a full run config, read as
    `headsearch train --config` reads it), `study:NAME:TRIAL` or `study:NAME:pareto` (from `storage`).
    `epochs` and then `sets` (`parse_sets`) override every one of them."""
    if not specs:
        raise ConfigError("give at least two configs to compare (YAML paths, study:NAME:TRIAL or study:NAME:pareto)")
    flags = flag_overrides(epochs=epochs)
    for section, values in (sets or {}).items():
        flags[section] = {**flags.get(section, {}), **values}
    out: list[Candidate] = []
    for spec in specs:
        if spec.startswith(STUDY_PREFIX):
            out += _study_candidates(spec, task, storage, flags)
            continue
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"config {spec}: no such file; give a YAML path (an architecture or a run config),"
                              " study:NAME:TRIAL or study:NAME:pareto")
        cfg = resolve_config(task, preset=preset, config=path, overrides=flags)
        task.check_config(cfg)
        out.append(Candidate(path.stem, cfg, spec))
    if len(out) < (1 if allow_one else 2):
        raise ConfigError(f"{len(out)} config to compare: give at least two (or a study's Pareto front of two or more)")
    return _unique_names(out)


def _study_candidates(spec: str, task, storage: str | None, flags: dict) -> list[Candidate]:
    parts = spec[len(STUDY_PREFIX):].rsplit(":", 1)
    if len(parts) != 2 or not parts[0] or not parts[1]:
        raise ConfigError(f"config {spec}: write study:NAME:TRIAL (a trial number) or study:NAME:pareto")
    name, which = parts
    if which != "pareto" and not which.isdigit():
        raise ConfigError(f"config {spec}: {which!r} is neither a trial number nor 'pareto'")
    study = load_study(storage, name)
    if which == "pareto":
        trials = pareto_front(study)
        if not trials:
            raise ConfigError(f"config {spec}: study {name} has no complete trials, so no Pareto front yet")
    else:
        number = int(which)
        trials = [t for t in study.get_trials(deepcopy=False) if t.number == number]
        if not trials:
            raise ConfigError(f"config {spec}: study {name} has no trial {number}; see `headsearch report --study {name}`")
        if trials[0].state != TrialState.COMPLETE and not isinstance(trials[0].user_attrs.get("config"), dict):
            raise ConfigError(f"config {spec}: trial {number} of study {name} has no config (it was rejected)")
    out = []
    seen: set[str] = set()
    for t in trials:
        cfg = t.user_attrs.get("config")
        if not isinstance(cfg, dict):
            raise ConfigError(f"config {spec}: trial {t.number} of study {name} has no recorded config")
        if cfg.get("task") not in (None, task.name, task_reference(task)):
            raise ConfigError(f"config {spec}: study {name} searched task {cfg.get('task')}, not {task.name}")
        key = config_key(cfg)
        if key in seen:  # a duplicate on the front: one config is enough
            continue
        seen.add(key)
        resolved = apply_overrides(task, resolve_config(task, config=cfg), flags)
        task.check_config(resolved)
        out.append(Candidate(f"{name}#{t.number}", resolved, spec))
    return out


def _unique_names(cands: list[Candidate]) -> list[Candidate]:
    counts: dict[str, int] = {}
    out = []
    for c in cands:
        n = counts.get(c.name, 0)
        counts[c.name] = n + 1
        out.append(c if n == 0 else Candidate(f"{c.name}-{n + 1}", c.config, c.source))
    return out


@dataclass(frozen=True)
class ConfigGrid:
    """The "space" of a comparison: trial = config i of `candidates` with seed s, 0 <= s < `seeds`.

    It answers what `headsearch.search.runner.Search` asks a `SearchSpace` (sample, base_config, summary and
    the soft-branch width's inputs: heads, fusions, families), plus `next_point`: the next (config, seed) no run holds yet."""

    candidates: tuple[Candidate, ...]
    seeds: int
    name: str = "compare"
    tasks: tuple[str, ...] = ()  # any task: the configs were resolved for the comparison's
    families: tuple[str, ...] = ()  # no halving or doubling families: `heads` lists every head count there is

    @property
    def points(self) -> int:
        return len(self.candidates) * self.seeds

    @property
    def heads(self) -> tuple[int, ...]:
        return tuple(sorted({h for c in self.candidates for h in (*c.config.arch.enc_heads, *c.config.arch.dec_heads)}))

    @property
    def fusions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.config.arch.fusion for c in self.candidates))

    def base_config(self, cfg: RunConfig, apply) -> RunConfig:
        """The first config as its runs train it (its preset, --epochs and --set applied; the search's seed):
        what the search checks before any study exists (the data folder loads and holds its val_size and
        train_limit, the model fits) and the plan measures. The preset's search budget that `cfg` carries is
        no comparison's: with it, a small --data-dir was refused for the preset's val_size whatever --set said."""
        return dataclasses.replace(self.candidates[0].config, seed=cfg.seed)

    def sample(self, trial, base: RunConfig) -> dict[str, Any]:
        """Config i with seed s, as overrides of everything (the base config plays no part)."""
        i = trial.suggest_int("config", 0, len(self.candidates) - 1)
        s = trial.suggest_int("seed", 0, self.seeds - 1)
        d = self.candidates[i].config.to_dict()
        d.pop("task", None)
        d["seed"] = s
        return d

    def summary(self) -> dict[str, Any]:
        """What a resumed comparison must keep: the configs (not the seed count: more seeds extend it)."""
        return {"name": self.name, "compare": [c.name for c in self.candidates],
                "configs": [{k: v for k, v in c.config.to_dict().items() if k != "seed"} for c in self.candidates]}

    def next_point(self, trials) -> dict[str, int] | None:
        """The first (config, seed), seed-major, that no trial holds: none complete, running or waiting, and
        none failed for good (an interrupted run is retried). None when every point is held."""
        held = {(t.params.get("config"), t.params.get("seed")) for t in trials if holds_point(t)}
        return next(({"config": i, "seed": s} for s in range(self.seeds) for i in range(len(self.candidates))
                     if (i, s) not in held), None)


def default_study_name(task_name: str, cands: Sequence[Candidate]) -> str:
    """compare-<task>-<a short hash of the configs>: the same configs resume the same comparison."""
    text = json.dumps([{k: v for k, v in c.config.to_dict().items() if k != "seed"} for c in cands], sort_keys=True)
    return f"compare-{task_name}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


# -- reading a comparison back ----------------------------------------------------------------------
def run_metrics(trial, objectives) -> dict[str, float]:
    """One finished run's numbers: validation and test metrics at the best epoch, best epoch, objectives
    (the fair time among them) and parameters."""
    a = trial.user_attrs
    m: dict[str, float] = {}
    for split in ("val", "test"):
        for k, v in (a.get(f"{split}_metrics") or {}).items():
            m[f"{split}_{k}"] = float(v)
    for o in objectives:
        v = o.trial_value(trial)
        if v is not None and f"val_{o.name}" not in m:
            m[o.name] = float(v)
    for k in ("best_epoch", "params"):
        if a.get(k) is not None:
            m[k] = float(a[k])
    return m


def comparison(study, grid: ConfigGrid, task, objectives) -> dict[str, Any]:
    """The comparison as the JSON schema of docs/comparing.md's `headsearch compare` section:
    {"configs": [{name, config, runs: [{seed, metrics, run_dir, trial, curve}], mean, std}], "differences": [{a, b,
    metric, mean_diff, ci95, p_value, n, distinguishable}], "best": {...}, "seeds", "missing"}; `curve`: epoch -> the validation
    primary metric (the trial's intermediate values)."""
    by_point: dict[tuple[int, int], Any] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        i, s = t.params.get("config"), t.params.get("seed")
        if i is not None and s is not None and s < grid.seeds and i < len(grid.candidates):
            by_point.setdefault((i, s), t)
    configs, values = [], []
    for i, cand in enumerate(grid.candidates):
        runs = []
        for s in range(grid.seeds):
            t = by_point.get((i, s))
            if t is not None:
                runs.append({"seed": s, "metrics": run_metrics(t, objectives), "run_dir": t.user_attrs.get("run_dir"),
                             "trial": t.number, "curve": {int(e): v for e, v in sorted(t.intermediate_values.items())}})
        names = list(dict.fromkeys(k for r in runs for k in r["metrics"]))
        per_metric = {k: [r["metrics"][k] for r in runs if k in r["metrics"]] for k in names}
        stats = {k: mean_std(v) for k, v in per_metric.items()}
        configs.append({"name": cand.name, "source": cand.source, "config": cand.config.to_dict(), "runs": runs,
                        "mean": {k: _num(v[0]) for k, v in stats.items()}, "std": {k: _num(v[1]) for k, v in stats.items()},
                        # the bootstrap interval of the mean over seeds (None with one seed)
                        "ci95": {k: list(bootstrap_ci(v)) if len(v) > 1 else None for k, v in per_metric.items()}})
        values.append({r["seed"]: r["metrics"] for r in runs})
    differences = []
    metrics = list(dict.fromkeys(k for c in configs for k in c["mean"]))
    for ia in range(len(configs)):
        for ib in range(ia + 1, len(configs)):
            for metric in metrics:
                seeds = sorted(s for s in values[ia] if s in values[ib] and metric in values[ia][s] and metric in values[ib][s])
                if len(seeds) < 2:
                    continue
                d = paired_difference([values[ia][s][metric] for s in seeds], [values[ib][s][metric] for s in seeds])
                differences.append({"a": configs[ia]["name"], "b": configs[ib]["name"], "metric": metric,
                                    "mean_diff": d.mean_diff, "ci95": list(d.ci95), "p_value": d.p_value, "n": d.n,
                                    "distinguishable": d.distinguishable})
    missing = [{"config": grid.candidates[i].name, "seed": s} for s in range(grid.seeds)
               for i in range(len(grid.candidates)) if (i, s) not in by_point]
    return {"study": study.study_name, "task": task_reference(task), "seeds": grid.seeds, "curve_metric": f"val_{task.primary.name}",
            "objectives": [{"name": _metric_of(o), "direction": o.direction} for o in objectives],
            "front_on_means": front_on_means(configs, objectives), "configs": configs,
            "differences": differences, "best": best_config(configs, differences, task), "missing": missing}


def _metric_of(objective) -> str:
    """The name an objective's value has among a run's metrics (a task metric is its validation value)."""
    return objective.name if objective.convergence is not None else f"val_{objective.name}"


def front_on_means(configs: list[dict], objectives) -> list[str]:
    """The configs no other config dominates (`hypervolume.dominates`) on the objectives' means over seeds."""
    keys = [_metric_of(o) for o in objectives]
    points = {c["name"]: minimised([c["mean"][k] for k in keys], [o.direction for o in objectives]) for c in configs
              if all(c["mean"].get(k) is not None for k in keys)}
    names = list(points)
    return [names[i] for i in front_indices(list(points.values()))]


def robust_search(storage: str, study_name: str | None, seeds: int, *, run_root: str = "runs", device: str = "auto",
                  workers: int | None = None, cohort: int | None = None):
    """`report --robust N`: the comparison that retrains study `study_name`'s Pareto front with seeds 0..N-1,
    on the search's own task and data (its `headsearch` attributes). Returns (Search, ConfigGrid)."""
    check_seeds(seeds, "--robust")
    study = load_study(storage, study_name)
    meta = study.user_attrs.get("headsearch") or {}
    if not meta.get("task"):
        raise ConfigError(f"study {study.study_name} was not written by `headsearch run`: it names no task")
    task = get_task(meta["task"])
    data = meta.get("data")
    data_dir = data_file = None
    if data and data != "download":
        data_dir, data_file = (data, None) if data_flag(data) == "--data-dir" else (None, data)
    return comparison_search([f"{STUDY_PREFIX}{study.study_name}:pareto"], task.name, seeds=seeds, storage=storage,
                             run_root=run_root, study=f"{study.study_name}-robust", data_dir=data_dir,
                             data_file=data_file, workers=workers, cohort=cohort, device=device, allow_one=True)


def best_config(configs: list[dict], differences: list[dict], task) -> dict[str, Any] | None:
    """The config with the best mean validation primary metric, and whether its paired difference with
    each other config is distinguishable (the 95% interval excludes 0 and p < 0.05: stats.distinguishable)."""
    metric = f"val_{task.primary.name}"
    scored = [(c["mean"].get(metric), c["name"]) for c in configs if c["mean"].get(metric) is not None]
    if not scored:
        return None
    sign = -1.0 if task.primary.direction == "maximize" else 1.0
    _, best = min(scored, key=lambda vn: sign * vn[0])
    clear, unclear = [], []
    for d in differences:
        if d["metric"] != metric or best not in (d["a"], d["b"]):
            continue
        other = d["b"] if d["a"] == best else d["a"]
        (clear if d["distinguishable"] else unclear).append(other)
    others = [c["name"] for c in configs if c["name"] != best]
    untested = [o for o in others if o not in clear and o not in unclear]
    return {"name": best, "metric": metric, "direction": task.primary.direction,
            "distinguishable": not unclear and not untested and bool(clear),
            "distinguishable_from": clear, "not_distinguishable_from": unclear + untested}


def _num(v: float) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def write_comparison(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """comparison.json and, when matplotlib is there, curves.png (the validation curves with a band per
    config) into `out_dir`; each file whole or absent. Returns the paths written."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} is a file: pass a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "comparison.json"]
    write_atomic(paths[0], json.dumps(json_safe(result), indent=1) + "\n")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return paths
    from headsearch.search.plots import write_compare_curves

    paths.append(write_compare_curves(result, out_dir / "curves.png"))
    return paths


def check_seeds(seeds: int, flag: str = "--seeds") -> None:
    if seeds < 2:
        raise ConfigError(f"{flag} {seeds}: a comparison needs at least 2 seeds per config (differences need a spread)")


__all__ = ["Candidate", "ConfigGrid", "comparison_search", "best_config", "front_on_means", "parse_sets", "robust_search", "write_comparison", "check_seeds", "comparison",
           "default_study_name", "resolve_candidates", "run_metrics"]


def comparison_search(configs: Sequence[str], task: str, *, seeds: int, storage: str, run_root: str,
                      preset: str | None = None, epochs: int | None = None,
                      sets: dict[str, dict[str, Any]] | None = None, study: str | None = None,
                      data_dir: str | None = None, data_file: str | None = None, workers: int | None = None,
                      cohort: int | None = None, device: str = "auto", allow_one: bool = False):
    """The comparison's search (every config x seeds 0..N-1 as a grid, no pruning; its settings checked, its
    data loadable) and its grid: (Search, ConfigGrid). Nothing is written yet. `allow_one`: one config is
    enough (`robust_search`: a Pareto front of one)."""
    from headsearch.search.runner import Search, SearchSettings

    check_seeds(seeds)
    cands = resolve_candidates(list(configs), get_task(task), preset=preset, epochs=epochs, storage=storage, sets=sets,
                               allow_one=allow_one)
    grid = ConfigGrid(tuple(cands), seeds)
    settings = SearchSettings(
        task=task, space=grid, trials=grid.points, sampler="random", pruner="none", storage=storage,
        study=study or default_study_name(task, cands), preset=preset, data_dir=data_dir, data_file=data_file,
        workers=workers, cohort=cohort, run_root=run_root, device=device)
    return Search(settings), grid
