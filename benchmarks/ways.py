"""Benchmark: `headsearch bench` on this machine: the ways a search can run its trials, verified, then timed.

Runs the library's `headsearch.machine.bench.bench` (the same code as the command) for a task's search base
architecture and appends its table: per way (step mode, K processes with and without MPS, cohorts of K;
on a CPU workers x threads and cohorts) the aggregate and per-trial samples/s, whether it was verified
(a captured step against the uncaptured one, a cohort slot against the same trial alone) and its warm-up
seconds. The reference in the same run is one process in the default step mode (`auto`: eager on a CPU,
compiled + CUDA graphs on a GPU): the last column is each way's aggregate over it. The measurement is
also saved in headsearch's cache, as `headsearch bench` saves it (`--no-save` to leave the cache alone).

    python benchmarks/ways.py --quick                                 # CPU: the tiny preset, 3 s a way (about 2 min)
    python benchmarks/ways.py                                         # GPU: the seed ViT, 10 s a way
    python benchmarks/ways.py --task translation-en-es --preset tiny  # translation (processes only: it does not stack)
"""
from __future__ import annotations

from common import DATA, markdown_table, parser, report, resolve_device


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--task", default="vit-cifar10")
    p.add_argument("--space", default="deep-head")
    p.add_argument("--preset", default=None, help="task preset (default: tiny with --quick, none otherwise)")
    p.add_argument("--seconds", type=float, default=None, help="timed seconds per way (default 3 quick, 10 on a GPU)")
    p.add_argument("--no-save", action="store_true", help="do not save the measurement in headsearch's cache")
    args = p.parse_args()

    from headsearch.machine.bench import bench
    from headsearch.search.runner import Search, SearchSettings

    device = resolve_device(args.device)
    preset = args.preset or ("tiny" if args.quick else None)
    data = {"data_dir": str(DATA / "cifar10")} if args.task == "vit-cifar10" else {"data_file": str(DATA / "spa-eng" / "spa.txt")}
    search = Search(SearchSettings(task=args.task, space=args.space, preset=preset, device=device.type, **data))
    m = bench(search.plan_inputs(), seconds=args.seconds or (3.0 if args.quick else None), save=not args.no_save,
              report=lambda r: print(f"  {r.way.describe()}: {r.samples_per_s:,.0f} samples/s" if r.verified
                                     else f"  {r.way.describe()}: not used ({r.reason})", flush=True))
    reference = next((r for r in m.results if r.way.k == 1 and r.verified and r.way.kind == "processes"
                      and r.way.step_mode == ("reduce-overhead" if device.type == "cuda" else "off")), None)
    choice = m.choice()
    rows = []
    for r in m.results:
        ratio = f"{r.samples_per_s / reference.samples_per_s:.2f}" if r.verified and reference else "-"
        rows.append([r.way.describe() + (" (chosen)" if r is choice else ""), "yes" if r.verified else f"no: {r.reason}",
                     r.samples_per_s if r.verified else "-", r.per_trial if r.verified else "-",
                     f"{r.compile_seconds:.1f}" if r.verified else "-", ratio])
    table = markdown_table(["way", "verified", "samples/s (all trials)", "samples/s per trial", "warm-up s",
                            "x one process"], rows)
    notes = [f"task {args.task}, space {args.space}" + (f", preset {preset}" if preset else "")
             + f"; bench took {m.seconds:.0f} s; measurement key {m.key}",
             f"chosen for `headsearch run` here: {choice.way.describe()}" if choice else "no way was verified"]
    report("headsearch bench: the ways to run a search's trials", table, device, args, notes)


if __name__ == "__main__":
    main()
