"""Benchmark 3: pruning efficiency — the same search with and without pruning.

Every search has the same task, space, seed, trial budget and sampler; only the pruner differs.
The default sampler here is `random`: seeded by the trial's index, it proposes exactly the same
architectures in every search, so the difference in epochs and in best quality is pruning's alone
(with NSGA-II, pruned trials also change what is proposed next; pass --sampler nsga2 to see that).

Target (issue 5): at least 2x fewer epochs than no pruning, for a best quality within 0.5 points.

    python benchmarks/pruning.py --quick     # CPU: three searches of 10 trials x 5 epochs on 1,500 images, about 6 minutes
    python benchmarks/pruning.py             # GPU: 24 trials x 20 epochs of the reference ViT on the full data
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from common import DATA, markdown_table, parser, report, resolve_device, search_space

PRUNERS = ("none", "median", "asha")


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=None, help="trial budget of every search (default 10 quick, 24 full)")
    p.add_argument("--epochs", type=int, default=None, help="epochs per trial (default 5 quick, 20 full)")
    p.add_argument("--sampler", default="random", help="random (same proposals in every search) | nsga2 | tpe")
    p.add_argument("--pruners", default=",".join(PRUNERS), help=f"comma list of {', '.join(PRUNERS)}")
    p.add_argument("--keep", type=Path, default=None, help="keep the studies in this folder (default: a temporary one)")
    args = p.parse_args()

    device = resolve_device(args.device)
    trials = args.trials or (10 if args.quick else 24)
    epochs = args.epochs or (5 if args.quick else 20)
    space = search_space(args.quick)
    pruners = [x.strip() for x in args.pruners.split(",") if x.strip()]

    work = args.keep or Path(tempfile.mkdtemp(prefix="headsearch-bench-pruning-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {name: run_search(name, work, trials, epochs, space, args.sampler, str(device), args.quick) for name in pruners}

    base = results.get("none")
    rows = []
    for name, r in results.items():
        fewer = f"{base['epochs'] / r['epochs']:.2f}x" if base and r["epochs"] else "-"
        gap = f"{100 * (r['best_val'] - base['best_val']):+.1f}" if base else "-"
        rows.append([name, r["complete"], r["pruned"], r["epochs"], fewer, f"{r['wall']:.0f}",
                     f"{100 * r['best_val']:.1f}", gap, f"{100 * r['best_test']:.1f}", r["best_arch"]])
    table = markdown_table(["pruner", "complete", "pruned", "epochs trained", "fewer epochs", "wall s",
                            "best val acc %", "vs none (points)", "its test acc %", "best architecture"], rows)
    notes = [f"task vit-cifar10, space {Path(space).stem}, {trials} trials x {epochs} epochs, seed 0, "
             f"sampler {args.sampler}, objectives accuracy,time; pruner defaults of `headsearch run`",
             "epochs trained counts every epoch of every trial (a sampled twin of a finished trial reuses it and trains none)",
             "target: >= 2x fewer epochs with the best validation accuracy within 0.5 points of no pruning"]
    for name, r in results.items():
        if name != "none" and base:
            met = base["epochs"] >= 2 * r["epochs"] and abs(r["best_val"] - base["best_val"]) <= 0.005
            notes.append(f"{name}: target {'met' if met else 'missed'}")
    if args.quick:
        notes.append("quick size: 1,500 training images make accuracies noisy (a 1,000-image validation set "
                     "has a standard error of about 1.5 points), so ranks at epoch 1 are partly chance")
    report("Pruning efficiency", table, device, args, notes)


def run_search(pruner: str, work: Path, trials: int, epochs: int, space: str, sampler: str, device: str, quick: bool) -> dict:
    """One search to completion through the library `headsearch run` uses; its totals."""
    from optuna.trial import TrialState

    from headsearch.search.runner import Search, SearchSettings

    settings = SearchSettings(
        task="vit-cifar10", space=space, trials=trials, epochs=epochs, preset="tiny" if quick else None,
        sampler=sampler, pruner=pruner, seed=0, storage=f"sqlite:///{work / 'studies.db'}",
        study=f"pruning-{pruner}", data_dir=str(DATA / "cifar10"), run_root=str(work / "runs"), device=device,
    )
    search = Search(settings)
    study = search.open()
    print(f"search with pruner {pruner}: {trials} trials x {epochs} epochs ...", flush=True)
    t0 = time.perf_counter()
    search.run_worker(0)
    wall = time.perf_counter() - t0
    done = study.get_trials(deepcopy=False)
    complete = [t for t in done if t.state == TrialState.COMPLETE]
    best = max(complete, key=lambda t: t.values[0])
    return {
        "complete": len(complete),
        "pruned": sum(t.state == TrialState.PRUNED for t in done),
        "epochs": sum(int(t.user_attrs.get("epochs_run", 0)) for t in done if "duplicate_of" not in t.user_attrs),
        "wall": wall,
        "best_val": best.values[0],
        "best_test": best.user_attrs["test_metrics"]["accuracy"],
        "best_arch": best.user_attrs["arch"],
    }


if __name__ == "__main__":
    main()
