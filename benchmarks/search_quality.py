"""How close a search's reported front comes to the true one: replayed searches against a table.

Each row replays the search `headsearch run` would make (its sampler, duplicate skipping, pruner and budget;
headsearch.search.simulate) over many seeds against a table built by `headsearch table`, and reports the
median hypervolume of the reported front (its architectures at their true points) over the true front's,
the median front recall, the epochs trained relative to no pruning in the same run, and the time to quality:
simulated seconds until the anytime hypervolume (the front reported after each trial's end) first reaches
0.85 and 0.90 of the true front's (median, and the 90th percentile for 0.90; "never" if it does not).

`default` as a pruner or sampler name is what `headsearch run` uses when none is given; a pruner ending in
`+pause` replays it with --pruner-pause (a stopped trial paused, and resumed when the rule lets it go on).

    python benchmarks/search_quality.py                       # the deep-head table in benchmarks/tables/
    python benchmarks/search_quality.py --table my.json --space my-space.yaml --budgets 20,40
    python benchmarks/search_quality.py --samplers nsga2,tpe,random,gp:20 --pruners pareto --workers 1 --budgets 12,20,39
    python benchmarks/search_quality.py --samplers cost,nsga2,tpe,random,oracle --pruners pareto --workers 1 --budgets 12,20,39
    python benchmarks/search_quality.py --pruners none,pareto,pareto@2x2,pareto@2x3 --workers 1   # rungs M x R^k
    python benchmarks/search_quality.py --pruners none,pareto~0,pareto~2 --workers 1,8   # noise margins (sigmas)
    python benchmarks/search_quality.py --pruners none,default,default+pause --workers 8 --budgets 39
    python benchmarks/search_quality.py --pruners none,default --peers moasha,moasha@3x3 --workers 8 --budgets 39

`--peers moasha` adds Syne Tune's MOASHA replayed by its own simulator on the same table and scored by the same
functions (benchmarks/peers.py; `make peers` installs Syne Tune): as shipped, `@MxR` with headsearch's rungs,
`moasha-ranked` with its rungs' ranking put right. Not apples to apples: it samples architectures at random with
replacement (a repeat is trained and counted in the budget: the duplicates column counts repeats), reports a
trial's last epoch rather than its best, and its clock ticks (benchmarks/peers.py says what else).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from common import ROOT, markdown_table, parser, quantile, report

DEFAULT_TABLE = ROOT / "benchmarks" / "tables" / "vit-cifar10-deep-head-tiny.json"

def several_objective_pruners() -> list[str]:
    """The pruning rules of the registry that judge several objectives (hyperband judges one)."""
    from headsearch.search.pruning.registry import RULES

    return [name for name, rule in RULES.items() if callable(rule.several)]

ORACLE = "oracle"  # --samplers oracle: the true front's architectures first (`_front_first`)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--table", type=Path, default=DEFAULT_TABLE, help="a table written by `headsearch table`")
    p.add_argument("--space", default=None, help="the space the table lists (default: the table's own space by name)")
    p.add_argument("--seeds", type=int, default=100, help="replays per row (sampler seeds 0..N-1)")
    p.add_argument("--budgets", default=None, help="comma list of --trials (default: the space's size and 12)")
    p.add_argument("--workers", default="1,4", help="comma list of workers replayed")
    p.add_argument("--pruners", default=None,
                   help="comma list of pruners (default: every rule of the registry that judges several objectives); NAME@MxR (pareto, asha) sets the rungs: first at epoch M, then x R, the top"
                        " 1/R going on; NAME~Z (pareto) the noise margin in sigmas (pareto@2x2~1); #S the startup trials (pareto#8)")
    p.add_argument("--samplers", default=None,
                   help="comma list of samplers (nsga2, tpe, random, gp; cost: the cost-aware sampler with the table's epoch"
                        " seconds; oracle: the true front first; default: the search's default); NAME:N replays"
                        " that one with N seeds only (a slow sampler)")
    p.add_argument("--peers", default=None,
                   help="comma list of peers replayed beside: moasha (Syne Tune's MOASHA as shipped), moasha@MxR (with"
                        " rungs M x R^k), moasha-ranked[@MxR] (its rungs' ranking put right); `make peers` installs it")
    args = p.parse_args()
    if args.quick:
        args.seeds = min(args.seeds, 20)
    peers = [_peer(name) for name in args.peers.split(",")] if args.peers else []

    import torch

    from headsearch.search.simulate import replay, simulation_search, true_points
    from headsearch.search.study import default_sampler
    from headsearch.search.table import load_table, seconds_of

    table = load_table(args.table)
    space = args.space or table["space"]["name"]
    size = len(table["architectures"])
    if size < table.get("architectures_in_space", size):
        return _list_sample(table, args)
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else [size, 12]
    pruners = args.pruners.split(",") if args.pruners else several_objective_pruners()
    samplers = _samplers(args.samplers, args.seeds, default_sampler(None, 2))
    rows, notes = [], []
    t0 = time.perf_counter()
    truth = None
    for workers in [int(w) for w in args.workers.split(",")]:
        for budget in budgets:
            for sampler, seeds in samplers:
                base_epochs = base_seconds = None
                # "none" first: the other rows' epochs are compared with it (left out when not asked for)
                for pruner in (["none"] if "none" in pruners else []) + [q for q in pruners if q != "none"]:
                    hv, recall, epochs, front, duplicates, replay_seconds, simulated = [], [], [], [], [], [], []
                    to85, to90 = [], []
                    name, rungs, margin = _rungs(pruner)
                    for seed in range(seeds):
                        search = simulation_search(table, space=space, trials=budget, pruner=_named(name), seed=seed,
                                                   sampler="cost" if sampler == ORACLE else _named(sampler),
                                                   pruner_min_epochs=rungs[0], pruner_reduction_factor=rungs[1],
                                                   pruner_noise_margin=margin, pruner_startup_trials=_startup(pruner)[1],
                                                   pruner_pause=_paused(pruner))
                        truth = truth or true_points(table, [o.name for o in search.objectives], search.directions)
                        if sampler == ORACLE:
                            search.make_sampler = _front_first(search, table, truth)
                        t1 = time.perf_counter()
                        r = replay(search, table, workers=workers, truth=truth)
                        replay_seconds.append(time.perf_counter() - t1)
                        hv.append(r.hypervolume)
                        recall.append(r.recall)
                        epochs.append(r.epochs)
                        simulated.append(r.seconds)
                        front.append(len(r.front))
                        duplicates.append(r.duplicates)
                        to85.append(r.time_to(0.85))
                        to90.append(r.time_to(0.90))
                    mean_epochs, mean_seconds = statistics.fmean(epochs), statistics.fmean(simulated)
                    if pruner == "none":
                        base_epochs, base_seconds = mean_epochs, mean_seconds
                    rows.append([workers, budget, sampler, pruner, seeds, f"{statistics.median(hv):.3f}",
                                 f"{quantile(hv, 0.1):.3f}", f"{statistics.median(recall):.2f}", f"{mean_epochs:.0f}",
                                 f"{base_epochs / mean_epochs:.2f}x" if base_epochs else "-", f"{mean_seconds:.0f}",
                                 f"{base_seconds / mean_seconds:.2f}x" if base_seconds else "-", f"{statistics.fmean(front):.1f}",
                                 f"{statistics.fmean(duplicates):.1f}", _seconds(statistics.median(to85)),
                                 _seconds(statistics.median(to90)), _seconds(quantile(to90, 0.9)),
                                 f"{statistics.fmean(replay_seconds):.2f}"])
            for name, rungs, ranked in peers:
                rows.append(_peer_row(table, truth, name, rungs, ranked, workers, budget, args.seeds, base_epochs,
                                      base_seconds))
    total_seconds = time.perf_counter() - t0
    headers = ["workers", "trials", "sampler", "pruner", "replays", "hypervolume (median)", "hypervolume (10th pct)",
               "front recall (median)", "epochs (mean)", "fewer epochs than none", "simulated seconds (mean)",
               "fewer seconds than none", "front size (mean)",
               "duplicate proposals (mean)", "to 0.85 (median s)", "to 0.90 (median s)", "to 0.90 (90th pct s)",
               "seconds per replay"]
    notes += [
        f"table: {args.table.relative_to(ROOT) if args.table.is_relative_to(ROOT) else args.table} ({size} architectures,"
        f" {table['seeds']} seeds each, {table['epochs']} epochs, built on {table['device']} with torch"
        f" {table['versions'].get('torch')}, {seconds_of(table) / 60:.1f} min of training alone); space {space};"
        f" built by `{table['command']}`",
        f"true front: {len(truth.front)} architectures; objectives {table['primary_metric']} x time (the search's defaults);"
        " hypervolume of the reported front's architectures at their true points (means over seeds, scaled to [0, 1]"
        " over the table, reference 1.1) over the true front's, with Optuna's hypervolume",
        "replays per row: sampler seeds 0..N-1 (each trial draws one of its architecture's seeds from the table);"
        " duplicate proposals: proposals of an architecture a trial holds, skipped untrained (the sampler asked"
        f" again); the defaults otherwise (nsga2 population max(4, min(50, trials // 4))); {total_seconds:.0f} s in all",
    ]
    notes += _bounds(table, truth)
    report("Search quality against a table: replayed searches", markdown_table(headers, rows), torch.device("cpu"), args, notes)


def _front_first(search, table, truth):
    """The oracle sampler: the true front's architectures first (cheapest first), then the others nearest the
    front; what no sampler can beat with one seed per trial. A factory for `search.make_sampler`."""
    import torch
    from optuna.trial import FixedTrial

    from headsearch.search.cost_sampler import CostAwareSampler
    from headsearch.search.table import arch_key, overrides_of

    where = {c.key: arch_key(overrides_of(search.archs.sample_config(FixedTrial(c.params), torch.device("cpu")).to_dict(),
                                          table["base_config"])) for c in search.cost_candidates}

    class FrontFirst(CostAwareSampler):
        def choose(self, trials, number):
            held = self._read(trials, number)[2]
            free = [c for key, c in self.candidates.items() if key not in held]
            return min(free, key=lambda c: (where[c.key] not in truth.front, sum(truth.points[where[c.key]])), default=None)

    def make(trial_index: int = 0):
        names = [o.name for o in search.objectives]
        return FrontFirst(search.cost_candidates, quality=names.index(table["primary_metric"]), time=names.index("time"),
                          maximize=table["direction"] == "maximize", epochs=table["epochs"], seed=trial_index)

    return make


DEFAULT = "default"  # as a pruner or sampler name: what `headsearch run` uses when none is given
PAUSE = "+pause"  # a pruner's suffix: replayed with --pruner-pause


def _named(name: str) -> str | None:
    """A pruner or sampler name as `simulation_search` takes it: None for `default`."""
    return None if name == DEFAULT else name


def _paused(pruner: str) -> bool:
    return pruner.endswith(PAUSE)


def _seconds(value: float) -> str:
    return "never" if value == float("inf") else f"{value:.0f}"


def _startup(pruner: str) -> tuple[str, int | None]:
    """"pareto@2x3#8" -> ("pareto@2x3", 8): the trials that must reach a rung before it judges; None: the default."""
    pruner = pruner.removesuffix(PAUSE)
    pruner, _, startup = pruner.partition("#")
    return pruner, int(startup) if startup else None


def _rungs(pruner: str) -> tuple[str, tuple[int | None, int | None], float | None]:
    """"pareto@2x3~1" -> ("pareto", (2, 3), 1.0); "pareto" -> ("pareto", (None, None), None): the rule's defaults."""
    pruner, _ = _startup(pruner)
    pruner, _, margin = pruner.partition("~")
    name, _, rungs = pruner.partition("@")
    if not rungs:
        return name, (None, None), float(margin) if margin else None
    m, _, r = rungs.partition("x")
    return name, (m if m == "auto" else int(m), int(r)), float(margin) if margin else None


