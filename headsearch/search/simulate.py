"""Whole searches replayed against a table (headsearch.search.table) in a fraction of a second each.

In the spirit of Syne Tune's simulator (Salinas et al. 2022, "Syne Tune: A Library for Large Scale
Hyperparameter Tuning and Reproducible Research"): the scheduler cannot tell a real trial from one looked
up in a table. `simulate` builds the same `Search` as `headsearch run` and drives its own loop
(`Search.run`, the one loop of `headsearch.search.loop`: asking, sampling, skipping duplicates, ending an exhausted space, the pruner's
decision after every epoch, telling) over `TableCohort`, which instead of training reads each epoch's
validation value from the table and advances a simulated clock by the architecture's epoch seconds. With
``workers`` slots, trials start and end out of order as they would on that many workers; a trial asked at
simulated time t sees exactly the results that had arrived by t. Each trial takes one of its
architecture's seeds from the table at random (seeded), so the noise between seeds is part of a replay.

With the cost-aware sampler the clock starts at what measuring every architecture's cost takes
(`measuring_seconds`), as a real search measures them before its first trial.

`score` measures the answer: the hypervolume of the reported front (its architectures placed at their true
points, the means over the table's seeds) relative to the true front's, front recall, and epochs spent.
"""
from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

import optuna
from optuna.trial import FixedTrial

from headsearch.config import RunConfig
from headsearch.search.cost_sampler import COST_AWARE, candidates
from headsearch.errors import ConfigError
from headsearch.search.hypervolume import front_indices, hypervolume, minimised, scale_minimised
from headsearch.search.objectives import MINIMIZE, Objective
from headsearch.search.snapshot import count_states
from headsearch.search.table import arch_key, overrides_of
from headsearch.training.records import EpochRecord, PauseRun, TrainResult

REFERENCE = 1.1  # every objective scaled to [0, 1]: the reference point lies 10% beyond the worst
SIMULATED_STORAGE = "memory:"  # no URL: the simulator hands `Search.run` an in-memory study itself


@dataclass
class _Slot:
    tag: Any
    cfg: RunConfig
    row: dict[str, Any]
    run: dict[str, Any]
    callbacks: list
    epoch: int = 0
    run_dir: Any = None


@dataclass
class TableEnd:
    """A trial that ended: as `headsearch.training.cohort.Cohort.train_epoch` hands them back."""

    slot: int
    tag: Any
    result: TrainResult | None
    error: BaseException | None


def table_row(table: dict[str, Any], rows: dict[str, Any], cfg: RunConfig) -> dict[str, Any]:
    """`cfg`'s architecture in `table` (`rows`: its architectures by `arch_key`), or a ConfigError that says why not."""
    key = arch_key(overrides_of(cfg.to_dict(), table["base_config"]))
    if key not in rows:
        raise ConfigError(f"the search sampled an architecture the table does not hold ({key}): build the table"
                          " for this space, task and preset with `headsearch table`")
    return rows[key]


def run_result(table: dict[str, Any], arch: dict[str, Any], run: dict[str, Any]) -> TrainResult:
    """One of `arch`'s runs in `table` (a row and one of its seeds) as the `TrainResult` its training would give:
    the best epoch the earliest of the best values, times from the run's epoch seconds."""
    curve, seconds = run["curve"], run["epoch_seconds"]
    maximize = table["direction"] == "maximize"
    best = max(range(len(curve)), key=lambda i: (curve[i] if maximize else -curve[i], -i)) + 1
    metric = table["primary_metric"]
    return TrainResult(status="completed", primary_metric=metric, params=arch["params"], epochs_run=len(curve),
                       best_epoch=best, best_value=curve[best - 1], best_train_seconds=best * seconds,
                       epoch_seconds_alone=seconds, best_seconds_alone=best * seconds,
                       train_seconds=len(curve) * seconds, best_metrics={metric: curve[best - 1]},
                       test_metrics=dict(run.get("test") or {}))


