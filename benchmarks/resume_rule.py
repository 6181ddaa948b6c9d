"""Benchmark: when a paused trial should go on (--pruner-pause): the resume rule's settings replayed against a table.

Each row replays the default search (`headsearch run`'s sampler and budget; headsearch.search.simulate) with the
Pareto rule, over many seeds, either killing what it stops or pausing it, with the resume rule of
`headsearch.search.pruning.resume` set as the row says, and reports what `search_quality.py` reports: the
hypervolume of the reported front over the true front's (median, 10th percentile), the epochs trained against
no pruning in the same run, and the simulated seconds until the anytime hypervolume reaches 0.90. The frontier
is epochs saved against the 10th percentile.

A row is `kill` or `pause`, then `:key=value` settings: `m` the first rung, `r` the reduction factor, `margin`
the pause rule's noise margin in sigmas (the rule's defaults when left out: 0.9 killing, 0 pausing); for
`pause`, `q` the quantile of the finished trials' gains a paused trial is credited with, `gains` whose (`all`
the finished trials, or `slower`: those at least as slow an epoch), `sig` the sigmas of noise added, `when`
whether the projection is asked once the budget is spent (`spent`), `always`, or `never` (the rule asked again
only). Left out, each is the resume rule's own (headsearch/search/pruning/resume.py).

    python benchmarks/resume_rule.py --table benchmarks/tables/vit-cifar10-deep-head-tiny16.json --workers 8 \\
        kill kill:margin=0 pause:margin=0:q=0.9:sig=0:when=spent pause:margin=0:when=never
"""
from __future__ import annotations

import statistics
from pathlib import Path

from common import ROOT, markdown_table, parser, quantile, report

DEFAULT_TABLE = ROOT / "benchmarks" / "tables" / "vit-cifar10-deep-head-tiny16.json"
INTS, FLOATS = {"m", "r"}, {"margin", "q", "sig"}


def parse_row(spec: str) -> tuple[bool, dict]:
    """"pause:margin=0:q=0.9" -> (True, {"margin": 0.0, "q": 0.9})."""
    kind, *settings = spec.split(":")
    if kind not in ("kill", "pause"):
        raise SystemExit(f"a row starts with kill or pause, got {spec!r}")
    out = {}
    for s in settings:
        key, _, value = s.partition("=")
        if key in INTS:
            out[key] = int(value)
        elif key in FLOATS:
            out[key] = float(value)
        elif (key == "when" and value in ("spent", "always", "never")) or (key == "gains" and value in ("all", "slower")):
            out[key] = value
        else:
            raise SystemExit(f"{s!r} in {spec!r}: the settings are m, r, margin, q, sig, when=spent|always|never and"
                             " gains=all|slower")
    return kind == "pause", out


def replays(table, truth, workers: int, seeds: int, pause: bool | None, settings: dict) -> dict:
    """`seeds` replays of one row (`pause` None: no pruning): hypervolumes, epochs, times to 0.90."""
    import headsearch.search.pruning.resume as resume
    import headsearch.search.trial_pruning as trial_pruning
    from headsearch.search.simulate import replay, simulation_search

    saved = resume.RESUME_QUANTILE, resume.RESUME_SIGMAS, resume.RESUME_GAINS, trial_pruning.RESUME_PROJECTED
    resume.RESUME_QUANTILE = settings.get("q", resume.RESUME_QUANTILE)
    resume.RESUME_SIGMAS = settings.get("sig", resume.RESUME_SIGMAS)
    resume.RESUME_GAINS = settings.get("gains", resume.RESUME_GAINS)
    trial_pruning.RESUME_PROJECTED = settings.get("when", trial_pruning.RESUME_PROJECTED)
    try:
        hv, epochs, to90 = [], [], []
        for seed in range(seeds):
            pruning = {} if pause is None else dict(
                pruner="pareto", pruner_min_epochs=settings.get("m"), pruner_reduction_factor=settings.get("r"),
                pruner_noise_margin=settings.get("margin"), pruner_pause=pause)
            search = simulation_search(table, space=table["space"]["name"], trials=len(table["architectures"]),
                                       seed=seed, **({"pruner": "none"} if pause is None else pruning))
            r = replay(search, table, workers=workers, truth=truth)
            hv.append(r.hypervolume)
            epochs.append(r.epochs)
            to90.append(r.time_to(0.90))
    finally:
        resume.RESUME_QUANTILE, resume.RESUME_SIGMAS, resume.RESUME_GAINS, trial_pruning.RESUME_PROJECTED = saved
    return {"hv": hv, "epochs": epochs, "to90": to90}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--table", type=Path, default=DEFAULT_TABLE, help="a table written by `headsearch table`")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seeds", type=int, default=100, help="replays per row (sampler seeds 0..N-1)")
    p.add_argument("rows", nargs="+", help="kill[:k=v...] or pause[:k=v...] (see the module's docstring)")
    args = p.parse_args()
    if args.quick:
        args.seeds = min(args.seeds, 20)
    rows_wanted = [parse_row(r) for r in args.rows]

    import torch

    from headsearch.search.simulate import simulation_search, true_points
    from headsearch.search.table import load_table

    table = load_table(args.table)
    probe = simulation_search(table, space=table["space"]["name"], trials=1, seed=0)
    truth = true_points(table, [o.name for o in probe.objectives], probe.directions)
    base = replays(table, truth, args.workers, args.seeds, None, {})
    base_epochs = statistics.fmean(base["epochs"])

    def row(name: str, r: dict) -> list:
        to90 = ["never" if x == float("inf") else f"{x:.0f}" for x in (statistics.median(r["to90"]), quantile(r["to90"], 0.9))]
        mean = statistics.fmean(r["epochs"])
        return [name, f"{statistics.median(r['hv']):.3f}", f"{quantile(r['hv'], 0.1):.3f}", f"{mean:.0f}",
                f"{base_epochs / mean:.2f}x", *to90]

    rows = [row("none", base)]
    for spec, (pause, settings) in zip(args.rows, rows_wanted):
        rows.append(row(spec, replays(table, truth, args.workers, args.seeds, pause, settings)))
        print(rows[-1], flush=True)
    headers = ["row", "hypervolume (median)", "hypervolume (10th pct)", "epochs (mean)", "fewer epochs than none",
               "to 0.90 (median s)", "to 0.90 (90th pct s)"]
    rel = args.table.relative_to(ROOT) if args.table.is_relative_to(ROOT) else args.table
    notes = [f"table: {rel} ({len(table['architectures'])} architectures, {table['epochs']} epochs); budget: every"
             f" architecture once; {args.workers} workers; {args.seeds} replays a row (sampler seeds 0..N-1); the"
             " default sampler; the Pareto rule with its defaults unless the row says otherwise"]
    report("The resume rule of --pruner-pause, replayed", markdown_table(headers, rows), torch.device("cpu"), args, notes)


if __name__ == "__main__":
    main()
