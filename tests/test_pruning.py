"""Learning-curve pruning: hand-worked median/percentile/rung decisions, a simulated search,
decision-for-decision agreement with Optuna's MedianPruner/PercentilePruner, which trials a trial is
compared with (`comparison_curves`), and Optuna's pruners built by `make_optuna_pruner`, judged by
their decisions on studies with known trials."""
import json
import math
from types import SimpleNamespace

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from headsearch.errors import ConfigError
from headsearch.search.pruning import (
    CurvePruner,
    MedianRule,
    PercentileRule,
    PruneDecision,
    RulePruner,
    RungRule,
    comparison_curves,
    comparison_trials,
    make_curve_pruner,
    make_optuna_pruner,
    pruner_names,
    rung_epochs,
)
from headsearch.search.study import StudyStorage

# make test-oldest runs this module on the floor: Optuna's pruners and their storage reads.
pytestmark = pytest.mark.floor

optuna.logging.set_verbosity(optuna.logging.WARNING)

FIVE = [0.1, 0.2, 0.3, 0.4, 0.5]


def others_at(epoch, values):
    """Finished trials with the given values at `epoch` (earlier epochs filled with junk 0.0)."""
    return [{**{e: 0.0 for e in range(1, epoch)}, epoch: v} for v in values]


# --------------------------------------------------------------------------------- median


def test_median_maximize_prunes_strictly_worse_best_so_far():
    rule = MedianRule("maximize")  # n_startup_trials 5, no warm-up
    others = others_at(3, FIVE)
    # median of [.1 .2 .3 .4 .5] = .3 (np.percentile(values, 100 - 50)); best so far .25 < .3: prune
    d = rule.decide(3, {1: 0.1, 2: 0.2, 3: 0.25}, others)
    assert (d.prune, d.rule, d.epoch, d.value, d.threshold, d.n_compared, d.note) == (
        True, "median", 3, 0.25, 0.3, 5, "")
    # tie: .3 is not strictly worse than .3: kept
    d = rule.decide(3, {1: 0.1, 2: 0.2, 3: 0.3}, others)
    assert not d.prune and d.threshold == 0.3 and d.value == 0.3
    # epoch-3 value .2, but .35 at epoch 2: best so far .35 >= .3: kept
    d = rule.decide(3, {1: 0.1, 2: 0.35, 3: 0.2}, others)
    assert not d.prune and d.value == 0.35 and d.threshold == 0.3


def test_median_minimize_mirror():
    rule = MedianRule("minimize")
    others = others_at(3, FIVE)
    # threshold np.percentile(values, 50) = .3; best so far (min) .35 > .3: prune
    d = rule.decide(3, {1: 0.5, 2: 0.4, 3: 0.35}, others)
    assert d.prune and d.value == 0.35 and d.threshold == 0.3 and d.n_compared == 5
    assert not rule.decide(3, {1: 0.5, 2: 0.4, 3: 0.3}, others).prune  # tie kept
    d = rule.decide(3, {1: 0.5, 2: 0.25, 3: 0.4}, others)  # best so far .25 <= .3: kept
    assert not d.prune and d.value == 0.25


def test_warmup_and_startup_notes():
    rule = MedianRule("maximize", n_startup_trials=2, n_warmup_epochs=2)
    others = [{1: 0.9, 2: 0.9, 3: 0.9}, {1: 0.8, 2: 0.8, 3: 0.8}]
    bad = {1: 0.0, 2: 0.0, 3: 0.0}
    for epoch in (1, 2):  # epochs 1..n_warmup_epochs are never judged
        d = rule.decide(epoch, {e: bad[e] for e in range(1, epoch + 1)}, others)
        assert not d.prune and d.threshold is None and d.note.startswith("warm-up")
        assert d.n_compared == 2
    d = rule.decide(3, bad, others)  # first epoch after the warm-up: median .85 > 0: prune
    assert d.prune and d.threshold == pytest.approx(0.85) and d.note == ""
    # one finished trial < n_startup_trials 2: no judgement
    d = rule.decide(3, bad, others[:1])
    assert not d.prune and d.threshold is None and d.note == "too few trials (1 < 2)"
    # two finished trials but only one has a value at epoch 3 (the other was pruned at epoch 2)
    d = rule.decide(3, bad, [others[0], {1: 0.1, 2: 0.1}])
    assert not d.prune and d.n_compared == 1 and "too few trials" in d.note and "(1 < 2)" in d.note
    # no finished trials at all (even with n_startup_trials 0)
    d = MedianRule("maximize", n_startup_trials=0).decide(1, {1: 0.0}, [])
    assert not d.prune and d.n_compared == 0 and "too few trials" in d.note