class TableCohort:
    """`workers` slots that look their trials' epochs up in a table: a backend of `Search.run` (headsearch.search.backends).

    `train_epoch` moves the simulated clock to the next epoch that ends on any slot, gives that trial its
    epoch record (the table's validation value, the architecture's epoch seconds and parameter count)
    through the trial's callbacks (the search's pruner among them), and hands it back if it ended."""

    needs_data = False
    resumes = True  # a paused trial's run goes on from its epoch, with the seed it drew (`kept`)

    def __init__(self, table: dict[str, Any], workers: int, rng: random.Random):
        self.table, self.size, self.rng = table, workers, rng
        self.rows = {arch_key(a["overrides"]): a for a in table["architectures"]}
        self.slots: dict[int, _Slot] = {}
        self.events: list[tuple[float, int, int]] = []  # (time, order, slot)
        self.now, self._order = 0.0, 0
        self.epochs_trained = 0
        self.kept: dict[Any, tuple[dict[str, Any], int]] = {}  # a paused trial's (run, epoch), by its run directory
        self.completed: list[tuple[float, Any]] = []  # (simulated seconds, tag) of each trial trained to its end

    @property
    def free(self) -> bool:
        return len(self.slots) < self.size

    @property
    def occupied(self) -> bool:
        return bool(self.slots)

    def refusal(self, cfg: RunConfig) -> str | None:
        return None

    def row_of(self, cfg: RunConfig) -> dict[str, Any]:
        return table_row(self.table, self.rows, cfg)

    def add(self, cfg: RunConfig, bound, run_dir, *, argv=None, clock=None, tag=None, callbacks=(),
            resume: bool = False) -> int:
        slot = min(set(range(self.size)) - set(self.slots))
        row = self.row_of(cfg)
        run, epoch = self.kept.pop(run_dir) if resume else (self.rng.choice(row["runs"]), 0)
        self.slots[slot] = _Slot(tag, cfg, row, run, list(callbacks), epoch, run_dir)
        self._schedule(slot)
        return slot

    def _schedule(self, slot: int) -> None:
        self._order += 1
        heapq.heappush(self.events, (self.now + self.slots[slot].run["epoch_seconds"], self._order, slot))

    def train_epoch(self) -> list[TableEnd]:
        self.now, _, slot = heapq.heappop(self.events)
        s = self.slots[slot]
        s.epoch += 1
        self.epochs_trained += 1
        seconds, metric = s.run["epoch_seconds"], self.table["primary_metric"]
        record = EpochRecord(s.epoch, 0, math.nan, 0.0, s.epoch * seconds, s.epoch * seconds, 0.0,
                             {metric: s.run["curve"][s.epoch - 1]}, epoch_seconds_alone=seconds, params=s.row["params"])
        try:
            for cb in s.callbacks:
                cb.on_epoch_end(record)
        except optuna.TrialPruned as e:
            del self.slots[slot]
            if isinstance(e, PauseRun):  # its run goes on from this epoch if it is resumed
                self.kept[s.run_dir] = (s.run, s.epoch)
                e.kept = f"table:{s.run_dir}"
            return [TableEnd(slot, s.tag, None, e)]
        if s.epoch < len(s.run["curve"]):
            self._schedule(slot)
            return []
        del self.slots[slot]
        self.completed.append((self.now, s.tag))
        return [TableEnd(slot, s.tag, run_result(self.table, s.row, s.run), None)]

    def interrupt(self) -> list[TableEnd]:
        ends = [TableEnd(i, s.tag, TrainResult(status="interrupted", primary_metric="", params=0), None)
                for i, s in self.slots.items()]
        self.slots.clear()
        return ends


# -- one replay ---------------------------------------------------------------------------------

@dataclass
class Replay:
    """One simulated search: what it trained, what it reported, and how that compares with the truth."""

    seed: int
    trained: int  # trials trained (complete or pruned)
    duplicates: int  # proposals of held architectures, skipped
    epochs: int  # epochs trained in all
    seconds: float  # simulated wall-clock seconds until the last trial ended (the cost measurement's first, if any)
    front: list[str]  # the reported front's architectures (table keys)
    hypervolume: float  # of the reported front at its architectures' true points, over the true front's
    recall: float  # the share of the true front's architectures the reported front holds
    trials: list[dict[str, Any]] = field(default_factory=list)  # number, arch, state, epochs, values (for tests)
    # (simulated seconds, hypervolume of the front reported then) at each trial's end: the anytime hypervolume
    anytime: list[tuple[float, float]] = field(default_factory=list)

    def time_to(self, fraction: float) -> float:
        """Simulated seconds until the reported front's hypervolume first reached `fraction` of the true front's
        (inf: never)."""
        return next((seconds for seconds, hv in self.anytime if hv >= fraction), math.inf)


