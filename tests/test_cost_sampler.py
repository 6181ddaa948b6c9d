"""The cost-aware sampler (issue 42): its expected hypervolume improvement and models by hand, and whole
replayed searches that use it: the cheapest architecture first, no duplicate proposal, no two running trials
on one architecture, the same search for the same seed."""
import json
from pathlib import Path

import numpy as np
import pytest

from headsearch.search.cost_sampler import ehvi, gp_predict, linear_predict, non_dominated
from headsearch.search.simulate import replay, simulation_search

TABLES = Path(__file__).resolve().parents[1] / "benchmarks" / "tables"


def test_ehvi_of_a_point_of_known_cost_by_hand():
    front, reference = [(0.2, 0.5)], (1.1, -0.1)
    # Quality 0.8 for sure at cost 0.1: below quality 0.5 it widens the front from 0.2 down to 0.1 (width
    # 0.1 over 0.6 of quality), above it from the reference 1.1 down to 0.1 (width 1.0 over 0.3): 0.36.
    assert ehvi(0.1, 0.8, 1e-6, front, reference) == pytest.approx(0.36, abs=0.005)
    # Dominated for sure (dearer and worse than the front's point): nothing.
    assert ehvi(0.3, 0.4, 1e-6, front, reference) == 0.0
    # A coin toss between 0.5 and much better: half of the sure improvement above 0.5 at the mean ...
    sure = ehvi(0.3, 0.9, 1e-6, front, reference)  # (0.9 - 0.5) x (1.1 - 0.3) = 0.32
    assert sure == pytest.approx(0.32, abs=0.005)
    assert 0 < ehvi(0.3, 0.5, 0.1, front, reference) < sure
    # ... and the cost of reaching the reference improves nothing.
    assert ehvi(1.2, 0.9, 0.1, front, reference) == 0.0


def test_non_dominated_points_by_hand():
    points = [(1.0, 0.5), (2.0, 0.7), (2.5, 0.6), (3.0, 0.7), (0.5, 0.2)]
    assert sorted(non_dominated(points)) == [(0.5, 0.2), (1.0, 0.5), (2.0, 0.7)]


@pytest.mark.parametrize("predict", [gp_predict, linear_predict])
def test_the_quality_models_learn_a_linear_trend_and_are_unsure_far_from_it(predict):
    x = np.array([[0.0], [1.0], [2.0], [3.0], [4.0]])
    y = 0.1 + 0.05 * x[:, 0]
    mu, sd = predict(x, y, np.array([[2.0], [10.0]]))
    assert mu[0] == pytest.approx(0.2, abs=0.01)
    assert sd[1] > sd[0]


@pytest.fixture(scope="module")
def table():
    return json.loads((TABLES / "vit-cifar10-deep-head-tiny.json").read_text())


@pytest.mark.parametrize("workers", [1, 3])
def test_a_replayed_search_starts_cheapest_and_never_proposes_a_held_architecture(table, workers):
    search = simulation_search(table, space="deep-head", trials=12, sampler="cost", seed=0)
    assert search.sampler_name() == "cost" and len(search.cost_candidates) == 39
    cheapest = min(search.cost_candidates, key=lambda c: c.cost)
    r = replay(search, table, workers=workers)
    assert r.duplicates == 0 and r.trained == 12
    assert len({t["arch"] for t in r.trials}) == 12  # no architecture twice, running or finished
    first = r.trials[0]
    assert first["arch"] == "1-1-1-1 skip=scores fusion=none" and cheapest.cost == pytest.approx(2.80, abs=0.01)
    again = replay(simulation_search(table, space="deep-head", trials=12, sampler="cost", seed=0), table, workers=workers)
    assert [t["arch"] for t in again.trials] == [t["arch"] for t in r.trials]  # seeded: the same search


def test_the_cost_aware_sampler_needs_quality_and_time(table):
    from headsearch.errors import ConfigError

    with pytest.raises(ConfigError, match="searches accuracy x time"):  # when the search is defined, before any study
        simulation_search(table, space="deep-head", trials=4, sampler="cost", objectives=["accuracy", "params"])


@pytest.mark.processes
def test_search_quality_replays_the_cost_aware_sampler_and_the_oracle():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "benchmarks/search_quality.py", "--samplers", "cost,oracle", "--pruners",
                          "pareto", "--workers", "1", "--budgets", "12", "--seeds", "2", "--no-write"], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {cells[2]: cells for line in out.stdout.splitlines() if line.startswith("| 1 ")
            for cells in [[c.strip() for c in line.split("|")[1:-1]]]}
    assert set(rows) == {"cost", "oracle"}
    assert all(r[1] == "12" and r[4] == "2" and r[13] == "0.0" for r in rows.values())  # no duplicate proposal
    assert 0 < float(rows["cost"][5]) <= 1 and 0 < float(rows["oracle"][5]) <= 1


@pytest.mark.processes
def test_search_quality_replays_the_default_rule_paused_and_gives_the_time_to_quality():
    """`default` is what `headsearch run` uses (pareto here), `+pause` replays it with --pruner-pause; every row
    gives the simulated seconds to 0.85 and 0.90 of the true front's hypervolume."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "benchmarks/search_quality.py", "--pruners", "none,default,default+pause",
                          "--samplers", "default", "--workers", "4", "--budgets", "12", "--seeds", "2", "--no-write"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {cells[3]: cells for line in out.stdout.splitlines() if line.startswith("| 4 ")
            for cells in [[c.strip() for c in line.split("|")[1:-1]]]}
    assert set(rows) == {"none", "default", "default+pause"} and {r[2] for r in rows.values()} == {"default"}
    for r in rows.values():
        to85, to90 = (float("inf") if c == "never" else float(c) for c in r[14:16])
        assert 0 < to85 <= to90
