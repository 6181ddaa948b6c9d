"""Peers: another library's multi-fidelity search replayed on a headsearch table, scored as headsearch scores its own.

MOASHA (Schmucker et al. 2021, "Multi-objective Asynchronous Successive Halving", arXiv 2106.12639) as Syne Tune
ships it (`syne_tune.optimizer.schedulers.multiobjective.MOASHA`), run by Syne Tune's own `Tuner` on its own
simulated backend (`UserBlackboxBackend` over a `BlackboxTabular`, with its `SimulatorCallback`), against the
same table as `headsearch.search.simulate.replay`: per epoch, the drawn seed's validation value of the primary
metric and the cumulative seconds (epoch x the run's epoch seconds alone), one of the architecture's seeds drawn
at random per trial. The answer is scored with headsearch's own `score` and `Truth`.

What differs from headsearch's replays (see `replay_moasha`): Syne Tune samples configurations with replacement
(a repeat is trained again and counted as a trial; `PeerReplay.repeats`), its simulator advances its clock in
ticks and adds small start/report delays, and MOASHA ranks raw objective values (its epsilon-net tie-break is
not scale-free). And Syne Tune 0.16's rungs judge a new trial by the wrong entry of their non-dominated sort
(`RankedPriority` says how); `--ranked` replays MOASHA with that one thing put right.

    python benchmarks/peers.py --table benchmarks/tables/vit-cifar10-deep-head-tiny16.json --seeds 20 --workers 8
    python benchmarks/peers.py --table benchmarks/tables/vit-cifar10-deep-head-tiny16.json --rungs 3x3
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import math
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Sequence

from common import quantile  # benchmarks/ is on the path (a script's own folder, or the tests'); it adds the checkout
from headsearch.search.hypervolume import front_indices
from headsearch.search.simulate import Replay, Truth, score, true_points
from headsearch.search.table import arch_key

MISSING = "MOASHA needs Syne Tune: make peers (pip install --no-deps syne-tune==0.16.0 scikit-learn psutil)"
ARCH = "arch"  # the one hyperparameter: an architecture of the table, by its key
EPOCH = "epoch"  # the fidelity MOASHA's rungs count (its time_attr)
LOSS = "loss"  # the primary metric as MOASHA minimises it (negated when the table maximises it)
ELAPSED = "elapsed_seconds"  # seconds since the trial started: epochs x its run's epoch seconds alone
# The simulator's clock step while every worker is busy. Syne Tune's default is 5 s, longer than most of these
# tables' epochs (2-25 s): a freed worker would idle up to 5 s per trial. 0.05 s is its own default event delay.
TICK = 0.05
VALUES = ("final", "best")  # what a completed trial reports: its last epoch, or headsearch's best epoch


@dataclass
class PeerReplay(Replay):
    """A `Replay` of a peer's search. `duplicates` stays 0 (nothing is skipped untrained); `repeats` counts the
    trials of an architecture an earlier trial of the same replay had drawn: sampled with replacement, trained
    again, and counted in `trained` and the budget."""

    repeats: int = 0


@dataclass
class TrialCurve:
    """What one trial reported, epoch by epoch, as Syne Tune's tuner saw it."""

    trial_id: int
    key: str  # the table's arch_key
    losses: list[float]
    elapsed: list[float]  # cumulative seconds of the trial's own run
    arrivals: list[float]  # simulated tuner seconds at which each result arrived


# -- Syne Tune, imported lazily -------------------------------------------------------------------