def test_nan():
    rule = MedianRule("maximize", n_startup_trials=1)
    others = others_at(2, [0.5])
    d = rule.decide(2, {1: math.nan, 2: math.nan}, others)  # nothing finite so far: prune
    assert d.prune and d.note == "value is NaN" and d.threshold is None
    assert d.reason()["value"] is None
    # a NaN after a finite value is judged on the best finite value (as Optuna's np.nanmax)
    d = rule.decide(2, {1: 0.7, 2: math.nan}, others)
    assert not d.prune and d.value == 0.7 and d.threshold == 0.5
    # NaN at the rung prunes the rung rule
    assert RungRule("maximize", n_startup_trials=1).decide(1, {1: math.nan}, others_at(1, [0.5])).prune


# ------------------------------------------------------------------------------ percentile


def test_percentile_25_maximize_boundary():
    rule = PercentileRule("maximize", percentile=25.0)
    others = others_at(3, FIVE)
    thr = float(np.percentile(FIVE, 75))  # maximize keeps the top 25%: the 75th percentile, .4
    assert thr == 0.4
    d = rule.decide(3, {1: 0.0, 2: 0.0, 3: thr}, others)
    assert not d.prune and d.threshold == thr and d.rule == "percentile"
    below = float(np.nextafter(thr, -np.inf))  # the largest float below .4 is pruned
    d = rule.decide(3, {1: 0.0, 2: 0.0, 3: below}, others)
    assert d.prune and d.threshold == thr and d.value == below


def test_percentile_25_minimize_boundary():
    rule = PercentileRule("minimize", percentile=25.0)
    others = others_at(3, FIVE)
    thr = float(np.percentile(FIVE, 25))  # .2
    assert thr == 0.2
    assert not rule.decide(3, {3: thr}, others).prune
    assert rule.decide(3, {3: float(np.nextafter(thr, np.inf))}, others).prune


def test_interval_epochs_follow_optunas_rule():
    # W = 1, I = 2: judged epochs are 2, 4, 6 (first epoch after the warm-up, then every 2)
    rule = MedianRule("maximize", n_startup_trials=1, n_warmup_epochs=1, interval_epochs=2)
    others = [{e: 1.0 for e in range(1, 8)}]
    curve = {e: 0.0 for e in range(1, 8)}
    judged = [e for e in range(1, 8) if rule.decide(e, {k: curve[k] for k in range(1, e + 1)}, others).prune]
    assert judged == [2, 4, 6]
    d = rule.decide(3, {1: 0.0, 2: 0.0, 3: 0.0}, others)
    assert d.note.startswith("not a check epoch")
    # a curve that skipped the check at epoch 4 is checked at its next epoch, 5 (Optuna's postponement)
    assert rule.decide(5, {1: 0.0, 2: 0.0, 3: 0.0, 5: 0.0}, others).prune


# ---------------------------------------------------------------------------------- rungs


def test_rungs():
    rule = RungRule("maximize")  # min_epochs 1, reduction_factor 3
    assert [e for e in range(1, 30) if rule.is_rung(e)] == [1, 3, 9, 27]
    assert [e for e in range(1, 20) if RungRule("maximize", min_epochs=2, reduction_factor=2).is_rung(e)] == [2, 4, 8, 16]
    # The one schedule the report, the audit and the notes list agrees with the rule's own test.
    for m, r in [(1, 3), (2, 2), (3, 3), (4, 2)]:
        assert rung_epochs(m, r, 40) == [e for e in range(1, 40) if RungRule("maximize", m, r).is_rung(e)]
    assert rung_epochs(3, 3, 27) == [3, 9]  # a trial's last epoch is never a rung
    assert rung_epochs(3, 3, 3) == []


def test_rung_maximize():
    rule = RungRule("maximize", min_epochs=1, reduction_factor=3)
    others = others_at(3, FIVE)
    # epoch 2 is not a rung: never prunes, even the worst value
    d = rule.decide(2, {1: 0.0, 2: 0.0}, others_at(2, FIVE))
    assert not d.prune and d.note == "not a rung" and d.threshold is None and d.n_compared == 5
    # rung 3, n = 5 others: the top ceil(6/3) = 2 of the 6 are kept.
    # .45: ranking .5, .45, .4, ... -> 2nd: kept; threshold = 2nd best of the 6 = .45 itself
    d = rule.decide(3, {1: 0.0, 2: 0.0, 3: 0.45}, others)
    assert (d.prune, d.rule, d.value, d.threshold, d.n_compared) == (False, "asha", 0.45, 0.45, 5)
    # .35: ranking .5, .4, .35, ... -> 3rd: pruned; threshold = 2nd best = .4
    d = rule.decide(3, {1: 0.0, 2: 0.0, 3: 0.35}, others)
    assert (d.prune, d.threshold) == (True, 0.4)
    # tie with the 2nd best (.4) goes to the trial: ranking .5, .4 (self), .4: kept
    d = rule.decide(3, {1: 0.0, 2: 0.0, 3: 0.4}, others)
    assert not d.prune and d.threshold == 0.4
    # the value AT the rung is judged, not the best so far
    assert rule.decide(3, {1: 0.9, 2: 0.9, 3: 0.35}, others).prune


