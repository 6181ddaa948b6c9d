"""Behaviour unchanged? A dump of 96 replayed searches, to compare before and after a refactor.

Replays every replayable table in benchmarks/tables/ (its own space) with each pruner at 1 and 4 workers,
seeds 0 and 1, 12 trials, and writes one JSON line per replay: each trial's state, epochs, values and
pruning decision, and the replay's front, hypervolume, recall, epochs and simulated seconds. Two trees give
the same file exactly when the search decides the same, trial by trial.

    python benchmarks/replay_dump.py /tmp/after.jsonl
    PYTHONPATH=/tmp/before python benchmarks/replay_dump.py /tmp/before.jsonl && cmp /tmp/before.jsonl /tmp/after.jsonl
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRUNERS = ("pareto", "multi-metric", "median", "percentile", "asha", "none")


def main(out: Path) -> None:
    from headsearch.search.simulate import replay, simulation_search
    from headsearch.search.table import load_table

    lines = []
    for path in sorted((ROOT / "benchmarks" / "tables").glob("*.json")):
        table = load_table(path)
        if len(table["architectures"]) < table.get("architectures_in_space", 0):
            print(f"{path.name}: a sample of its space, not replayable", file=sys.stderr)
            continue
        for pruner in PRUNERS:
            for workers in (1, 4):
                for seed in (0, 1):
                    search = simulation_search(table, space=table["space"]["name"], trials=12, pruner=pruner, seed=seed)
                    r = replay(search, table, workers=workers)
                    lines.append(json.dumps({"table": path.name, "pruner": pruner, "workers": workers, "seed": seed,
                                             "front": r.front, "hypervolume": r.hypervolume, "recall": r.recall,
                                             "epochs": r.epochs, "seconds": r.seconds, "trials": r.trials},
                                            sort_keys=True))
    out.write_text("\n".join(lines) + "\n")
    trials = sum(len(json.loads(line)["trials"]) for line in lines)
    print(f"{len(lines)} replays, {trials} trials -> {out}")

if __name__ == "__main__":
    main(Path(sys.argv[1]))
