"""Every architecture's cost before its trial: its epoch seconds alone, measured up front for `--sampler cost`.

The cost-aware sampler (`headsearch.search.cost_sampler`) proposes from every architecture's epoch seconds
alone, so a search that uses it measures them before its first trial. Each architecture of the space (at
most MAX_ARCHITECTURES) gets a solo model, warmed up in the step mode its trial will run, and
ALONE_SETTLE + ALONE_STEPS steps timed under the device's exclusive hold: `training.clock.measure_alone`,
how a cohort's trials are timed. Each figure is stored in the study as soon as it is measured, as the user
attribute `cost:<alone_key>` (the fair clock's key: task, architecture, data, speed fields, device model,
threads, torch, step mode; `headsearch.machine.fairtime`). So a resumed search, a second machine with the
same kind of device, or a run that crashed halfway measures only what is missing, and an architecture a
trial has already timed alone is not measured again.

The trials' `time` stays what their own training measures: these figures only tell the sampler what each
architecture costs. The wall seconds the measurement took are stored with it, and shown by the plan line
and `headsearch report`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from headsearch.errors import ConfigError
from headsearch.search.cost_sampler import COST_AWARE
from headsearch.search.record import arch_summary

if TYPE_CHECKING:
    from headsearch.machine.fairtime import Seat
    from headsearch.search.architectures import SpaceArchitectures
    from headsearch.search.backends import DataCache

COST_ATTR = "cost:"  # a study's user attribute per architecture: cost:<alone_key> -> ArchCost.stored()
# A space of at most this many architectures is measured whole before the first trial (a few seconds each
# on a GPU once compiled; on a CPU, 35 steps of the model). Larger spaces are refused by --sampler cost.
MAX_ARCHITECTURES = 300


@dataclass(frozen=True)
class ArchCost:
    """One architecture's cost: its epoch seconds alone, under which fair-clock key, and what measuring it
    took (`seconds`: model, warm-up and steps; 0 when a trial had timed it already: `source` "trial")."""

    config_key: str
    arch: str
    alone_key: str
    epoch_seconds_alone: float
    seconds: float
    source: str = "measured"

    def stored(self) -> dict[str, Any]:
        return {"config_key": self.config_key, "arch": self.arch, "epoch_seconds_alone": self.epoch_seconds_alone,
                "seconds": self.seconds, "source": self.source}


@dataclass(frozen=True)
class CostSummary:
    """What the measurement of a study's costs came to: architectures known, measured by this call, and the
    wall seconds of every measurement stored in the study."""

    architectures: int
    measured_now: int | None  # None: not said (`headsearch report`)
    seconds: float

    def line(self) -> str:
        """The plan line's part, e.g. "costs: 39 architectures' epoch seconds alone measured before training
        (84 s)", or "(84 s; 12 now)" when only some were measured by this run."""
        now = f"; {self.measured_now} now" if self.measured_now not in (None, self.architectures) else ""
        took = f"{self.seconds:.1f}" if self.seconds < 10 else f"{self.seconds:.0f}"
        return f"costs: {self.architectures} architectures' epoch seconds alone measured before training ({took} s{now})"


def check_cost_search(archs: "SpaceArchitectures") -> None:
    """Refuse, in one line and before any study exists, a search the cost-aware sampler cannot run: it searches
    the task's quality x time over a space it can list whole (at most MAX_ARCHITECTURES architectures)."""
    search = archs.definition
    names = [o.name for o in search.objectives]
    primary = search.task.primary.name
    if sorted(names) != sorted([primary, "time"]):
        raise ConfigError(f"--sampler {COST_AWARE} searches {primary} x time (objectives: {', '.join(names)}):"
                          f" use --objectives {primary},time, or another --sampler")
    listing = archs.listing()
    if listing is None:
        raise ConfigError(f"--sampler {COST_AWARE} measures every architecture before training, and space"
                          f" {search.space.name} cannot be listed (a continuous range): use another --sampler")
    if len(listing) > MAX_ARCHITECTURES:
        raise ConfigError(f"--sampler {COST_AWARE} measures every architecture before training, and space"
                          f" {search.space.name} holds {len(listing)} (at most {MAX_ARCHITECTURES}): use another"
                          " --sampler, or a smaller space")


def stored_costs(study) -> dict[str, dict[str, Any]]:
    """The costs stored in `study`, by fair-clock key."""
    return {k[len(COST_ATTR):]: v for k, v in study.user_attrs.items() if k.startswith(COST_ATTR)}


def study_cost_summary(study) -> CostSummary | None:
    """What the study's stored costs came to (None: it measured none), as `headsearch report` shows it."""
    costs = stored_costs(study)
    if not costs:
        return None
    return CostSummary(len(costs), None, sum(float(c.get("seconds") or 0.0) for c in costs.values()))


def _architectures(archs: "SpaceArchitectures", seat: "Seat"):
    """(config key, config, the step mode its trial intends, fair-clock key in that mode) of each architecture of
    the space, as its trial would train it on `seat`."""
    from optuna.trial import FixedTrial

    for key, params in (archs.listing() or {}).items():
        cfg = archs.sample_config(FixedTrial(params), seat.device)
        intended = seat.step_mode(cfg, archs.definition.task)
        yield key, cfg, intended, seat.alone_key(cfg, intended)


def measure_costs(archs: "SpaceArchitectures", seat: "Seat", data: "DataCache", study,
                  on_cost: Callable[[int, int, ArchCost], None] | None = None) -> CostSummary:
    """Every architecture's epoch seconds alone on the worker's `seat`, stored in `study` one by one: those it
    holds already are skipped, those a trial timed alone are copied, the rest measured (`measure_alone`).
    `on_cost(done, total, cost)` hears each one stored now."""
    from headsearch.training.clock import measure_alone

    stored, device = stored_costs(study), seat.device
    listed = list(_architectures(archs, seat))
    measured = 0
    for done, (key, cfg, intended, alone) in enumerate(listed, 1):
        if alone in stored:
            continue
        start = time.perf_counter()
        clock = seat.clock(study, cfg, intended)
        if clock.known is not None:  # a trial timed this architecture alone already
            cost = ArchCost(key, arch_summary(cfg), alone, clock.known, 0.0, source="trial")
        else:
            seconds = measure_alone(archs.definition.task, data.bound_for(cfg, device), device, clock)
            cost = ArchCost(key, arch_summary(cfg), alone, seconds, time.perf_counter() - start)
            measured += 1
        study.set_user_attr(COST_ATTR + alone, cost.stored())
        stored[alone] = cost.stored()
        if on_cost is not None:
            on_cost(done, len(listed), cost)
    return CostSummary(len(listed), measured, sum(float(stored[alone]["seconds"]) for *_, alone in listed))


def cost_seconds(archs: "SpaceArchitectures", seat: "Seat", study) -> dict[str, float]:
    """Each architecture's stored epoch seconds alone on `seat`, by config key (what `cost_sampler.candidates`
    takes); a RuntimeError names the first one missing."""
    stored = stored_costs(study)
    out = {}
    for key, cfg, _, alone in _architectures(archs, seat):
        if alone not in stored:
            raise RuntimeError(f"the cost of {arch_summary(cfg)} is not in study {study.study_name}: measure_costs first")
        out[key] = float(stored[alone]["epoch_seconds_alone"])
    return out