def test_rung_minimize_mirror():
    rule = RungRule("minimize", min_epochs=1, reduction_factor=3)
    others = others_at(3, FIVE)
    # best first: .1, .2, ...; top 2 kept. .15 -> 2nd: kept (threshold .15); .25 -> 3rd: pruned (threshold .2)
    d = rule.decide(3, {3: 0.15}, others)
    assert not d.prune and d.threshold == 0.15
    d = rule.decide(3, {3: 0.25}, others)
    assert d.prune and d.threshold == 0.2
    assert not rule.decide(3, {3: 0.2}, others).prune  # tie kept


def test_rung_startup():
    rule = RungRule("maximize")  # n_startup_trials 3
    d = rule.decide(1, {1: 0.0}, others_at(1, [0.5, 0.6]))
    assert not d.prune and d.note == "too few trials (2 < 3)" and d.n_compared == 2


# ----------------------------------------------------------------------- simulated search


def run_search(rule, curves):
    """Trials in order, each seeing the finished trials' curves (pruned ones truncated at the
    pruning epoch), as the search does. Returns each trial's pruning reason() or None."""
    finished, outcomes = [], []
    for values in curves:
        seen, reason = {}, None
        for epoch, v in enumerate(values, start=1):
            seen[epoch] = v
            d = rule.decide(epoch, dict(seen), finished)
            if d.prune:
                reason = d.reason()
                break
        finished.append(seen)
        outcomes.append(reason)
    return outcomes


def test_search_sequence_median():
    # accuracy in %, maximize; startup 2 trials with a value at the epoch, epoch 1 is warm-up
    rule = MedianRule("maximize", n_startup_trials=2, n_warmup_epochs=1)
    curves = [
        [20, 40, 50, 60],  # T0: no finished trials -> never judged, completes
        [30, 50, 60, 70],  # T1: 1 finished trial < 2 -> never judged, completes
        [25, 30, 35, 40],  # T2: e2 others [40, 50] median 45, best 30 < 45 -> pruned at 2
        [10, 45, 55, 62],  # T3: e1 warm-up (10 would lose); e2 [40,50,30] median 40, best 45 kept;
                           #     e3 [50,60] (T2 stopped at 2) median 55, best 55 tie kept;
                           #     e4 [60,70] median 65, best 62 < 65 -> pruned at 4
        [70, 40, 45, 50],  # T4: e2 [40,50,30,45] median 42.5, current 40 but best 70 -> kept;
                           #     e3 [50,60,55] median 55; e4 [60,70,62] median 62; best 70 -> completes
        [35, 42, 58, 61],  # T5: e2 [40,50,30,45,40] median 40, best 42; e3 [50,60,55,45] median 52.5,
                           #     best 58; e4 [60,70,62,50] median 61, best 61 tie -> completes
    ]
    out = run_search(rule, [[float(v) for v in c] for c in curves])
    assert out[0] is None and out[1] is None and out[4] is None and out[5] is None
    assert out[2] == dict(prune=True, rule="median", epoch=2, value=30.0, threshold=45.0, n_compared=2, note="")
    assert out[3] == dict(prune=True, rule="median", epoch=4, value=62.0, threshold=65.0, n_compared=2, note="")