def _list_sample(table, args) -> None:
    """A table of a sample of its space cannot be replayed (a search may sample any architecture): list it,
    with the front among the sample, so that RESULTS.md holds its figures and command."""
    import torch

    from headsearch.search.simulate import true_points
    from headsearch.search.table import arch_key, seconds_of, summary_rows

    metric = table["primary_metric"]
    truth = true_points(table, [metric, "time"], [table["direction"], "minimize"])
    on_front = {arch_key(a["overrides"]) for a in table["architectures"]} & set(truth.front)
    keys = [arch_key(a["overrides"]) for a in table["architectures"]]
    rows = sorted(zip(summary_rows(table), keys), key=lambda rk: rk[0]["epoch_seconds"])
    body = [[r["arch"], f"{r['params']:,}", r["seeds"], f"{r['final']:.4f}", f"{r['epoch_seconds']:.2f}",
             "yes" if k in on_front else ""] for r, k in rows]
    headers = ["architecture", "params", "seeds", f"final val {metric} (mean)", "epoch seconds alone (mean)",
               f"on the sample's {metric} x time front"]
    notes = [f"table: {args.table.relative_to(ROOT) if args.table.is_relative_to(ROOT) else args.table}: a seeded sample of"
             f" {len(table['architectures'])} of the space's {table['architectures_in_space']} architectures, {table['seeds']}"
             f" seeds each, {table['epochs']} epochs, built on {table['device']} with torch {table['versions'].get('torch')},"
             f" {seconds_of(table) / 60:.1f} min of training alone; built by `{table['command']}`",
             "not replayed: a search may sample any architecture of the space; build the whole space (no --sample) to replay it"]
    report(f"Table {table['task']} x {table['space']['name']} (a sample, listed)", markdown_table(headers, body),
           torch.device("cpu"), args, notes)


