"""What a search optimises: the one table of objectives that runner, report, export and plots share.

An objective is a task metric (its name and direction come from `Task.metrics`; the value is the
validation metric at the best epoch) or one of the convergence objectives of `CONVERGENCE`, always
minimised: `time` (training seconds to the best validation metric at the architecture's speed alone
on the device: the best epoch times one epoch's seconds measured with the device to itself, so it
does not depend on how many trials share the device), `epochs` (epochs to it) and `params` (the
parameter count). Each is read from a `TrainResult` while the search runs (`value`) and from a
stored trial's user_attrs afterwards (`trial_value`: the runner's `record_result` writes
every convergence objective's `TrainResult` attribute there under the same name). Adding a
convergence objective is one row of `CONVERGENCE`.

A study stores its objectives twice: as Optuna's metric names and directions (`objectives_of`), and
as `[{"name", "direction"}]` in its `headsearch` attributes (`Objective.stored`), which a resumed
search must match.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from headsearch.errors import ConfigError

MAXIMIZE, MINIMIZE = "maximize", "minimize"


@dataclass(frozen=True)
class Convergence:
    """A convergence objective (minimised). `attr` names both the `TrainResult` attribute and the
    trial's user_attr that hold its value."""

    name: str
    unit: str
    label: str  # axis label, without the direction
    description: str
    attr: str


CONVERGENCE: dict[str, Convergence] = {c.name: c for c in (
    # Fair: the architecture's own speed, not the crowd's (docs/design.md §7.4). The raw seconds, as
    # measured beside whatever shared the device, stay in the trial's best_train_seconds.
    Convergence("time", "seconds", "time to best validation (training seconds alone on the device)",
                "best epoch x one epoch's training seconds with the device to itself", "best_seconds_alone"),
    Convergence("epochs", "epochs", "epochs to best validation (epochs)", "epochs to the best validation metric", "best_epoch"),
    Convergence("params", "parameters", "parameters (count)", "parameter count", "params"),
)}


@dataclass(frozen=True)
class Objective:
    """One objective of a study: its name, direction ("maximize" or "minimize") and unit ("seconds"
    for time; "" for a task metric, which has no unit). The unit follows from the name."""

    name: str
    direction: str
    unit: str = field(init=False)

    def __post_init__(self) -> None:
        c = CONVERGENCE.get(self.name)
        object.__setattr__(self, "unit", c.unit if c else "")

    @property
    def convergence(self) -> Convergence | None:
        return CONVERGENCE.get(self.name)

    @property
    def label(self) -> str:
        """What an axis of this objective shows, with its unit."""
        c = self.convergence
        return c.label if c else f"validation {self.name}"

    def value(self, result: Any) -> float:
        """The objective's value in a `TrainResult` (what the search tells Optuna)."""
        c = self.convergence
        return float(getattr(result, c.attr) if c else result.best_metrics[self.name])

    def trial_value(self, trial: Any) -> float | None:
        """The value recorded in a finished trial's user_attrs (None when it was not recorded)."""
        c = self.convergence
        a = trial.user_attrs
        return a.get(c.attr) if c else (a.get("val_metrics") or {}).get(self.name)

    def stored(self) -> dict[str, str]:
        """As a study's `headsearch` attributes keep it (what a resumed search is compared on)."""
        return {"name": self.name, "direction": self.direction}


def axis_label(name: str, direction: str | None = None) -> str:
    """An objective's (or metric's) axis label with its unit and which way is better."""
    label = Objective(name, direction or MINIMIZE).label
    if direction:
        label += f", {'higher' if direction == MAXIMIZE else 'lower'} is better"
    return label


def objective_for(task: Any, name: str) -> Objective | None:
    """The objective `name` of `task` (a task metric or a convergence objective); None if unknown.
    With `task` None, only the convergence objectives are known."""
    if name in CONVERGENCE:
        return Objective(name, MINIMIZE)
    for m in task.metrics if task is not None else ():
        if m.name == name:
            return Objective(name, m.direction)
    return None


def known_names(task: Any) -> list[str]:
    return [m.name for m in task.metrics] + list(CONVERGENCE)


def resolve_objectives(task: Any, names: Sequence[str] | None) -> list[Objective]:
    """The objectives of a search. Default: the task's quality metric and convergence time."""
    names = list(names) if names else [task.primary.name, "time"]
    out = []
    for n in names:
        o = objective_for(task, n)
        if o is None:
            raise ConfigError(f"unknown objective {n!r} for task {task.name}: use {', '.join(known_names(task))}")
        out.append(o)
    if len({o.name for o in out}) != len(out):
        raise ConfigError(f"objectives {names} name one twice")
    return out


def progress_kinds(objectives: Sequence[Mapping[str, Any]], primary: str | None) -> list[str | None]:
    """What each objective (as `Objective.stored` keeps it) is known by while a trial runs (`ParetoRule`): the primary
    metric's curve, time, params, epochs; None for another task metric (known only at the end)."""
    kinds = {"time": "time", "params": "params", "epochs": "epochs"}
    if primary:
        kinds[primary] = "quality"
    return [kinds.get(o.get("name")) for o in objectives]


def directions_of(study: Any) -> list[str]:
    from optuna.study import StudyDirection

    return [MAXIMIZE if d == StudyDirection.MAXIMIZE else MINIMIZE for d in study.directions]


def objectives_of(study: Any) -> list[Objective]:
    """A stored study's objectives, from Optuna's metric names and directions."""
    names = study.metric_names or [f"objective_{i}" for i in range(len(study.directions))]
    return [Objective(n, d) for n, d in zip(names, directions_of(study))]