def test_search_sequence_rungs():
    # maximize; rungs at 1, 2, 4 (min_epochs 1, reduction_factor 2); judged once 1 other reached the rung
    rule = RungRule("maximize", min_epochs=1, reduction_factor=2, n_startup_trials=1)
    curves = [
        [10, 20, 30, 40],  # T0: no others at any rung -> completes
        [5, 25, 35, 45],   # T1: e1 others [10], keep ceil(2/2)=1; 10 better -> pruned at 1, threshold 10
        [15, 18, 50, 60],  # T2: e1 [10,5], keep 2: ranking 15,10,5 kept; e2 [20] (T1 stopped), keep 1:
                           #     20 > 18 -> pruned at 2, threshold 20 (its later 50, 60 never seen)
        [12, 22, 24, 41],  # T3: e1 [10,5,15] keep 2: 15,12 kept; e2 [20,18] keep 2: best, kept;
                           #     e3 not a rung; e4 [40] keep 1: 41 best -> completes
        [10, 21, 30, 40],  # T4: e1 [10,5,15,12] keep 3: 15,12,10(self, tie in its favour) kept;
                           #     e2 [20,18,22] keep 2: 22,21 kept; e4 [40,41] keep 2: 41,40(self) -> completes
        [11, 19, 45, 50],  # T5: e1 [10,5,15,12,10] keep 3: 15,12,11 kept; e2 [20,18,22,21] keep
                           #     ceil(5/2)=3: 22,21,20 better than 19 -> pruned at 2, threshold 20
    ]
    out = run_search(rule, [[float(v) for v in c] for c in curves])
    assert [o is None for o in out] == [True, False, False, True, True, False]
    assert out[1] == dict(prune=True, rule="asha", epoch=1, value=5.0, threshold=10.0, n_compared=1, note="")
    assert out[2] == dict(prune=True, rule="asha", epoch=2, value=18.0, threshold=20.0, n_compared=1, note="")
    assert out[5] == dict(prune=True, rule="asha", epoch=2, value=19.0, threshold=20.0, n_compared=4, note="")


def test_reason_is_json():
    d = PruneDecision(True, "median", 3, math.nan, None, 0, "value is NaN")
    r = d.reason()
    assert r == dict(prune=True, rule="median", epoch=3, value=None, threshold=None, n_compared=0, note="value is NaN")
    json.dumps(r, allow_nan=False)
    d = MedianRule("maximize").decide(3, {3: 0.25}, others_at(3, FIVE))
    assert json.loads(json.dumps(d.reason(), allow_nan=False)) == d.reason()
    assert type(d.reason()["threshold"]) is float and type(d.reason()["prune"]) is bool


# -------------------------------------------------------------------- agreement with Optuna

EPOCHS = 6


def random_curve(rng):
    """A curve over EPOCHS epochs; values from a coarse grid (many ties) or continuous, now and then
    NaN, and now and then an epoch missing (to exercise counts and postponed interval checks)."""
    coarse = rng.random() < 0.5
    curve = {}
    for e in range(1, EPOCHS + 1):
        if e > 1 and rng.random() < 0.1:
            continue
        v = float(rng.integers(0, 6)) / 4 if coarse else float(rng.random())
        curve[e] = math.nan if rng.random() < 0.05 else v
    return curve


def agree(study, rule, rng, n_trials):
    """Report random curves to `study` and compare should_prune() with rule.decide() at every epoch.
    Every trial is then told COMPLETE (Optuna compares with COMPLETE trials only)."""
    finished, n_judged = [], [0, 0]
    for _ in range(n_trials):
        curve = random_curve(rng)
        trial = study.ask()
        seen = {}
        for epoch, v in curve.items():
            trial.report(v, epoch)
            seen[epoch] = v
            ours = rule.decide(epoch, dict(seen), finished)
            theirs = trial.should_prune()
            assert theirs == ours.prune, (epoch, seen, finished, ours)
            n_judged[ours.prune] += ours.threshold is not None or ours.prune
        study.tell(trial, 0.0)
        finished.append(seen)
    return n_judged


NAN_WARNING = "ignore:All-NaN slice encountered:RuntimeWarning"  # Optuna's np.nanmax on an all-NaN curve


@pytest.mark.filterwarnings(NAN_WARNING)
@pytest.mark.parametrize("direction", ["maximize", "minimize"])
@pytest.mark.parametrize(
    "name, kw",
    [
        ("median", {}),
        ("median", dict(n_startup_trials=3, n_warmup_epochs=2)),
        ("percentile", dict(percentile=25.0, n_startup_trials=2, n_warmup_epochs=1)),
        ("percentile", dict(percentile=70.0, n_startup_trials=0)),
    ],
)
def test_agrees_with_optuna(direction, name, kw):
    rng = np.random.default_rng([len(name), len(kw), direction == "maximize"])
    study = optuna.create_study(direction=direction, pruner=make_optuna_pruner(name, epochs=EPOCHS, **kw))
    rule = make_curve_pruner(name, direction, **kw)
    kept, pruned = agree(study, rule, rng, n_trials=30)
    assert kept >= 20 and pruned >= 3  # both outcomes were judged, not just skipped


@pytest.mark.filterwarnings(NAN_WARNING)
@pytest.mark.parametrize("direction", ["maximize", "minimize"])
@pytest.mark.parametrize("warmup, interval", [(0, 2), (1, 3)])
def test_interval_agrees_with_optuna(direction, warmup, interval):
    rng = np.random.default_rng([warmup, interval, direction == "maximize"])
    pruner = optuna.pruners.PercentilePruner(
        40.0, n_startup_trials=2, n_warmup_steps=warmup + 1, interval_steps=interval, n_min_trials=2)
    study = optuna.create_study(direction=direction, pruner=pruner)
    rule = PercentileRule(direction, 40.0, n_startup_trials=2, n_warmup_epochs=warmup, interval_epochs=interval)
    kept, pruned = agree(study, rule, rng, n_trials=30)
    assert kept >= 10 and pruned >= 3


