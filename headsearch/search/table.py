"""`headsearch table`: a tabular benchmark of a search space, every architecture trained to the search budget.

In the spirit of NAS-Bench-201 (Dong & Yang 2020, "NAS-Bench-201: Extending the Scope of Reproducible Neural
Architecture Search", ICLR) and Syne Tune's blackbox repository: every distinct architecture of a space
(`Search.architectures`), on the search's own base config (the preset's search budget), trained with seeds
0..N-1 and no pruning. The runs are a comparison's (headsearch.search.compare.ConfigGrid): the search's
workers train them with the fair clock, the study keeps them, and running the same command again trains
only what is missing. `read_table` turns the study into a small JSON file (`TABLE_FORMAT`): per
architecture what it changes of the base config, its parameter count and, per seed, the validation curve of the primary metric, one
epoch's fair seconds and the test metrics; with the command, the device and the library versions.

`headsearch.search.simulate` replays whole searches against such a file.
"""
from __future__ import annotations

import datetime as _dt
import json
import random
import statistics
from pathlib import Path
from typing import Any, Sequence

from headsearch.config import stable_key
from headsearch.errors import ConfigError
from headsearch.io import write_atomic
from headsearch.tasks import resolve_config
from headsearch.tasks.registry import task_reference

TABLE_FORMAT = "headsearch-table/1"


