"""Real searches against a table's truth: does what the simulator says of a sampler hold for a real search?

Runs `headsearch run` as a user does (the README's `make run`: the tiny ViT preset, 12 trials, on the real
CIFAR-10 files) once per sampler and seed, each in its own study, and scores each reported front the way the
simulator scores a replay: its architectures placed at their true points in a table built for the same task,
preset and epochs (`benchmarks/tables/vit-cifar10-deep-head-tiny.json`), hypervolume over the true front's and
front recall. The same run replays the same searches 100 times on the table, for the simulator's median
beside each real one. The wall time of each real search is printed with what measuring the costs took, and
for the cost-aware sampler how well the costs measured before training foretold each trial's own epoch
seconds alone (the median and the worst ratio of the two).

    python benchmarks/real_search.py --samplers cost,nsga2 --seeds 0,1 --trials 12
    python benchmarks/real_search.py --work /tmp/rs     # keep the studies there; a finished one is not run again
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, markdown_table, parser, report

DEFAULT_TABLE = ROOT / "benchmarks" / "tables" / "vit-cifar10-deep-head-tiny.json"
DATA = ROOT.parent / "shared" / "data" / "cifar10"


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--table", type=Path, default=DEFAULT_TABLE, help="a table of the tiny ViT's deep-head space")
    p.add_argument("--samplers", default="cost,nsga2", help="comma list of --sampler values")
    p.add_argument("--seeds", default="0", help="comma list of --seed values, one real search each")
    p.add_argument("--trials", type=int, default=12, help="--trials of each search (make run's: 12)")
    p.add_argument("--replays", type=int, default=100, help="replays per sampler for the simulator's median")
    p.add_argument("--data-dir", type=Path, default=DATA, help="the CIFAR-10 files")
    p.add_argument("--work", type=Path, default=None, help="where the studies go (default: a new temporary folder);"
                   " a search finished there before is scored, not run again")
    args = p.parse_args()

    import json

    import torch

    from headsearch.search.simulate import replay, simulation_search, true_points

    table = json.loads(args.table.read_text())
    truth = true_points(table, [table["primary_metric"], "time"], ["maximize", "minimize"])
    samplers = args.samplers.split(",")
    rows, notes = [], []
    work = args.work or Path(tempfile.mkdtemp(prefix="real-search-"))
    work.mkdir(parents=True, exist_ok=True)
    for sampler in samplers:
        simulated = [replay(simulation_search(table, space=table["space"]["name"], trials=args.trials, sampler=sampler,
                                              seed=s), table, truth=truth) for s in range(args.replays)]
        sim_hv = statistics.median(r.hypervolume for r in simulated)
        sim_recall = statistics.median(r.recall for r in simulated)
        for seed in [int(s) for s in args.seeds.split(",")]:
            real = _real_search(sampler, seed, args, table, truth, work)
            rows.append([sampler, seed, args.trials, real["wall"], real["costs"], real["foretold"], real["trained"],
                         real["epochs"], real["hypervolume"], real["recall"], sim_hv, sim_recall])
    headers = ["sampler", "seed", "trials", "wall seconds", "of which measuring costs",
               "trial's epoch seconds / its cost (median, worst)", "trained", "epochs", "hypervolume (real)",
               "front recall (real)", f"hypervolume (simulator, median of {args.replays})", "front recall (simulator)"]
    notes.append(f"each real search: `headsearch run --task vit-cifar10 --preset tiny --trials {args.trials} --sampler S"
                 f" --seed N --data-dir {args.data_dir}` in its own SQLite study; its reported front's architectures"
                 f" scored at their true points in {args.table.relative_to(ROOT) if args.table.is_relative_to(ROOT) else args.table}"
                 f" ({len(table['architectures'])} architectures, {table['seeds']} seeds, {table['epochs']} epochs; true"
                 f" front {len(truth.front)}), as the simulator scores a replay")
    notes.append("wall seconds: the whole command, data loading and the cost measurement included; the machine ran"
                 " nothing else of this benchmark meanwhile (the searches run one after another)")
    report("Real searches against a table's truth", markdown_table(headers, rows), torch.device("cpu"), args, notes)


def _real_search(sampler: str, seed: int, args, table, truth, work: Path) -> dict:
    import optuna

    from headsearch.search.costs import study_cost_summary
    from headsearch.search.simulate import score
    from headsearch.search.table import arch_key, overrides_of

    name = f"{sampler}-{seed}"
    url = f"sqlite:///{work / (name + '.db')}"
    cmd = [sys.executable, "-m", "headsearch", "run", "--task", "vit-cifar10", "--preset", "tiny", "--trials",
           str(args.trials), "--sampler", sampler, "--seed", str(seed), "--data-dir", str(args.data_dir),
           "--storage", url, "--study", name, "--run-root", str(work / "runs")]
    done = work / f"{name}.wall"  # written once the search has finished: its wall seconds
    if not done.exists():
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        done.write_text(f"{time.perf_counter() - start}\n")
    wall = float(done.read_text())
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=name, storage=url)
    front = []
    for t in study.best_trials:
        key = arch_key(overrides_of(t.user_attrs["config"], table["base_config"]))
        if key not in front:
            front.append(key)
    hv, recall = score(front, truth)
    trained = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED") and "rejected" not in t.user_attrs]
    costs = study_cost_summary(study)
    print(f"{name}: {wall:.0f} s, front {len(front)}, hypervolume {hv:.3f}, recall {recall:.2f}", flush=True)
    return dict(wall=wall, costs=costs.seconds if costs else 0.0, foretold=_foretold(study, trained), trained=len(trained),
                epochs=sum(len(t.intermediate_values) for t in trained), hypervolume=hv, recall=recall)


def _foretold(study, trained) -> str:
    """How each trial's own epoch seconds alone compare with the cost measured for its architecture before
    training: "median ratio (worst ratio)", or "-" without stored costs."""
    from headsearch.search.costs import stored_costs

    costs = stored_costs(study)
    ratios = [t.user_attrs["epoch_seconds_alone"] / costs[t.user_attrs["alone_key"]]["epoch_seconds_alone"]
              for t in trained if t.user_attrs.get("alone_key") in costs and "epoch_seconds_alone" in t.user_attrs]
    if not ratios:
        return "-"
    worst = max(ratios, key=lambda r: abs(r - 1))
    return f"{statistics.median(ratios):.3f} ({worst:.3f})"


if __name__ == "__main__":
    main()