def simulation_search(table: dict[str, Any], *, space: str, trials: int, sampler: str | None = None,
                      pruner: str | None = None, seed: int = 0, objectives: Sequence[str] | None = None,
                      sets: dict[str, dict[str, Any]] | None = None, **pruning: Any):
    """The `Search` that `headsearch run` would build for the table's task, preset and epochs, on the CPU
    (with the `--set` overrides the table's runs were trained with, `sets` or the table's own). `pruning`:
    any of the settings' pruning fields (`PRUNING_FIELDS`: pruner_min_epochs=2, pruner_percentile=10, ...)."""
    from headsearch.search.runner import Search, SearchSettings
    from headsearch.search.settings import PRUNING_FIELDS

    if unknown := sorted(set(pruning) - set(PRUNING_FIELDS)):
        raise TypeError(f"simulation_search: {', '.join(unknown)} is not a pruning setting ({', '.join(PRUNING_FIELDS)})")
    settings = SearchSettings(task=table["task"], space=space, trials=trials, sampler=sampler, pruner=pruner, seed=seed,
                              objectives=tuple(objectives) if objectives else None, preset=table.get("preset"),
                              epochs=table["epochs"], storage=SIMULATED_STORAGE, device="cpu", heartbeat=0,
                              sets=sets if sets is not None else (table.get("sets") or None), **pruning)
    held, in_space = len(table["architectures"]), table.get("architectures_in_space")
    if in_space is not None and held < in_space:
        raise ConfigError(f"the table holds {held} of the space's {in_space} architectures (a sample, or a build not"
                          " finished): a replayed search may sample any of them; build it without --sample, to the end")
    search = Search(settings)
    if search.sampler_name() == COST_AWARE:  # every architecture's epoch seconds known before training: the table's
        search.use_cost_candidates(table_candidates(search, table))
    for o in search.objectives:
        if o.convergence is None and o.name != table["primary_metric"]:
            raise ConfigError(f"objective {o.name}: a table records the curve of {table['primary_metric']} only;"
                              f" simulate with {table['primary_metric']}, time, epochs or params")
    return search


def table_candidates(search, table: dict[str, Any]) -> list:
    """The space's architectures with the table's epoch seconds (the mean over its seeds) as their measured cost."""
    import torch

    rows = {arch_key(a["overrides"]): a for a in table["architectures"]}
    seconds = {}
    for key, params in (search.archs.listing() or {}).items():
        row = table_row(table, rows, search.archs.sample_config(FixedTrial(params), torch.device("cpu")))
        seconds[key] = statistics.fmean(r["epoch_seconds"] for r in row["runs"])
    return candidates(search.archs, seconds)


def measuring_seconds(table: dict[str, Any]) -> float:
    """What measuring every architecture's cost before training takes (`headsearch.search.costs`) at the table's
    epoch seconds: `measure_alone`'s ALONE_SETTLE + min(ALONE_STEPS, steps per epoch) steps of each, steps per
    epoch from the runs' train_limit and batch size. Its warm-up is not counted: a table does not record it."""
    from headsearch.training.clock import ALONE_SETTLE, ALONE_STEPS

    train, data = table["base_config"]["train"], table["base_config"]["data"]
    if not data.get("train_limit"):
        raise ConfigError("the table's runs name no data.train_limit: the cost measurement's share of an epoch is"
                          " unknown; build the table with --set data.train_limit=N")
    steps = math.ceil(data["train_limit"] / train["batch_size"])
    if train.get("max_steps_per_epoch"):
        steps = min(steps, train["max_steps_per_epoch"])
    timed = ALONE_SETTLE + min(ALONE_STEPS, steps)
    return sum(statistics.fmean(r["epoch_seconds"] for r in a["runs"]) * timed / steps for a in table["architectures"])