def overrides_of(config: dict[str, Any], base: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What `config` changes of `base`, section by section (arch, train, data; the seed left out): how a table
    names an architecture, and how a search's trial finds its row."""
    out: dict[str, dict[str, Any]] = {}
    for section, fields in config.items():
        if isinstance(fields, dict):
            changed = {k: v for k, v in fields.items() if (base.get(section) or {}).get(k) != v}
            if changed:
                out[section] = changed
    return out


def arch_key(overrides: dict[str, Any]) -> str:
    return stable_key(overrides)


def table_search(task: str, space: str, *, seeds: int, preset: str | None = None, epochs: int | None = None,
                 data_dir: str | None = None, data_file: str | None = None, storage: str, study: str | None = None,
                 run_root: str = "runs", device: str = "auto", workers: int | None = None, cohort: int | None = None,
                 sample: int | None = None, sample_seed: int = 0, sets: dict[str, dict[str, Any]] | None = None):
    """The table's comparison: (Search, ConfigGrid) over every architecture of `space` (or a seeded sample of
    `sample` of them) x seeds 0..seeds-1, with no pruning, every run with the `--set` overrides `sets` (a cheaper
    epoch, say). Nothing is trained or written yet."""
    from headsearch.search.compare import Candidate, ConfigGrid, check_seeds
    from headsearch.search.runner import Search, SearchSettings, arch_summary

    check_seeds(seeds)
    common = dict(preset=preset, epochs=epochs, data_dir=data_dir, data_file=data_file, storage=storage,
                  run_root=run_root, device=device, sets=sets or None)
    space_search = Search(SearchSettings(task=task, space=space, **common))
    archs = space_search.archs.listing()
    if archs is None:
        raise ConfigError(f"space {space_search.space.name} has a continuous range (or too many points): a table lists"
                          " every architecture, so give a space of choices only")
    configs = [resolve_config(space_search.task, config=json.loads(k)) for k in archs]
    if sample is not None:
        if sample < 2:
            raise ConfigError(f"--sample {sample}: give at least 2 architectures")
        if sample < len(configs):
            picked = sorted(random.Random(sample_seed).sample(range(len(configs)), sample))
            configs = [configs[i] for i in picked]
    cands = tuple(Candidate(arch_summary(c), c, space) for c in configs)
    grid = ConfigGrid(cands, seeds, name=f"table-{space_search.space.name}")
    name = study or "-".join(["table", space_search.task.name, space_search.space.name] + ([preset] if preset else [])
                             + ([f"sample{sample}-{sample_seed}"] if sample is not None else []))
    settings = SearchSettings(task=task, space=grid, trials=grid.points, sampler="random", pruner="none",
                              study=name, workers=workers, cohort=cohort, **common)
    return Search(settings), grid, space_search


def read_table(study, grid, space_search, *, command: str, device: str) -> dict[str, Any]:
    """The study's finished runs as a table (`TABLE_FORMAT`); an architecture lists the seeds that finished."""
    from optuna.trial import TrialState

    from headsearch.training.rundir import library_versions

    task = space_search.task
    by_config: dict[int, list[dict[str, Any]]] = {}
    parameters: dict[int, int] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        i, seed = t.params.get("config"), t.params.get("seed")
        a = t.user_attrs
        if i is None or a.get("epoch_seconds_alone") is None:
            continue
        curve = [t.intermediate_values[e] for e in sorted(t.intermediate_values)]
        by_config.setdefault(i, []).append({"seed": seed, "curve": curve, "epoch_seconds": a["epoch_seconds_alone"],
                                            "test": a.get("test_metrics") or {}})
        parameters[i] = a.get("params")
    base = space_search.base.to_dict()
    archs = [{"arch": cand.name, "overrides": overrides_of(cand.config.to_dict(), base), "params": parameters[i],
              "runs": sorted(by_config[i], key=lambda r: r["seed"])}
             for i, cand in enumerate(grid.candidates) if i in by_config]
    return {
        "format": TABLE_FORMAT,
        "task": task_reference(task),
        "primary_metric": task.primary.name,
        "direction": task.primary.direction,
        "space": space_search.space.summary(),
        "preset": space_search.settings.preset,
        "epochs": space_search.base.train.epochs,
        "sets": space_search.settings.sets or {},  # --set: a replayed search is built with them too
        "seeds": grid.seeds,
        "architectures_in_space": len(space_search.archs.listing() or {}),
        "base_config": base,
        "command": command,
        "device": device,
        "versions": library_versions(),
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "time": "epoch_seconds: one epoch's training seconds with the device to itself (the search's fair clock);"
                " time to epoch e = e x epoch_seconds",
        "architectures": archs,
    }


def write_table(table: dict[str, Any], path: Path) -> Path:
    """One architecture per line, so a diff of two builds reads by architecture."""
    head = {k: v for k, v in table.items() if k != "architectures"}
    lines = [json.dumps(a, sort_keys=True) for a in table["architectures"]]
    text = json.dumps(head, indent=1, sort_keys=True)[:-2] + ',\n "architectures": [\n' + ",\n".join(lines) + "\n ]\n}\n"
    json.loads(text)  # the file must read back as JSON
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)
    return path


def load_table(path: Path | str) -> dict[str, Any]:
    """A table written by `write_table`; one clear error when the file is not one."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"table {p}: no such file; build one with `headsearch table`")
    try:
        table = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"table {p} is not JSON: build it with `headsearch table`") from None
    if not isinstance(table, dict) or table.get("format") != TABLE_FORMAT:
        raise ConfigError(f"table {p} is not a {TABLE_FORMAT} file: build it with `headsearch table`")
    if not table.get("architectures"):
        raise ConfigError(f"table {p} holds no finished architecture: run its command again to train them")
    return table


def seconds_of(table: dict[str, Any]) -> float:
    """Training seconds the table's runs took, alone on the device (what building it again would cost)."""
    return sum(len(r["curve"]) * r["epoch_seconds"] for a in table["architectures"] for r in a["runs"])


def summary_rows(table: dict[str, Any]) -> Sequence[dict[str, Any]]:
    """Per architecture: mean final validation metric over seeds, mean epoch seconds, params, seeds."""
    return [{"arch": a["arch"], "params": a["params"], "seeds": len(a["runs"]),
             "final": statistics.fmean(r["curve"][-1] for r in a["runs"]),
             "epoch_seconds": statistics.fmean(r["epoch_seconds"] for r in a["runs"])} for a in table["architectures"]]