@functools.cache
def syne_tune() -> SimpleNamespace:
    """The Syne Tune classes a replay uses, with the two small subclasses it needs; one clear error without it."""
    try:
        from syne_tune import StoppingCriterion, Tuner
        from syne_tune.backend.simulator_backend.simulator_callback import SimulatorCallback
        from syne_tune.blackbox_repository import UserBlackboxBackend
        from syne_tune.blackbox_repository.blackbox_tabular import BlackboxTabular
        from syne_tune.config_space import choice, randint
        from syne_tune.optimizer.schedulers.multiobjective.moasha import MOASHA
        from syne_tune.optimizer.schedulers.multiobjective.multiobjective_priority import NonDominatedPriority
    except ImportError:
        raise ImportError(MISSING) from None

    class KeyedTabular(BlackboxTabular):
        """A `BlackboxTabular` that finds a configuration's row through a dict. Its own lookup indexes a pandas
        frame by a tuple of hyperparameter values, which pandas 3 refuses for a single hyperparameter; a row
        index is the lookup Syne Tune itself accepts (`_objective_function` with an int)."""

        def __init__(self, keys: Sequence[str], **kwargs):
            super().__init__(**kwargs)
            self.row_of = {k: i for i, k in enumerate(keys)}

        def _objective_function(self, configuration, fidelity=None, seed=None):
            if isinstance(configuration, dict):
                configuration = self.row_of[configuration[ARCH]]
            return super()._objective_function(configuration, fidelity, seed)

    class TableBackend(UserBlackboxBackend):
        """Syne Tune's simulated backend without the real seconds spent outside it: the simulator adds the
        tuner's and scheduler's own computing time to its clock, which makes a replay depend on the machine
        (headsearch's replays charge no sampler time either)."""

        def _advance_by_outside_time(self):
            pass

    class RankedPriority(NonDominatedPriority):
        """MOASHA's non-dominated sort read as each trial's place. `NonDominatedPriority` returns the trials' indices
        best first, but a rung (`asha.Bracket.on_result`) reads the result as per-trial priorities and judges its
        new trial by the last entry: the index of the worst trial, not the new trial's place. So in 0.16 a trial
        that dominates every other can be stopped. Handing the rung each trial's place applies Syne Tune's own rule
        (go on if in the top 1/reduction_factor) to the trial it judges, as the paper means it."""

        def priority_unsafe(self, objectives):
            import numpy as np

            order = np.asarray(super().priority_unsafe(objectives))
            places = np.empty(len(order), dtype=int)
            places[order] = np.arange(len(order))
            return places

    def budgeted(limit: int, **kwargs) -> MOASHA:
        """MOASHA that suggests `limit` trials in all, then none: Syne Tune's tuner reads no suggestion as an
        exhausted space and waits for the running trials to end (its stopping criterion would cut them off)."""

        class BudgetedMOASHA(MOASHA):
            suggested = 0

            def suggest(self):
                if self.suggested >= limit:
                    return None
                self.suggested += 1
                return super().suggest()

        return BudgetedMOASHA(**kwargs)

    return SimpleNamespace(StoppingCriterion=StoppingCriterion, Tuner=Tuner, SimulatorCallback=SimulatorCallback,
                           KeyedTabular=KeyedTabular, TableBackend=TableBackend, RankedPriority=RankedPriority,
                           budgeted=budgeted,
                           choice=choice, randint=randint)


# -- the table as a Syne Tune blackbox ------------------------------------------------------------

def table_keys(table: dict[str, Any]) -> list[str]:
    return [arch_key(a["overrides"]) for a in table["architectures"]]


def seeds_per_architecture(table: dict[str, Any]) -> int:
    """A `BlackboxTabular` holds the same seeds for every configuration; a table may not (a build cut short)."""
    counts = {len(a["runs"]) for a in table["architectures"]}
    if len(counts) != 1:
        raise ValueError(f"the table's architectures hold {sorted(counts)} seeds: a Syne Tune blackbox needs the same"
                         " number for all; finish the table's build")
    return counts.pop()


def evaluations(table: dict[str, Any]):
    """(architectures, seeds, epochs, [loss, elapsed seconds]): what `TableCohort` reads, epoch by epoch."""
    import numpy as np

    sign = -1.0 if table["direction"] == "maximize" else 1.0
    out = np.empty((len(table["architectures"]), seeds_per_architecture(table), table["epochs"], 2))
    for i, arch in enumerate(table["architectures"]):
        for s, run in enumerate(arch["runs"]):
            for e, value in enumerate(run["curve"]):
                out[i, s, e] = (sign * value, (e + 1) * run["epoch_seconds"])
    return out


def config_space(st: SimpleNamespace, keys: Sequence[str]) -> dict[str, Any]:
    return {ARCH: st.choice(list(keys))}


def blackbox(st: SimpleNamespace, table: dict[str, Any], keys: Sequence[str]):
    import pandas as pd

    return st.KeyedTabular(keys, hyperparameters=pd.DataFrame({ARCH: list(keys)}),
                           configuration_space=config_space(st, keys),
                           fidelity_space={EPOCH: st.randint(1, table["epochs"])},
                           objectives_evaluations=evaluations(table), objectives_names=[LOSS, ELAPSED])


# -- one replay -------------------------------------------------------------------------------------

