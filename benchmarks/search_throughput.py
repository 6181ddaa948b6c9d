"""Benchmark 4: search throughput — trials per hour with 1 and with K concurrent trials on one device.

Each row is a complete `headsearch run ... --trials-per-gpu K` in a subprocess (what a user types):
K worker processes share one study and one GPU (on a machine without GPUs, K processes share the
CPU cores). Pruning is off so that every trial does the same work. Two rates: "wall" counts the
whole command (start-up, data loading, every process); "steady" counts from the first trial's start
to the last trial's end, as the study's timestamps record them.

    python benchmarks/search_throughput.py --quick         # CPU: 6 trials x 1 epoch on 1,500 images, K = 1, 2 (about 2 minutes)
    python benchmarks/search_throughput.py                 # GPU: 16 trials x 3 epochs of the reference ViT, K = 1, 2, 4, 8
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import DATA, ROOT, markdown_table, parser, report, resolve_device, search_space


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ks", default=None, help="comma list of concurrent trials per device (default 1,2 quick; 1,2,4,8 full)")
    p.add_argument("--trials", type=int, default=None, help="trials per search (default 6 quick, 16 full)")
    p.add_argument("--epochs", type=int, default=None, help="epochs per trial (default 1 quick, 3 full)")
    args = p.parse_args()

    device = resolve_device(args.device)
    ks = [int(k) for k in (args.ks or ("1,2" if args.quick else "1,2,4,8")).split(",")]
    trials = args.trials or (6 if args.quick else 16)
    epochs = args.epochs or (1 if args.quick else 3)
    work = Path(tempfile.mkdtemp(prefix="headsearch-bench-throughput-"))
    rows, base = [], None
    for k in ks:
        r = run_search(k, work, trials, epochs, device, args.quick)
        base = base or r
        n = r["trained"]
        rows.append([k, n, f"{r['wall']:.0f}", f"{3600 * n / r['wall']:.0f}", f"{3600 * n / r['steady']:.0f}",
                     f"{(n / r['steady']) / (base['trained'] / base['steady']):.2f}x", f"{r['per_trial']:.1f}"])
    table = markdown_table(["trials at once (K)", "trials trained", "wall s", "trials/hour (wall)", "trials/hour (steady)",
                            "speed-up (steady)", "mean trial s"], rows)
    space = "deep-head-quick (1,500 images)" if args.quick else "deep-head, seed ViT on the full data"
    notes = [f"task vit-cifar10, space {space}, {epochs} epoch(s) a trial, pruning off, sampler random, seed 0",
             "a trial's seconds grow with K as the trials share the device; throughput is what counts"]
    if device.type == "cpu":
        notes.append(f"CPU: the K processes split the {os.cpu_count()} cores' threads between them, so little gain is expected here; "
                     "the GPU rows are the point of this benchmark")
    report("Search throughput", table, device, args, notes)


def run_search(k: int, work: Path, trials: int, epochs: int, device, quick: bool) -> dict:
    from optuna import load_study
    from optuna.trial import TrialState

    storage = f"sqlite:///{work / 'studies.db'}"
    space = search_space(quick)
    cmd = [sys.executable, "-m", "headsearch", "run", "--task", "vit-cifar10", "--space", space,
           "--trials", str(trials), "--epochs", str(epochs), "--pruner", "none", "--sampler", "random",
           "--storage", storage, "--study", f"throughput-k{k}", "--data-dir", str(DATA / "cifar10"),
           "--run-root", str(work / "runs"), "--device", str(device), "--trials-per-gpu", str(k)]
    if quick:
        cmd += ["--preset", "tiny"]
    print(f"K={k}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"the search with K={k} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    # A sampled twin of a finished trial reuses its result without training: count trained trials only.
    done = [t for t in load_study(study_name=f"throughput-k{k}", storage=storage).get_trials(deepcopy=False)
            if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs]
    first = min(t.datetime_start for t in done)
    last = max(t.datetime_complete for t in done)
    return {"trained": len(done), "wall": wall, "steady": (last - first).total_seconds(),
            "per_trial": sum((t.datetime_complete - t.datetime_start).total_seconds() for t in done) / len(done)}


if __name__ == "__main__":
    main()