# -------------------------------------------------------------------------------- factories


def test_make_curve_pruner():
    assert pruner_names() == ("pareto", "median", "percentile", "asha", "hyperband", "multi-metric", "none")
    assert make_curve_pruner("none", "maximize") is None
    with pytest.raises(ConfigError, match="unknown pruner 'x': use one of pareto, median, percentile, asha, hyperband, multi-metric, none"):
        make_curve_pruner("x", "maximize")
    m = make_curve_pruner("median", "minimize")
    assert isinstance(m, MedianRule) and isinstance(m, CurvePruner) and m.rule == "median"
    assert (m.direction, m.percentile, m.n_startup_trials, m.n_warmup_epochs, m.interval_epochs) == ("minimize", 50.0, 5, 0, 1)
    p = make_curve_pruner("percentile", "maximize", percentile=10.0, n_startup_trials=2, n_warmup_epochs=3)
    assert type(p) is PercentileRule and (p.percentile, p.n_startup_trials, p.n_warmup_epochs) == (10.0, 2, 3)
    assert make_curve_pruner("percentile", "maximize").percentile == 25.0
    h = make_curve_pruner("asha", "maximize", min_epochs=2, reduction_factor=4, n_warmup_epochs=5)
    assert isinstance(h, RungRule) and (h.min_epochs, h.reduction_factor, h.n_startup_trials) == (2, 4, 3)
    assert h.rule == "asha"
    # hyperband is Optuna's multi-bracket pruner, for one objective: with several, one line naming asha
    with pytest.raises(ConfigError, match="^--pruner hyperband is Optuna's multi-bracket HyperbandPruner, for one"
                                          " objective: with several use asha"):
        make_curve_pruner("hyperband", "maximize")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: MedianRule("max"), "direction 'max' is not known: use one of maximize, minimize"),
        (lambda: make_curve_pruner("median", "up"), "direction 'up'"),
        (lambda: PercentileRule("maximize", percentile=101), "percentile must be"),
        (lambda: MedianRule("maximize", n_warmup_epochs=-1), "n_warmup_epochs must be an integer >= 0"),
        (lambda: MedianRule("maximize", interval_epochs=0), "interval_epochs must be an integer >= 1"),
        (lambda: RungRule("maximize", reduction_factor=1), "reduction_factor must be an integer >= 2"),
        (lambda: RungRule("maximize", min_epochs=0), "min_epochs must be an integer >= 1"),
        (lambda: make_optuna_pruner("hyperband", epochs=2, min_epochs=3), "epochs >= min_epochs"),
        (lambda: make_optuna_pruner("asha", epochs=2, reduction_factor=1), "reduction_factor must be an integer >= 2"),
        (lambda: make_optuna_pruner("pareto", epochs=2), "percentile, asha, hyperband or none"),
        (lambda: make_optuna_pruner("nope", epochs=2), "unknown pruner 'nope'"),
    ],
)
def test_bad_configs(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def study_with(curves, direction="maximize", pruner=None, name="known"):
    """An in-memory single-objective study holding one COMPLETE trial per curve ({step: value})."""
    study = optuna.create_study(direction=direction, pruner=pruner, study_name=name)
    for curve in curves:
        study.add_trial(optuna.trial.create_trial(value=0.0, intermediate_values=curve))
    return study


def judged(study, curve) -> list[bool]:
    """Ask a trial of `study`, report `curve` step by step; its should_prune() after each step."""
    trial = study.ask()
    out = []
    for step, value in curve.items():
        trial.report(value, step)
        out.append(trial.should_prune())
    return out


def test_make_optuna_pruner_median_warmup_startup_and_min_trials():
    def pruner():
        return make_optuna_pruner("median", epochs=4, n_startup_trials=3, n_warmup_epochs=2)

    assert isinstance(pruner(), optuna.pruners.MedianPruner)
    good = {1: 0.9, 2: 0.9, 3: 0.9, 4: 0.9}
    bad = {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}
    # 3 complete trials: epochs 1..2 are the warm-up (Optuna's n_warmup_steps 3); epoch 3 is judged.
    assert judged(study_with([good] * 3, pruner=pruner()), bad) == [False, False, True, True]
    # 2 complete trials < n_startup_trials 3: never judged
    assert judged(study_with([good] * 2, pruner=pruner()), bad) == [False] * 4
    # 3 complete trials but only 2 reached epoch 3: too few values there (n_min_trials 3); all 3 at epoch 4
    short = {1: 0.9, 2: 0.9, 4: 0.9}
    assert judged(study_with([good, good, short], pruner=pruner()), bad) == [False, False, False, True]
    # a tie with the median is kept
    assert judged(study_with([good] * 3, pruner=pruner()), good) == [False] * 4


def test_make_optuna_pruner_percentile_defaults():
    pruner = make_optuna_pruner("percentile", epochs=4)  # percentile 25, 5 startup trials, no warm-up
    assert type(pruner) is optuna.pruners.PercentilePruner
    five = [{1: v} for v in FIVE]  # maximize keeps the top 25%: threshold np.percentile(FIVE, 75) = .4
    assert judged(study_with(five, pruner=pruner), {1: 0.39}) == [True]  # epoch 1 is judged: no warm-up
    assert judged(study_with(five, pruner=pruner), {1: 0.4}) == [False]
    assert judged(study_with(five[:4], pruner=pruner), {1: 0.0}) == [False]  # 4 < 5 startup trials
    minimize = make_optuna_pruner("percentile", epochs=4, percentile=25.0)  # minimize: threshold .2
    assert judged(study_with(five, "minimize", minimize), {1: 0.21}) == [True]
    assert judged(study_with(five, "minimize", minimize), {1: 0.2}) == [False]


def same_decisions(ours, reference, direction, seed, n_trials=40, epochs=9):
    """Run the same random curves through two single-objective studies of the same name, one with
    each pruner; assert every should_prune() agrees. Returns how many trials were pruned."""
    rng = np.random.default_rng(seed)
    a = optuna.create_study(direction=direction, pruner=ours, study_name="same")
    b = optuna.create_study(direction=direction, pruner=reference, study_name="same")
    pruned = 0
    for _ in range(n_trials):
        ta, tb = a.ask(), b.ask()
        state = TrialState.COMPLETE
        for epoch in range(1, epochs + 1):
            v = float(rng.random())
            ta.report(v, epoch)
            tb.report(v, epoch)
            da, db = ta.should_prune(), tb.should_prune()
            assert da == db, (ta.number, epoch)
            if da:
                state = TrialState.PRUNED
                break
        pruned += state == TrialState.PRUNED
        for study, trial in ((a, ta), (b, tb)):
            study.tell(trial, 0.0 if state == TrialState.COMPLETE else None, state=state)
    return pruned


@pytest.mark.parametrize("direction", ["maximize", "minimize"])
def test_make_optuna_pruner_hyperband_is_optunas_with_our_rungs(direction):
    """Optuna's HyperbandPruner with min_resource = min_epochs, max_resource = the epochs, and the
    reduction factor (default 3): decision for decision."""
    ours = make_optuna_pruner("hyperband", epochs=9, min_epochs=1, reduction_factor=3)
    assert isinstance(ours, optuna.pruners.HyperbandPruner)
    reference = optuna.pruners.HyperbandPruner(min_resource=1, max_resource=9, reduction_factor=3)
    assert same_decisions(ours, reference, direction, seed=1) >= 5
    default = make_optuna_pruner("hyperband", epochs=9)
    reference = optuna.pruners.HyperbandPruner(min_resource=1, max_resource=9, reduction_factor=3)
    assert same_decisions(default, reference, direction, seed=2) >= 5
    # ... and not the decisions of another reduction factor or budget
    with pytest.raises(AssertionError):
        same_decisions(make_optuna_pruner("hyperband", epochs=9, reduction_factor=2),
                       optuna.pruners.HyperbandPruner(min_resource=1, max_resource=9, reduction_factor=3), direction, seed=1)
    with pytest.raises(AssertionError):
        same_decisions(make_optuna_pruner("hyperband", epochs=3),
                       optuna.pruners.HyperbandPruner(min_resource=1, max_resource=9, reduction_factor=3), direction, seed=1)


@pytest.mark.parametrize("direction", ["maximize", "minimize"])
@pytest.mark.parametrize("kw", [dict(n_startup_trials=1, reduction_factor=2), dict(n_startup_trials=3),
                                dict(min_epochs=2, reduction_factor=2, n_startup_trials=0)])
def test_asha_with_one_objective_is_the_rung_rule(direction, kw):
    """`--pruner asha` with one objective: Optuna's should_prune decides exactly as `RungRule` does with
    several objectives, on the same trials (COMPLETE and PRUNED: `comparison_curves`)."""
    pruner = make_optuna_pruner("asha", epochs=9, **kw)
    assert isinstance(pruner, RulePruner) and pruner.rule.rule == "asha"
    rule = make_curve_pruner("asha", direction, **kw)
    rng = np.random.default_rng(len(kw))
    study = optuna.create_study(direction=direction, pruner=pruner)
    pruned = kept = 0
    for _ in range(30):
        trial = study.ask()
        curve: dict[int, float] = {}
        state = TrialState.COMPLETE
        for epoch in range(1, 10):
            curve[epoch] = float(rng.random())
            trial.report(curve[epoch], epoch)
            others = comparison_curves(study.get_trials(deepcopy=False), "asha", trial.number)
            expected = rule.decide(epoch, curve, others)
            assert trial.should_prune() == expected.prune, (trial.number, epoch)
            assert pruner.last == expected
            if expected.prune:
                state = TrialState.PRUNED
                break
            kept += expected.threshold is not None
        pruned += state == TrialState.PRUNED
        study.tell(trial, 0.0 if state == TrialState.COMPLETE else None, state=state)
    assert pruned >= 5 and kept >= 5  # both outcomes were judged


def test_make_optuna_pruner_none():
    pruner = make_optuna_pruner("none", epochs=4)
    assert isinstance(pruner, optuna.pruners.NopPruner)
    assert judged(study_with([{1: 0.9}] * 5, pruner=pruner), {1: 0.0}) == [False]


# ----------------------------------------------------------------- which trials are compared


def known_trials(directions=("maximize", "minimize")):
    """A multi-objective study: three complete trials at .5, .6, .7 on epoch 1, a trial pruned at epoch 1
    with a terrible 0.0, a rejected trial (PRUNED, no values), and the running trial judged (number 5)."""
    study, running, _ = known_trials_stored(directions)
    return study, running


def known_trials_stored(directions=("maximize", "minimize")):
    """`known_trials`, and the study's `StudyStorage` (a multi-objective TrialPruning writes through it)."""
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, directions=list(directions))
    for v in (0.5, 0.6, 0.7):
        study.add_trial(optuna.trial.create_trial(state=TrialState.COMPLETE, values=[v, 10.0],
                                                  intermediate_values={1: v, 2: v}))
    study.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED, intermediate_values={1: 0.0},
                                              user_attrs={"pruned": {"rule": "median", "epoch": 1}}))
    study.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED, user_attrs={"rejected": "heads"}))
    running = study.ask()
    return study, running, StudyStorage(storage, study.study_name)