def replay_moasha(table: dict[str, Any], *, trials: int, workers: int, seed: int, truth: Truth | None = None,
                  rungs: tuple[int, int] | None = None, values: str = "final", tick: float = TICK,
                  ranked: bool = False) -> PeerReplay:
    """MOASHA (Schmucker et al. 2021) replayed on `table` by Syne Tune's simulator with `workers` workers; scored as
    `headsearch.search.simulate.replay` scores a search.

    Budget: exactly `trials` trials started (each draws an architecture uniformly, with replacement, and one of its
    seeds), every one run until MOASHA stops it or it reaches the table's epochs. `rungs` = (first rung, reduction
    factor) for MOASHA's grace_period and reduction_factor; None: as shipped (1 and 3). The reported front: the
    non-dominated trials that reached the last epoch, by `values` ("final": their last epoch's value and seconds;
    "best": headsearch's reading, the best epoch's value and the seconds to it), their architectures scored at
    their true points. `tick`: the simulator's clock step while every worker is busy. `ranked`: rungs judge a trial
    by its own place in the non-dominated sort (`RankedPriority`), not as 0.16 ships it."""
    if values not in VALUES:
        raise ValueError(f"values={values!r}: one of {', '.join(VALUES)}")
    curves = moasha_curves(table, trials=trials, workers=workers, seed=seed, rungs=rungs, tick=tick, ranked=ranked)
    truth = truth or true_points(table, [table["primary_metric"], "time"], [table["direction"], "minimize"])
    return scored(table, curves, truth, seed=seed, values=values)


def moasha_curves(table: dict[str, Any], *, trials: int, workers: int, seed: int, rungs: tuple[int, int] | None,
                  tick: float = TICK, ranked: bool = False) -> list[TrialCurve]:
    """Run Syne Tune's tuner with MOASHA on the table's blackbox; every trial's reported curve."""
    st = syne_tune()
    keys = table_keys(table)
    grace, factor = rungs or (1, 3)  # MOASHA's own defaults
    scheduler = st.budgeted(trials, config_space=config_space(st, keys), metrics=[LOSS, ELAPSED], do_minimize=True,
                            time_attr=EPOCH, max_t=table["epochs"], grace_period=min(grace, table["epochs"]),
                            reduction_factor=factor, random_seed=seed,
                            multiobjective_priority=st.RankedPriority() if ranked else None)  # None: its default
    backend = st.TableBackend(blackbox=blackbox(st, table, keys), elapsed_time_attr=ELAPSED, tuner_sleep_time=tick)
    callback = st.SimulatorCallback()
    # MOASHA samples configurations and the backend draws each trial's seed from NumPy's global generator.
    with seeded_numpy(seed), quiet_results_folder():
        tuner = st.Tuner(trial_backend=backend, scheduler=scheduler, n_workers=workers, sleep_time=0,
                         stop_criterion=st.StoppingCriterion(max_num_trials_started=trials), callbacks=[callback],
                         save_tuner=False, tuner_name="headsearch-peer-moasha")
        tuner.run()
        frame = callback.dataframe()
    return curves_of(frame)


@contextlib.contextmanager
def seeded_numpy(seed: int) -> Iterator[None]:
    """NumPy's global generator seeded for the block and put back after it, so a replay neither depends on nor
    disturbs what ran before."""
    import numpy as np

    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


@contextlib.contextmanager
def quiet_results_folder() -> Iterator[None]:
    """The tuner writes its metadata and results under SYNETUNE_FOLDER (else ~/syne-tune) and prints every trial:
    a temporary folder for the block, and its prints swallowed."""
    before = os.environ.get("SYNETUNE_FOLDER")
    with tempfile.TemporaryDirectory(prefix="headsearch-syne-tune-") as folder:
        os.environ["SYNETUNE_FOLDER"] = folder
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                yield
        finally:
            if before is None:
                os.environ.pop("SYNETUNE_FOLDER", None)
            else:
                os.environ["SYNETUNE_FOLDER"] = before


def curves_of(frame) -> list[TrialCurve]:
    """The tuner's results (one row per reported epoch) gathered by trial, in trial order."""
    from syne_tune.constants import ST_TUNER_TIME

    by_trial: dict[int, TrialCurve] = {}
    for row in frame.sort_values(["trial_id", EPOCH]).to_dict("records"):
        tid = int(row["trial_id"])
        curve = by_trial.setdefault(tid, TrialCurve(tid, row[f"config_{ARCH}"], [], [], []))
        curve.losses.append(float(row[LOSS]))
        curve.elapsed.append(float(row[ELAPSED]))
        curve.arrivals.append(float(row[ST_TUNER_TIME]))
    return [by_trial[t] for t in sorted(by_trial)]


# -- scoring, with headsearch's own functions ----------------------------------------------------

def reported_point(curve: TrialCurve, values: str) -> list[float]:
    """A completed trial's (loss, seconds), both minimised: its last epoch, or its best epoch (the earliest of the
    best) and the seconds to it, as headsearch's `run_result` reads a run."""
    if values == "final":
        return [curve.losses[-1], curve.elapsed[-1]]
    best = min(range(len(curve.losses)), key=lambda i: (curve.losses[i], i))
    return [curve.losses[best], curve.elapsed[best]]


def front_keys(done: Sequence[TrialCurve], values: str) -> list[str]:
    points = [reported_point(c, values) for c in done]
    return list(dict.fromkeys(done[i].key for i in front_indices(points)))