def _bounds(table, truth) -> list[str]:
    """What any pruning rule can save on this table, and what the first epoch says about the true front."""
    import statistics

    from headsearch.search.table import arch_key

    size, front, epochs = len(table["architectures"]), len(truth.front), table["epochs"]
    maximize = table["direction"] == "maximize"
    lines = []
    # every epoch of a short table; of a long one, epoch 1, the rungs 2, 4, 8, ... and the default's 3, 9, 27, ...
    doubling, tripling = (2 ** k for k in range(1, 12)), (3 ** k for k in range(1, 8))
    shown = list(range(1, epochs)) if epochs <= 6 else sorted({1, *(e for e in (*doubling, *tripling) if e < epochs)})
    for first in shown:  # every architecture off the true front stopped at `first`, the front trained in full
        spent = front * epochs + (size - front) * first
        lines.append(f"at most {size * epochs / spent:.2f}x fewer epochs for a rule that first judges at epoch {first}")
    # Where the true front's architectures stand at epoch e: how many others dominate them (mean accuracy, e x epoch seconds).
    ranks = []
    for e in shown:
        pts = {}
        for a in table["architectures"]:
            best = [max(r["curve"][:e]) if maximize else min(r["curve"][:e]) for r in a["runs"]]
            q = statistics.fmean(best)
            pts[arch_key(a["overrides"])] = (-q if maximize else q, e * statistics.fmean(r["epoch_seconds"] for r in a["runs"]))
        dominated = [sum(all(x <= y for x, y in zip(o, pts[k])) and o != pts[k] for o in pts.values()) for k in truth.front]
        ranks.append(f"epoch {e}: up to {max(dominated)} of {size - 1} (median {statistics.median(dominated):g})")
    # Whether the curves cross: the share of architecture pairs whose order at epoch e (mean over seeds) is not
    # their order at the last epoch, and the rank correlation of the two.
    from scipy.stats import spearmanr

    def at(e):
        return [statistics.fmean(r["curve"][e - 1] for r in a["runs"]) for a in table["architectures"]]

    final, crossing = at(epochs), []
    for e in shown:
        now = at(e)
        pairs = [(i, j) for i in range(size) for j in range(i + 1, size) if final[i] != final[j]]
        swapped = sum((now[i] - now[j]) * (final[i] - final[j]) < 0 for i, j in pairs)
        crossing.append(f"epoch {e}: {swapped / len(pairs):.0%} of pairs, rho {spearmanr(now, final).statistic:.2f}")
    return ["bounds: an oracle that knows the true front (no rule can do better): " + "; ".join(lines),
            "the true front's architectures dominated by others (mean quality so far x time so far) at "
            + "; ".join(ranks),
            f"curves crossing: architecture pairs ordered otherwise by mean validation {table['primary_metric']} at epoch e"
            f" than at epoch {epochs}, and Spearman's rho of the two: " + "; ".join(crossing)]