def test_comparison_curves_pick_complete_trials_for_median_and_percentile():
    study, running = known_trials()
    trials = study.get_trials(deepcopy=False)
    complete = [{1: 0.5, 2: 0.5}, {1: 0.6, 2: 0.6}, {1: 0.7, 2: 0.7}]
    assert comparison_curves(trials, "median", running.number) == complete
    assert comparison_curves(trials, "percentile", running.number) == complete
    # with the pruned trial: complete ones and the pruned one, not the rejected one nor the trial judged
    assert comparison_curves(trials, "asha", running.number) == [*complete, {1: 0.0}]
    # trial 3 (the pruned one) not against itself; the running trial 5 (no epoch yet) is among them
    assert comparison_curves(trials, "asha", 3) == [*complete, {}]
    with pytest.raises(ConfigError, match="pruner 'none' compares no trials itself"):
        comparison_curves(trials, "none", running.number)
    with pytest.raises(ConfigError, match="unknown pruner 'x'"):
        comparison_curves(trials, "x", running.number)


def test_the_rung_rules_judge_against_running_trials_the_percentile_rules_do_not():
    # Asynchronous successive halving (Li et al. 2020) ranks a trial among every trial that reached the rung:
    # with 8 workers the first 8 trials are all running when they reach it, and would otherwise go unjudged.
    study, running, store = known_trials_stored()
    store.set_intermediate_value(running.number, 1, 0.9)  # running, at epoch 1 of 2
    trials = study.get_trials(deepcopy=False)
    complete = [{1: 0.5, 2: 0.5}, {1: 0.6, 2: 0.6}, {1: 0.7, 2: 0.7}]
    for rule in ("asha", "pareto", "multi-metric"):
        assert [t.number for t in comparison_trials(trials, rule, 99)] == [0, 1, 2, 3, 5]
    assert comparison_curves(trials, "asha", 99) == [*complete, {1: 0.0}, {1: 0.9}]
    assert comparison_curves(trials, "median", 99) == complete
    # So a new trial is ranked behind the running 0.9 too: asha with r = 2 keeps the top ceil(6 / 2) = 3 of the
    # six. 0.65 is 3rd (0.9, 0.7 ahead): kept. 0.55 is 4th (0.9, 0.7, 0.6 ahead): pruned, the 3rd best 0.6 its
    # threshold. Without the running trial it would be 3rd of five (top ceil(5 / 2) = 3) and kept.
    rule = RungRule("maximize", min_epochs=1, reduction_factor=2, n_startup_trials=4)
    others = comparison_curves(trials, "asha", 99)
    assert not rule.decide(1, {1: 0.65}, others).prune
    d = rule.decide(1, {1: 0.55}, others)
    assert (d.prune, d.threshold, d.n_compared) == (True, 0.6, 5)
    assert not rule.decide(1, {1: 0.55}, others[:-1]).prune