def replay(search, table: dict[str, Any], *, workers: int = 1, truth=None) -> Replay:
    """Run `search` (from `simulation_search`) against `table` with `workers` slots; score its front."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    seed = search.settings.seed
    storage = optuna.storages.InMemoryStorage()
    # The search's own Optuna pruner (one objective: `--pruner` decides there through should_prune; several: None).
    study = optuna.create_study(storage=storage, directions=search.directions, sampler=search.make_sampler(0),
                                pruner=search.make_pruner()[0])
    search.adopt(study, storage)
    cohort = TableCohort(table, workers, random.Random(seed))
    if search.sampler_name() == COST_AWARE:  # the costs are measured before the first trial starts
        cohort.now = measuring_seconds(table)
    search.run(study, cohort)
    trials = study.get_trials(deepcopy=False)
    counts = count_states(trials)
    front = study.best_trials if len(search.objectives) > 1 else [study.best_trial]
    front_keys = list(dict.fromkeys(arch_key(overrides_of(t.user_attrs["config"], table["base_config"]))
                                    for t in front))
    truth = truth or true_points(table, [o.name for o in search.objectives], search.directions)
    hv, recall = score(front_keys, truth)
    rows = [{"number": t.number, "arch": t.user_attrs.get("arch"), "state": t.state.name, "epochs": len(t.intermediate_values),
             "values": t.values, "duplicate_of": t.user_attrs.get("duplicate_of"), "pruned": t.user_attrs.get("pruned"),
             **({"resumes": t.user_attrs["resumes"]} if "resumes" in t.user_attrs else {})}
            for t in trials]
    return Replay(seed=seed, trained=counts["complete"] + counts["pruned"], duplicates=counts["duplicate"],
                  epochs=cohort.epochs_trained, seconds=cohort.now / 1.0, front=front_keys, hypervolume=hv,
                  recall=recall, trials=rows, anytime=anytime_hypervolume(study, cohort.completed, table, truth,
                                                                          search.directions))


def anytime_hypervolume(study, completed: Sequence[tuple[float, Any]], table: dict[str, Any], truth: "Truth",
                        directions: Sequence[str]) -> list[tuple[float, float]]:
    """After each trial's end (`completed`: simulated seconds and its `TrialRun`), the hypervolume of the front the
    study would report then (its complete trials so far, by their recorded values) at its architectures' true points,
    over the true front's: the search's answer had it stopped there."""
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    done: list[Any] = []
    out = []
    for seconds, tag in sorted(completed, key=lambda c: c[0]):
        trial = by_number[tag.trial.number]
        if trial.state.name != "COMPLETE":  # ended as it was told (a duplicate's twin, a late failure)
            continue
        done.append(trial)
        points = [minimised(t.values, directions) for t in done]
        keys = list(dict.fromkeys(arch_key(overrides_of(done[i].user_attrs["config"], table["base_config"]))
                                  for i in front_indices(points)))
        out.append((seconds, score(keys, truth)[0]))
    return out


# -- the truth ------------------------------------------------------------------------------------

@dataclass
class Truth:
    """Every architecture's true point (the mean over the table's seeds, every objective minimised and
    scaled to [0, 1] over the table), the reference point, and the true front with its hypervolume."""

    points: dict[str, list[float]]
    reference: list[float]
    front: list[str]
    hypervolume: float


def arch_values(arch: dict[str, Any], names: Sequence[str], table: dict[str, Any]) -> list[float]:
    """An architecture's objective values, the mean over its seeds of what a search would record."""
    # Each run's TrainResult read as the search reads a trial's objectives (the direction plays no part in a value).
    per_run = [[Objective(n, MINIMIZE).value(run_result(table, arch, r)) for n in names] for r in arch["runs"]]
    return [statistics.fmean(col) for col in zip(*per_run)]


def true_points(table: dict[str, Any], names: Sequence[str], directions: Sequence[str]) -> Truth:
    """The table's truth for objectives `names`: 10% beyond the worst architecture is the reference point."""
    keys = [arch_key(a["overrides"]) for a in table["architectures"]]
    scaled = scale_minimised([arch_values(a, names, table) for a in table["architectures"]], directions)
    points = dict(zip(keys, scaled))
    reference = [REFERENCE] * len(names)
    front = [keys[i] for i in front_indices(scaled)]
    return Truth(points, reference, front, hypervolume([points[k] for k in front], reference))


def score(front_keys: Sequence[str], truth: Truth) -> tuple[float, float]:
    """(hypervolume of the reported front's architectures at their true points / the true front's, recall)."""
    found = [truth.points[k] for k in front_keys]
    hv = hypervolume(found, truth.reference) / truth.hypervolume if truth.hypervolume > 0 else 1.0
    recall = len(set(front_keys) & set(truth.front)) / len(truth.front)
    return hv, recall