def scored(table: dict[str, Any], curves: Sequence[TrialCurve], truth: Truth, *, seed: int, values: str) -> PeerReplay:
    """The replay's answer and cost: its front scored by `score`, the anytime hypervolume after each completion."""
    max_t = table["epochs"]
    completed = sorted((c for c in curves if len(c.losses) >= max_t), key=lambda c: c.arrivals[-1])
    anytime = [(c.arrivals[-1], score(front_keys(completed[:n], values), truth)[0]) for n, c in enumerate(completed, 1)]
    front = front_keys(completed, values)
    hv, recall = score(front, truth)
    names = {arch_key(a["overrides"]): a["arch"] for a in table["architectures"]}
    rows = [{"number": c.trial_id, "arch": names[c.key], "key": c.key, "epochs": len(c.losses),
             "state": "COMPLETE" if len(c.losses) >= max_t else "PRUNED",
             "values": reported_point(c, values) if len(c.losses) >= max_t else None} for c in curves]
    return PeerReplay(seed=seed, trained=len(curves), duplicates=0, epochs=sum(len(c.losses) for c in curves),
                      seconds=max((c.arrivals[-1] for c in curves), default=0.0), front=front, hypervolume=hv,
                      recall=recall, trials=rows, anytime=anytime, repeats=len(curves) - len({c.key for c in curves}))


# -- a quick check from the command line -----------------------------------------------------------

def parse_rungs(text: str | None) -> tuple[int, int] | None:
    """"3x3" -> (3, 3): first rung at epoch 3, reduction factor 3; None or "default": MOASHA's own."""
    if text in (None, "", "default"):
        return None
    first, _, factor = text.partition("x")
    return int(first), int(factor)


def seconds_text(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:.0f} s"


def summary(runs: Sequence[PeerReplay]) -> list[str]:
    """The figures of a search_quality.py row, over the replays."""
    hv, to90 = [r.hypervolume for r in runs], [r.time_to(0.90) for r in runs]
    mean = lambda attr: statistics.fmean(attr(r) for r in runs)  # noqa: E731
    return [f"hypervolume median {statistics.median(hv):.3f}, 10th pct {quantile(hv, 0.1):.3f};"
            f" front recall median {statistics.median(r.recall for r in runs):.2f}",
            f"epochs mean {mean(lambda r: r.epochs):.1f}; simulated seconds mean {mean(lambda r: r.seconds):.0f};"
            f" repeats mean {mean(lambda r: r.repeats):.1f}; front size mean {mean(lambda r: len(r.front)):.1f}",
            f"to 0.85 median {seconds_text(statistics.median(r.time_to(0.85) for r in runs))};"
            f" to 0.90 median {seconds_text(statistics.median(to90))}, 90th pct {seconds_text(quantile(to90, 0.9))}"]


def main(argv: Sequence[str] | None = None) -> int:
    from headsearch.errors import ConfigError
    from headsearch.search.table import load_table

    p = argparse.ArgumentParser(description="MOASHA (Syne Tune) replayed on a headsearch table")
    p.add_argument("--table", type=Path, required=True, help="a table written by `headsearch table`")
    p.add_argument("--seeds", type=int, default=5, help="replays (seeds 0..N-1)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--trials", type=int, default=None, help="trials started (default: the table's architectures)")
    p.add_argument("--rungs", default=None, help="FIRSTxFACTOR, e.g. 3x3 (default: MOASHA's own, 1x3)")
    p.add_argument("--values", choices=VALUES, default="final", help="what a completed trial reports for the front")
    p.add_argument("--ranked", action="store_true", help="rungs judge a trial by its own place (RankedPriority)")
    p.add_argument("--tick", type=float, default=TICK, help="the simulator's clock step while all workers are busy")
    args = p.parse_args(argv)
    try:
        table = load_table(args.table)
        trials = args.trials or len(table["architectures"])
        truth = true_points(table, [table["primary_metric"], "time"], [table["direction"], "minimize"])
        runs = [replay_moasha(table, trials=trials, workers=args.workers, seed=s, truth=truth,
                              rungs=parse_rungs(args.rungs), values=args.values, tick=args.tick, ranked=args.ranked)
                for s in range(args.seeds)]
    except (ImportError, ConfigError, ValueError) as e:  # one line, not a traceback
        print(e, file=sys.stderr)
        return 2
    print(f"MOASHA (Syne Tune) on {args.table.name}: {trials} trials, {args.workers} workers,"
          f" rungs {args.rungs or 'default (1x3)'}{' ranked' if args.ranked else ''}, front by {args.values} values,"
          f" {args.seeds} replays")
    print("\n".join(summary(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