def test_a_pruned_trials_curve_does_not_move_the_median_but_counts_at_a_rung():
    study, running = known_trials()
    trials = study.get_trials(deepcopy=False)
    curve = {1: 0.55}

    # Median of the complete trials (.5 .6 .7) is .6: .55 is pruned. With the pruned trial's 0.0 among
    # them the median would be .55 and the trial kept: the pruned curve takes no part.
    median = MedianRule("maximize", n_startup_trials=3)
    d = median.decide(1, curve, comparison_curves(trials, "median", running.number))
    assert (d.prune, d.threshold, d.n_compared) == (True, 0.6, 3)
    assert not median.decide(1, curve, [*comparison_curves(trials, "median", running.number), {1: 0.0}]).prune
    # ... as Optuna's MedianPruner decides on the same trials (it reads the COMPLETE trials only)
    single = optuna.create_study(direction="maximize", pruner=make_optuna_pruner("median", epochs=2, n_startup_trials=3))
    for t in trials:
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            single.add_trial(optuna.trial.create_trial(state=t.state, value=t.values[0] if t.values else None,
                                                       intermediate_values=t.intermediate_values, user_attrs=t.user_attrs))
    assert judged(single, curve) == [True]

    # At rung 1 (reduction factor 2) the pruned trial reached the rung and counts: 4 others, the top
    # ceil(5/2) = 3 are kept, and .55 is third (.7, .6, .55, .5, 0). Without it: top 2 of 4, .55 pruned.
    rung = RungRule("maximize", min_epochs=1, reduction_factor=2, n_startup_trials=1)
    d = rung.decide(1, curve, comparison_curves(trials, "asha", running.number))
    assert (d.prune, d.n_compared, d.threshold) == (False, 4, 0.55)
    assert rung.decide(1, curve, comparison_curves(trials, "median", running.number)).prune


