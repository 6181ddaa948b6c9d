"""Benchmark: search throughput of the defaults against one eager trial at a time, and the headline projection.

Each row is a complete `headsearch run` in a subprocess (what a user types), on the same search:
- "defaults": no flags (the plan: on a GPU several trials per GPU, compiled blocks + CUDA graphs, MPS;
  on a CPU one worker, eager, unchanged);
- "K=1 eager": `--trials-per-gpu 1 --compile off`, the reference;
- optionally `--ks`: `--trials-per-gpu K` with the default step mode, to measure the plan's rule.
Pruning is off so that every trial does the same work. Aggregate samples/s counts the training samples
of every trial over the steady span (first trial's start to last trial's end, as the study records it),
so it includes evaluation and each trial's start. The headline projection scales it to the seed budget:
`headsearch run --task vit-cifar10 --trials 50` trains at most 50 x 400 epochs x 45,000 images (no
pruning: an upper bound; median pruning stops most trials early), at the measured rate.

    python benchmarks/search_throughput.py --quick         # CPU: 6 trials x 1 epoch on 1,500 images
    python benchmarks/search_throughput.py                 # GPU: 24 trials x 3 epochs of the seed ViT on the data there
    python benchmarks/search_throughput.py --ks 4,8,16     # GPU: also K = 4, 8, 16 per GPU
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import DATA, ROOT, markdown_table, parser, report, resolve_device, search_space

SEED_TRIAL_SAMPLES = 400 * 45_000  # one trial at the seed budget, unpruned: epochs x training images
SEED_BUDGET_SAMPLES = 50 * SEED_TRIAL_SAMPLES  # the headline job (50 trials) without pruning


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ks", default="", help="also these --trials-per-gpu values with the default step mode (comma list)")
    p.add_argument("--trials", type=int, default=None, help="trials per search (default 6 quick, 24 full)")
    p.add_argument("--epochs", type=int, default=None, help="epochs per trial (default 1 quick, 3 full)")
    args = p.parse_args()

    device = resolve_device(args.device)
    trials = args.trials or (6 if args.quick else 24)
    epochs = args.epochs or (1 if args.quick else 3)
    work = Path(tempfile.mkdtemp(prefix="headsearch-bench-throughput-"))
    setups = {"K=1 eager (reference)": ["--trials-per-gpu", "1", "--compile", "off"], "defaults (the plan)": []}
    setups.update({f"K={k}": ["--trials-per-gpu", k] for k in args.ks.split(",") if k})
    rows, results = [], {}
    for i, (name, flags) in enumerate(setups.items()):
        r = run_search(name, flags, f"t{i}", work, trials, epochs, device, args.quick)
        results[name] = r
        base = results["K=1 eager (reference)"]
        hours = SEED_BUDGET_SAMPLES / r["samples_per_s"] / 3600
        rows.append([name, r["plan"], r["trained"], f"{r['steady']:.0f}", f"{r['samples_per_s']:,.0f}",
                     f"{r['samples_per_s'] / base['samples_per_s']:.2f}x",
                     f"{3600 * r['samples_per_s'] / SEED_TRIAL_SAMPLES:.2f}", f"{hours:.2f}"])
    table = markdown_table(["setup", "plan (as printed)", "trials", "steady s", "aggregate samples/s", "vs reference",
                            "trials/hour at the seed budget", "50 trials, hours (no pruning)"], rows)
    space = "deep-head-quick (1,500 images)" if args.quick else "deep-head on the data there"
    notes = [f"task vit-cifar10, space {space}, {trials} trials x {epochs} epoch(s), pruning off, sampler random, seed 0",
             "aggregate samples/s = training samples of all trials / steady span (evaluation and trial starts included);"
             " the last column scales it to the headline job's budget (50 trials x 400 epochs x 45,000 images) without"
             " pruning, an upper bound"]
    if device.type == "cpu":
        notes.append("CPU: the defaults are one eager worker, as before, so both rows run the same way here;"
                     " the GPU rows are the point of this benchmark")
    report("Search throughput", table, device, args, notes)


def run_search(name: str, flags: list, study: str, work: Path, trials: int, epochs: int, device, quick: bool) -> dict:
    from optuna import load_study
    from optuna.trial import TrialState

    storage = f"sqlite:///{work / 'studies.db'}"
    cmd = [sys.executable, "-m", "headsearch", "run", "--task", "vit-cifar10", "--space", search_space(quick),
           "--trials", str(trials), "--epochs", str(epochs), "--pruner", "none", "--sampler", "random",
           "--storage", storage, "--study", study, "--data-dir", str(DATA / "cifar10"),
           "--run-root", str(work / "runs"), "--device", str(device), *map(str, flags)]
    if quick:
        cmd += ["--preset", "tiny"]
    print(f"{name}: {' '.join(cmd[3:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1", "COLUMNS": "300"})
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"the search {name} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    plan = next((line[len("plan: "):] for line in proc.stderr.splitlines() if line.startswith("plan: ")), "?")
    # A sampled twin of a finished trial reuses its result without training: count trained trials only.
    done = [t for t in load_study(study_name=study, storage=storage).get_trials(deepcopy=False)
            if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs]
    first = min(t.datetime_start for t in done)
    last = max(t.datetime_complete for t in done)
    steady = (last - first).total_seconds()
    samples = sum(t.user_attrs["samples_per_s"] * t.user_attrs["train_seconds"] for t in done)
    return {"trained": len(done), "wall": wall, "steady": steady, "samples_per_s": samples / steady, "plan": plan}


if __name__ == "__main__":
    main()