def _samplers(spec: str | None, seeds: int, default: str) -> list[tuple[str, int]]:
    """'nsga2,gp:20' -> [('nsga2', seeds), ('gp', 20)]; None -> the default sampler with `seeds`."""
    out = []
    for item in (spec or default).split(","):
        name, _, n = item.partition(":")
        out.append((name, int(n) if n else seeds))
    return out


def _peer(name: str) -> tuple[str, tuple[int, int] | None, bool]:
    """"moasha-ranked@3x3" -> ("moasha-ranked@3x3", (3, 3), True)."""
    kind, _, rungs = name.partition("@")
    if kind not in ("moasha", "moasha-ranked"):
        raise SystemExit(f"--peers: unknown peer {name!r} (moasha, moasha@MxR, moasha-ranked, moasha-ranked@MxR)")
    first, _, factor = rungs.partition("x")
    return name, ((int(first), int(factor or 3)) if rungs else None), kind == "moasha-ranked"


def _peer_row(table, truth, name, rungs, ranked, workers, budget, seeds, base_epochs, base_seconds) -> list:
    """One peer's row, replayed `seeds` times by its own simulator (benchmarks/peers.py)."""
    from peers import MISSING, replay_moasha

    runs = []
    for seed in range(seeds):
        t1 = time.perf_counter()
        try:
            r = replay_moasha(table, trials=budget, workers=workers, seed=seed, truth=truth, rungs=rungs, ranked=ranked)
        except ImportError:
            raise SystemExit(MISSING) from None
        runs.append((r, time.perf_counter() - t1))
    hv, epochs, seconds = ([r.hypervolume for r, _ in runs], [r.epochs for r, _ in runs], [r.seconds for r, _ in runs])
    to85, to90 = [r.time_to(0.85) for r, _ in runs], [r.time_to(0.90) for r, _ in runs]
    mean_epochs, mean_seconds = statistics.fmean(epochs), statistics.fmean(seconds)
    return [workers, budget, "random, with replacement", name, seeds, f"{statistics.median(hv):.3f}",
            f"{quantile(hv, 0.1):.3f}", f"{statistics.median(r.recall for r, _ in runs):.2f}", f"{mean_epochs:.0f}",
            f"{base_epochs / mean_epochs:.2f}x" if base_epochs else "-", f"{mean_seconds:.0f}",
            f"{base_seconds / mean_seconds:.2f}x" if base_seconds else "-",
            f"{statistics.fmean(len(r.front) for r, _ in runs):.1f}",
            f"{statistics.fmean(r.repeats for r, _ in runs):.1f} repeats", _seconds(statistics.median(to85)),
            _seconds(statistics.median(to90)), _seconds(quantile(to90, 0.9)),
            f"{statistics.fmean(s for _, s in runs):.2f}"]


if __name__ == "__main__":
    main()