@pytest.mark.parametrize("rule, pruned", [("median", True), ("asha", False)])
def test_the_search_callback_judges_against_comparison_curves(rule, pruned):
    """TrialPruning, the trainer callback of a multi-objective search, on the same study: it stores the
    epoch's value through the storage and judges it against `comparison_curves`."""
    from headsearch.search.runner import TrialPruning
    from headsearch.training.trainer import Callback

    study, running, store = known_trials_stored()
    kw = dict(n_startup_trials=1, reduction_factor=2) if rule == "asha" else dict(n_startup_trials=3)
    callback = TrialPruning(study, running, "bleu", make_curve_pruner(rule, "maximize", **kw), rule, single_objective=False,
                            store=store)
    assert isinstance(callback, Callback)
    record = SimpleNamespace(epoch=1, metrics={"bleu": 0.55}, epoch_seconds_alone=2.5, params=1000)
    if pruned:
        with pytest.raises(optuna.TrialPruned):
            callback.on_epoch_end(record)
        assert running.user_attrs["pruned"]["threshold"] == 0.6 and running.user_attrs["pruned"]["n_compared"] == 3
    else:
        callback.on_epoch_end(record)
        assert "pruned" not in running.user_attrs
    assert study.trials[running.number].intermediate_values == {1: 0.55}
    assert running.user_attrs["epoch_seconds_alone"] == 2.5  # the fair clock's measure, kept even when pruned


def test_the_last_epoch_is_recorded_but_never_pruned():
    """The same curve that the median rule prunes at epoch 1 of a longer trial is kept when epoch 1 is the
    trial's last: the epoch is trained already, and pruning would only discard its objectives."""
    from headsearch.search.runner import TrialPruning

    study, running, store = known_trials_stored()
    callback = TrialPruning(study, running, "bleu", make_curve_pruner("median", "maximize", n_startup_trials=3), "median",
                            single_objective=False, epochs=1, store=store)
    callback.on_epoch_end(SimpleNamespace(epoch=1, metrics={"bleu": 0.55}, epoch_seconds_alone=None, params=None))
    assert "pruned" not in running.user_attrs and "epoch_seconds_alone" not in running.user_attrs
    assert study.trials[running.number].intermediate_values == {1: 0.55}
