"""Search spaces: a small YAML schema, validated with clear errors, and how a trial samples from it.

A space file (search_spaces/*.yaml at the top of the repository, or any path) looks like:

    description: Deep Head's question - head schedules x skip connections
    tasks: [translation-en-es, vit-cifar10]     # optional: the tasks it is meant for
    schedule:
      families: [uniform, halving, doubling, free]
      heads: [1, 2, 4, 8, 16, 32, 64]          # head counts allowed (per layer, or the largest)
      min_heads: 1                             # halving/doubling never go below this
    skip: [none, output, scores]
    fusion: [none]
    ranges:                                    # optional: any ArchConfig/TrainConfig field
      lr: {low: 1.0e-4, high: 1.0e-2, log: true}
      d_model: [48, 96]
    fixed:                                     # optional: values every trial uses
      arch: {enc_layers: 6}

Parameters as Optuna sees them: `schedule`, `heads` (uniform: every layer; halving: the first
layer, halved per layer; doubling: the last layer, halved per layer going backwards), `heads_l{i}`
(one per layer, only under `free`), `skip`, `fusion`, and one per range.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import yaml

from headsearch.config import FUSIONS, SKIPS, ArchConfig, RunConfig, TrainConfig, parse_yaml, read_text_file
from headsearch.errors import ConfigError

SCHEDULE_FAMILIES = ("uniform", "halving", "doubling", "free")
_SEARCH_HANDLED = {"enc_heads", "skip", "fusion"}  # sampled through schedule/skip/fusion, not ranges
_ARCH_FIELDS = {f.name for f in dataclasses.fields(ArchConfig)}
_TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


@dataclass(frozen=True)
class Range:
    """One searched field: categorical `choices`, or numeric `low`..`high` (int when both are ints)."""

    name: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None

    @property
    def section(self) -> str:
        return "arch" if self.name in _ARCH_FIELDS else "train"

    def suggest(self, trial) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.name, list(self.choices))
        if isinstance(self.low, int) and isinstance(self.high, int):  # YAML `2` vs `2.0` decides int vs float
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.name, float(self.low), float(self.high), log=self.log, step=self.step)

    def describe(self) -> str:
        if self.choices is not None:
            return f"{self.name} in {list(self.choices)}"
        return f"{self.name} in [{self.low}, {self.high}]{' log' if self.log else ''}"


@dataclass(frozen=True)
class SearchSpace:
    name: str
    description: str = ""
    families: tuple[str, ...] = ("uniform",)
    heads: tuple[int, ...] = (1, 2, 4, 8)
    min_heads: int = 1
    skips: tuple[str, ...] = ("none",)
    fusions: tuple[str, ...] = ("none",)
    ranges: tuple[Range, ...] = ()
    fixed: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    tasks: tuple[str, ...] | None = None
    path: str | None = None

    def base_config(self, cfg: RunConfig, apply) -> RunConfig:
        """The task's config with this space's fixed values applied (`apply` = tasks.apply_overrides)."""
        return apply(cfg, {k: dict(v) for k, v in self.fixed.items()}) if self.fixed else cfg

    def sample(self, trial, base: RunConfig) -> dict[str, dict[str, Any]]:
        """Ask `trial` for one architecture; return overrides {"arch": {...}, "train": {...}}.

        Head counts that cannot divide a fixed d_model are never offered; with a searched d_model
        the caller validates the result (an invalid combination is rejected, and recorded as such).
        """
        out: dict[str, dict[str, Any]] = {"arch": {}, "train": {}}
        for r in self.ranges:
            out[r.section][r.name] = r.suggest(trial)
        d_model = out["arch"].get("d_model", base.arch.d_model)
        layers = out["arch"].get("enc_layers", base.arch.enc_layers)
        head_dim = out["arch"].get("head_dim", base.arch.head_dim)
        d_model_searched = "d_model" in out["arch"]
        allowed = [h for h in self.heads if d_model_searched or head_dim != "split" or d_model % h == 0]
        if not allowed:
            raise ConfigError(
                f"space {self.name}: none of the head counts {list(self.heads)} divides d_model = {d_model}: add divisors to schedule.heads"
            )
        family = trial.suggest_categorical("schedule", list(self.families))
        out["arch"]["enc_heads"] = self._schedule(trial, family, allowed, layers)
        out["arch"]["enc_layers"] = layers
        out["arch"]["skip"] = trial.suggest_categorical("skip", list(self.skips))
        out["arch"]["fusion"] = trial.suggest_categorical("fusion", list(self.fusions))
        return out

    def _schedule(self, trial, family: str, allowed: list[int], layers: int) -> list[int]:
        if family == "free":
            return [trial.suggest_categorical(f"heads_l{i}", allowed) for i in range(layers)]
        h = trial.suggest_categorical("heads", allowed)
        if family == "uniform":
            return [h] * layers
        halved = [max(h // 2**i, self.min_heads) for i in range(layers)]  # h, h/2, h/4, ...
        return halved if family == "halving" else halved[::-1]

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "schedule": {"families": list(self.families), "heads": list(self.heads), "min_heads": self.min_heads},
            "skip": list(self.skips),
            "fusion": list(self.fusions),
            "ranges": [r.describe() for r in self.ranges],
            "fixed": {k: dict(v) for k, v in self.fixed.items()},
            "tasks": list(self.tasks) if self.tasks else None,
        }


# -- parsing --------------------------------------------------------------------------------

def _fail(where: str, message: str) -> ConfigError:
    return ConfigError(f"search space {where}: {message}")


def _str_list(where: str, key: str, value: Any, allowed: tuple[str, ...]) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise _fail(where, f"{key} must be a non-empty list, e.g. [{', '.join(allowed)}]")
    unknown = [v for v in items if v not in allowed]
    if unknown:
        raise _fail(where, f"{key} has unknown value(s) {unknown}: use {', '.join(allowed)}")
    return tuple(dict.fromkeys(items))


def _parse_range(where: str, name: str, spec: Any) -> Range:
    if name in _SEARCH_HANDLED or name in ("enc_layers_heads",):
        raise _fail(where, f"ranges.{name}: search heads, skip and fusion through schedule/skip/fusion")
    if name not in _ARCH_FIELDS | _TRAIN_FIELDS:
        raise _fail(where, f"ranges.{name} is not an architecture or training field")
    if isinstance(spec, list):
        if not spec:
            raise _fail(where, f"ranges.{name} lists no choices")
        return Range(name, choices=tuple(spec))
    if not isinstance(spec, dict) or not {"low", "high"} <= set(spec) or set(spec) - {"low", "high", "log", "step"}:
        raise _fail(where, f"ranges.{name} must be a list of choices or {{low, high[, log][, step]}}")
    low, high = spec["low"], spec["high"]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)) or not low < high:
        raise _fail(where, f"ranges.{name}: low ({low}) must be a number below high ({high})")
    if spec.get("log") and low <= 0:
        raise _fail(where, f"ranges.{name}: a log range needs low > 0")
    return Range(name, low=low, high=high, log=bool(spec.get("log", False)), step=spec.get("step"))


def parse_space(d: Mapping[str, Any], name: str, path: str | None = None) -> SearchSpace:
    where = path or name
    if not isinstance(d, Mapping):
        raise _fail(where, "must be a mapping of keys to values")
    known = {"description", "tasks", "schedule", "skip", "fusion", "ranges", "fixed"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise _fail(where, f"unknown key(s) {', '.join(unknown)}: known are {', '.join(sorted(known))}")
    sched = d.get("schedule") or {}
    if not isinstance(sched, Mapping) or set(sched) - {"families", "heads", "min_heads"}:
        raise _fail(where, "schedule takes families, heads and min_heads")
    families = _str_list(where, "schedule.families", sched.get("families", ["uniform"]), SCHEDULE_FAMILIES)
    heads = sched.get("heads", [1, 2, 4, 8])
    if not isinstance(heads, list) or not heads or not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in heads):
        raise _fail(where, f"schedule.heads must be a list of positive integers, got {heads!r}")
    min_heads = sched.get("min_heads", 1)
    if not isinstance(min_heads, int) or min_heads < 1:
        raise _fail(where, f"schedule.min_heads must be a positive integer, got {min_heads!r}")
    ranges = d.get("ranges") or {}
    if not isinstance(ranges, Mapping):
        raise _fail(where, "ranges must be a mapping of field names to choices or {low, high}")
    fixed = d.get("fixed") or {}
    if not isinstance(fixed, Mapping) or set(fixed) - {"arch", "train", "data"}:
        raise _fail(where, "fixed takes arch, train and data sections")
    for section, fields_ in (("arch", _ARCH_FIELDS), ("train", _TRAIN_FIELDS)):
        bad = sorted(set(fixed.get(section) or {}) - fields_)
        if bad:
            raise _fail(where, f"fixed.{section} has unknown field(s) {', '.join(bad)}")
    tasks = d.get("tasks")
    if tasks is not None and (not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks)):
        raise _fail(where, "tasks must be a list of task names")
    return SearchSpace(
        name=name,
        description=str(d.get("description", "")),
        families=families,
        heads=tuple(sorted(set(heads))),
        min_heads=min_heads,
        skips=_str_list(where, "skip", d.get("skip", ["none"]), SKIPS),
        fusions=_str_list(where, "fusion", d.get("fusion", ["none"]), FUSIONS),
        ranges=tuple(_parse_range(where, k, v) for k, v in ranges.items()),
        fixed={k: dict(v or {}) for k, v in fixed.items()},
        tasks=tuple(tasks) if tasks else None,
        path=path,
    )


# -- registry -------------------------------------------------------------------------------

def _builtin_dir():
    """search_spaces/ at the top of a source checkout (beside headsearch/, tests/, examples/); a wheel ships the
    same files as headsearch/search_spaces/ (pyproject.toml maps one onto the other)."""
    checkout = Path(__file__).resolve().parents[2] / "search_spaces"
    return checkout if checkout.is_dir() else resources.files("headsearch") / "search_spaces"


def builtin_spaces() -> dict[str, str]:
    """Name -> YAML text of the built-in spaces (search_spaces/*.yaml)."""
    return {p.name[:-5]: p.read_text() for p in sorted(_builtin_dir().iterdir(), key=lambda p: p.name) if p.name.endswith(".yaml")}


def load_space(name_or_path: str) -> SearchSpace:
    """A built-in space by name (see `headsearch spaces`), or a YAML file by path."""
    spaces = builtin_spaces()
    if name_or_path in spaces:
        text, name, path = spaces[name_or_path], name_or_path, None
    else:
        p = Path(name_or_path)
        if not p.exists():
            raise ConfigError(f"unknown search space {name_or_path!r}: use one of {', '.join(spaces)} or the path of a YAML file")
        text = read_text_file(p, "search space", f"use one of {', '.join(spaces)} or the path of a YAML file")
        name, path = p.stem, str(p)
    try:
        d = parse_yaml(text)
    except yaml.YAMLError:
        raise ConfigError(f"search space {path or name} is not valid YAML: fix the syntax") from None
    return parse_space(d, name, path)


def all_spaces() -> list[SearchSpace]:
    return [load_space(n) for n in builtin_spaces()]


# -- enumeration ----------------------------------------------------------------------------

class NotEnumerable(Exception):
    """The space has a numeric range: its points cannot be listed."""


class _BranchingTrial:
    """Stands in for an Optuna trial and answers each categorical question with the choice `path` names
    (the first choice past its end), so that `enumerate_params` can walk every branch of a sampling."""

    def __init__(self, path: list[int]):
        self.path, self.asked, self.params = path, [], {}

    def suggest_categorical(self, name: str, choices):
        depth = len(self.asked)
        index = self.path[depth] if depth < len(self.path) else 0
        self.asked.append(len(choices))
        self.params[name] = choices[index]
        return choices[index]

    def suggest_int(self, name: str, low: int, high: int, step: int = 1, log: bool = False):
        values = range(low, high + 1, step)
        if log or len(values) > 1000:
            raise NotEnumerable(f"{name} has too many values to list")
        return self.suggest_categorical(name, list(values))

    def suggest_float(self, name: str, *args, **kwargs):
        raise NotEnumerable(f"{name} is a continuous range")


def enumerate_params(sample, limit: int = 100_000) -> list[dict[str, Any]] | None:
    """Every parameter set that `sample(trial)` can ask for, when it asks only categorical (or integer)
    questions: a depth-first walk over the choices, each question's answers in order. None when a
    question is continuous, or the space has more than `limit` points (then it is not worth listing)."""
    out: list[dict[str, Any]] = []
    path: list[int] = []
    while True:
        trial = _BranchingTrial(path)
        try:
            sample(trial)
        except NotEnumerable:
            return None
        except ConfigError:
            pass  # a branch the space itself refuses: no point there
        else:
            out.append(dict(trial.params))
        if len(out) > limit:
            return None
        # The next branch: advance the deepest question that has choices left, and drop those below it.
        path = [trial.path[i] if i < len(trial.path) else 0 for i in range(len(trial.asked))]
        while path and path[-1] + 1 >= trial.asked[len(path) - 1]:
            path.pop()
        if not path:
            return out
        path[-1] += 1
