"""benchmarks/peers.py: MOASHA (Schmucker et al. 2021, arXiv 2106.12639) replayed by Syne Tune's simulator on a
table, scored with headsearch's own functions."""
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import peers  # noqa: E402

from headsearch.search.table import arch_key, load_table  # noqa: E402

TABLE = BENCH / "tables" / "vit-cifar10-deep-head-tiny.json"  # 39 architectures, 4 epochs, 3 seeds


@pytest.fixture(scope="module")
def table():
    pytest.importorskip("syne_tune")
    return load_table(TABLE)


def test_moasha_trains_the_budget_from_the_tables_own_runs(table):
    """Exactly `trials` trials, each between one epoch and the table's last, each reporting one of its
    architecture's seeds epoch by epoch; a front scored in (0, 1]; the same seed replays the same search."""
    trials, max_t = 12, table["epochs"]
    first = peers.replay_moasha(table, trials=trials, workers=4, seed=0)
    assert first.trained == trials == len(first.trials)
    assert trials <= first.epochs <= trials * max_t
    assert 0 < first.hypervolume <= 1 and 0 <= first.recall <= 1
    assert first.repeats == trials - len({t["key"] for t in first.trials})
    assert first.anytime and first.anytime[-1][1] == pytest.approx(first.hypervolume)
    rows = {arch_key(a["overrides"]): a for a in table["architectures"]}
    for curve in peers.moasha_curves(table, trials=trials, workers=4, seed=0, rungs=None, tick=peers.TICK):
        runs = rows[curve.key]["runs"]
        assert any([-v for v in r["curve"][:len(curve.losses)]] == curve.losses
                   and curve.elapsed == pytest.approx([(e + 1) * r["epoch_seconds"] for e in range(len(curve.losses))])
                   for r in runs)
    again = peers.replay_moasha(table, trials=trials, workers=4, seed=0)
    assert (again.epochs, again.seconds, again.front, again.anytime) == (first.epochs, first.seconds, first.front,
                                                                         first.anytime)


def test_moasha_without_rungs_trains_every_trial_to_the_end(table):
    """grace_period = max_t leaves MOASHA one rung, the last epoch: nothing is stopped early, so every trial trains
    max_t epochs, and the front is read from all of them."""
    trials, max_t = 10, table["epochs"]
    r = peers.replay_moasha(table, trials=trials, workers=3, seed=1, rungs=(max_t, 3))
    assert r.epochs == trials * max_t
    assert all(t["state"] == "COMPLETE" for t in r.trials)
    assert len(r.anytime) == trials


def test_ranked_rungs_judge_the_new_trial_by_its_own_place(table):
    """Three trials at a rung, each worse than the last, then one that dominates them all: Syne Tune 0.16's rung
    stops it (it reads the place of the worst trial); with `RankedPriority` it goes on, and one dominated by all
    is still stopped. If a Syne Tune release puts its rung right, the first assertion says so."""
    from syne_tune.optimizer.schedulers.asha import Bracket
    from syne_tune.optimizer.schedulers.multiobjective.multiobjective_priority import NonDominatedPriority

    def decisions(priority):
        rung = Bracket(1, 9, 3, 0, priority)
        for number, point in enumerate([(1, 1), (2, 2), (3, 3)]):
            rung.on_result(number, 1, dict(zip("ab", point)))
        return rung.on_result(3, 1, {"a": 0, "b": 0}), rung.on_result(4, 1, {"a": 9, "b": 9})

    assert decisions(NonDominatedPriority()) == ("STOP", "STOP")
    assert decisions(peers.syne_tune().RankedPriority()) == ("CONTINUE", "STOP")


def test_a_missing_syne_tune_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "syne_tune", None)  # import syne_tune now fails, as when not installed
    peers.syne_tune.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"^MOASHA needs Syne Tune: make peers \(pip install --no-deps syne-tune"):
            peers.replay_moasha({"epochs": 4}, trials=1, workers=1, seed=0)
    finally:
        peers.syne_tune.cache_clear()


def test_search_quality_names_its_peers():
    """`search_quality.py --peers`: as shipped, with headsearch's rungs, ranked; anything else one clear line."""
    import search_quality

    assert search_quality._peer("moasha") == ("moasha", None, False)
    assert search_quality._peer("moasha@3x3") == ("moasha@3x3", (3, 3), False)
    assert search_quality._peer("moasha-ranked@2") == ("moasha-ranked@2", (2, 3), True)
    with pytest.raises(SystemExit, match=r"--peers: unknown peer 'asha'"):
        search_quality._peer("asha")
