"""Search quality: listing a space, duplicate proposals, exhausted spaces, the Pareto pruning rule, tables and
the simulator that replays a search against a table with the search's own code.

The real searches here train the tiny translation model of conftest.py (a fraction of a second a trial) on
the real English-Spanish corpus; the simulator's check is that a replay makes exactly the decisions of a
real run whose curves it is given.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from headsearch.errors import ConfigError
from headsearch.search.pruning import (MultiMetricRule, curve_noise, ParetoRule, Progress, make_curve_pruner, make_optuna_pruner,
                                      non_dominated_ranks)
from headsearch.search.runner import Search, SearchSettings, config_key
from headsearch.search.trial_life import TrialLife
from headsearch.search.simulate import hypervolume, replay, simulation_search, true_points
from headsearch.search.space import enumerate_params, load_space
from headsearch.search.table import arch_key, load_table, overrides_of, write_table

TASK = "translation-en-es"


def write_space(path: Path, tiny: dict, *, schedule, skip=("none",), fusion=("none",), epochs=3, ranges=None) -> Path:
    fixed = json.loads(json.dumps(tiny))
    fixed["train"] = {"epochs": epochs, "max_steps_per_epoch": 10}
    d = {"schedule": schedule, "skip": list(skip), "fusion": list(fusion), "fixed": fixed}
    if ranges:
        d["ranges"] = ranges
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def settings(tmp_path: Path, spa_file: Path, space: Path, **kw) -> SearchSettings:
    base = dict(task=TASK, space=str(space), storage=f"sqlite:///{tmp_path / 'h.db'}", study="s", data_file=str(spa_file),
                run_root=str(tmp_path / "runs"), device="cpu", heartbeat=0)
    return SearchSettings(**{**base, **kw})


def load(url: str, name: str = "s") -> optuna.Study:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return optuna.load_study(study_name=name, storage=url)


# ------------------------------------------------------------------------------ listing a space


def test_enumerate_params_walks_every_branch_of_a_sampling():
    def sample(trial):
        family = trial.suggest_categorical("family", ["a", "b"])
        if family == "a":
            trial.suggest_categorical("x", [1, 2, 3])
        else:
            trial.suggest_int("y", 0, 4, step=2)
        trial.suggest_categorical("z", [True, False])

    got = enumerate_params(sample)
    want = [{"family": "a", "x": x, "z": z} for x in (1, 2, 3) for z in (True, False)]
    want += [{"family": "b", "y": y, "z": z} for y in (0, 2, 4) for z in (True, False)]
    assert got == want
    assert enumerate_params(lambda t: t.suggest_float("lr", 1e-4, 1e-2)) is None
    assert enumerate_params(lambda t: t.suggest_int("n", 1, 10**6)) is None  # more points than worth listing


def test_a_space_lists_its_distinct_architectures(tmp_path, spa_file, tiny_translation):
    # uniform 1 = halving from 1 = doubling to 1: one architecture; d_model 32 takes every head count here.
    space = write_space(tmp_path / "s.yaml", tiny_translation,
                        schedule={"families": ["uniform", "halving", "doubling"], "heads": [1, 2]}, skip=("none", "output"))
    search = Search(settings(tmp_path, spa_file, space, trials=50))
    archs = search.archs.listing()
    layers = search.base.arch.enc_layers
    schedules = {tuple(json.loads(k)["arch"]["enc_heads"]) for k in archs}
    assert schedules == {(1,) * layers, (2,) * layers, (2,) + (1,) * (layers - 1), (1,) * (layers - 1) + (2,)}
    assert len(archs) == 4 * 2  # x two skips
    assert search.archs.trial_target() == 8
    assert search.archs.space_line() == ("space s holds 8 distinct architectures, fewer than --trials 50: each is trained once"
                                   " and the search ends")
    assert Search(settings(tmp_path, spa_file, space, trials=8)).archs.space_line() is None
    ranged = write_space(tmp_path / "r.yaml", tiny_translation, schedule={"heads": [1, 2]}, ranges={"lr": {"low": 1e-4, "high": 1e-2}})
    assert Search(settings(tmp_path, spa_file, ranged)).archs.listing() is None


def test_the_deep_head_space_on_the_tiny_vit_holds_39_architectures():
    search = Search(SearchSettings(task="vit-cifar10", space="deep-head", preset="tiny", device="cpu"))
    assert len(search.archs.listing()) == 39  # issue 23: 3 families x 5 head counts dividing 48 x 3 skips, less 6 repeats


# ----------------------------------------------------------------- duplicates and an exhausted space


@pytest.mark.floor
def test_duplicates_are_neither_trained_nor_counted_and_an_exhausted_space_ends_the_study(tmp_path):
    """On the simulator's table backend: the same scheduler and loop as a real search, trials looked up."""
    import random

    from headsearch.search.runner import DUPLICATE_ASKS
    from headsearch.search.simulate import TableCohort
    from headsearch.search.snapshot import count_states

    table = load_table(Path(__file__).resolve().parents[1] / "benchmarks" / "tables" / "vit-cifar10-deep-head-tiny.json")
    space = tmp_path / "s.yaml"
    space.write_text(yaml.safe_dump({"schedule": {"families": ["uniform"], "heads": [1, 2, 4]},
                                     "skip": ["none"], "fusion": ["none"]}))
    sim = simulation_search(table, space=str(space), trials=5, sampler="random", pruner="none")
    assert len(sim.archs.listing()) == 3
    result = replay(sim, table)
    trained = [r for r in result.trials if r["state"] == "COMPLETE"]
    dups = [r for r in result.trials if r["state"] == "FAIL"]
    # The space held 3: each trained once, and the study ended there although --trials asked for 5.
    assert sorted(r["arch"] for r in trained) == sorted({r["arch"] for r in trained}) and len(trained) == 3
    assert dups and len(trained) + len(dups) == len(result.trials) and result.duplicates == len(dups)
    for d in dups:  # every other proposal named the trial holding its architecture, and was never trained
        twin = next(r for r in trained if r["number"] == d["duplicate_of"])
        assert d["arch"] == twin["arch"] and d["epochs"] == 0
    run = 0  # at most DUPLICATE_ASKS proposals in a row before the search takes an untried architecture itself
    for r in result.trials:
        run = run + 1 if r["state"] == "FAIL" else 0
        assert run <= DUPLICATE_ASKS

    # Resuming with a bigger budget trains nothing more: the space is exhausted.
    storage = sim.handle.store.storage
    (name,) = optuna.get_all_study_names(storage)  # the replay's study, in memory
    study = optuna.load_study(study_name=name, storage=storage)
    resumed = simulation_search(table, space=str(space), trials=9, sampler="random", pruner="none")
    resumed.adopt(study, storage)
    resumed.run(study, TableCohort(table, 1, random.Random(0)))
    counts = count_states(study.get_trials(deepcopy=False))
    assert len(study.get_trials(deepcopy=False)) == len(result.trials)
    assert counts["complete"] == 3 and counts["duplicate"] == len(dups) and counts["failed"] == 0


@pytest.mark.slow
def test_a_proposal_of_a_pruned_or_running_architecture_is_a_duplicate(tmp_path, spa_file, tiny_translation, cache_env, one_thread):
    """Held = complete, pruned or running: the check runs under the budget lock, before training."""
    space = write_space(tmp_path / "s.yaml", tiny_translation, schedule={"families": ["uniform"], "heads": [1, 2]}, epochs=1)
    # Heartbeats on: a worker waits for running trials (with --heartbeat 0 it would stop: nothing tells a dead one)
    s = settings(tmp_path, spa_file, space, trials=4, sampler="random", pruner="none", heartbeat=30)
    search = Search(s)
    study = search.open()
    first = search.scheduler.next_trial(study)  # asked, sampled and kept: RUNNING now, and holding its architecture
    second = search.scheduler.next_trial(study)
    assert first.number != second.number
    cfgs = [search.scheduler.sampled[first.number], search.scheduler.sampled[second.number]]
    assert cfgs[0].arch.enc_heads != cfgs[1].arch.enc_heads  # the second could not be the first's, running
    from headsearch.search.runner import WAIT

    assert search.scheduler.next_trial(study) is WAIT  # both held (running): nothing to ask until one ends
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert states.count(TrialState.RUNNING) == 2


# ------------------------------------------------------------------------ the Pareto rule


def P(curve, params=None, seconds=None):
    return Progress({e + 1: v for e, v in enumerate(curve)}, params, seconds)


def test_non_dominated_ranks_by_hand():
    pts = [[0, 3], [1, 1], [3, 0], [2, 2], [4, 4], [1, 3]]
    # front 0: (0,3) (1,1) (3,0); (2,2) is dominated by (1,1) only; (1,3) by (0,3) and (1,1); (4,4) by all.
    assert non_dominated_ranks(pts) == [0, 0, 0, 1, 2, 1]
    assert non_dominated_ranks([[1, 1], [1, 1]]) == [0, 0]  # equal points do not dominate each other


@pytest.mark.floor
def test_the_pareto_rule_never_prunes_a_fast_trial_that_nothing_dominates():
    rule = ParetoRule("maximize", kinds=("quality", "time"), min_epochs=1, reduction_factor=3, n_startup_trials=3,
                      noise_margin=0)
    others = [P([0.50], seconds=10.0), P([0.45], seconds=9.0), P([0.40], seconds=8.0), P([0.35], seconds=7.0)]
    fast = rule.decide(1, P([0.10], seconds=1.0), others)  # the worst accuracy, but the fastest by far
    assert not fast.prune and fast.note.startswith("front 1: 0 trials")
    # The median rule would prune it: 0.10 is below every value at epoch 1.
    from headsearch.search.pruning import MedianRule

    assert MedianRule("maximize", n_startup_trials=3).decide(1, {1: 0.10}, [o.curve for o in others]).prune


def test_the_pareto_rule_prunes_a_trial_with_at_least_k_trials_in_fronts_ahead():
    rule = ParetoRule("maximize", kinds=("quality", "time"), min_epochs=1, reduction_factor=3, n_startup_trials=3,
                      noise_margin=0)
    others = [P([0.50], seconds=5.0), P([0.45], seconds=5.0), P([0.40], seconds=5.0), P([0.30], seconds=9.0),
              P([0.20], seconds=9.0)]
    # n = 5 others, k = ceil(6 / 3) = 2 go on. (0.42, 5 s): only (0.50, 5) and (0.45, 5) dominate it, and
    # (0.40, 5) is in its front... fronts: {0.50}, {0.45}, {0.42}, ...: 2 ahead -> pruned.
    d = rule.decide(1, P([0.42], seconds=5.0), others)
    assert d.prune and d.n_compared == 5 and "2 trials in fronts ahead" in d.note
    # (0.47, 5 s): one ahead (0.50) < k = 2 -> goes on.
    assert not rule.decide(1, P([0.47], seconds=5.0), others).prune
    # Quality is the best so far: a dip at epoch 3 after 0.6 at epoch 2 is judged on 0.6.
    late = [P([0.1, 0.2, 0.5], seconds=5.0)] * 3
    assert not rule.decide(3, P([0.3, 0.6, 0.2], seconds=5.0), late).prune


def test_the_pareto_rule_judges_params_exactly_and_only_at_rungs_with_enough_trials():
    rule = ParetoRule("maximize", kinds=("quality", "params"), min_epochs=1, reduction_factor=2, n_startup_trials=2,
                      noise_margin=0)
    others = [P([0.5, 0.6], params=100), P([0.5, 0.6], params=200)]
    # (0.5, 150 params) is dominated by (0.5, 100) only: 1 ahead, k = ceil(3/2) = 2 -> kept.
    assert not rule.decide(1, P([0.5], params=150), others).prune
    # (0.4, 300): both ahead -> pruned.
    assert rule.decide(1, P([0.4], params=300), others).prune
    assert rule.decide(3, P([0.4, 0.4, 0.4], params=300), others).note == "not a rung"  # rungs 1, 2, 4, ...
    assert rule.decide(1, P([0.4], params=300), others[:1]).note == "too few trials (1 < 2)"
    time_rule = ParetoRule("maximize", kinds=("quality", "time"), n_startup_trials=1, min_epochs=1)
    assert time_rule.decide(1, P([0.4]), [P([0.5], seconds=1.0)]).note == "its epoch seconds are not known yet"
    assert ParetoRule("minimize", kinds=("quality", None), n_startup_trials=1, min_epochs=1).decide(1, P([math.nan]), [P([1.0])]).prune
    with pytest.raises(ConfigError):
        ParetoRule("maximize", kinds=(None,))


def test_an_auto_first_rung_is_the_earliest_epoch_that_ranks_the_finished_trials_as_they_end():
    def done(curve, number):
        return Progress({e + 1: v for e, v in enumerate(curve)}, None, 1.0, number, finished=True)

    # Five finished 4-epoch trials: epoch 1 ranks them backwards (rho -1), epoch 2 as they end (rho 1).
    finished = [done([0.5 - 0.1 * i, 0.1 + 0.1 * i, 0.1 + 0.1 * i, 0.2 + 0.1 * i], i) for i in range(5)]
    rule = ParetoRule("maximize", min_epochs="auto", reduction_factor=2, n_startup_trials=2, noise_margin=0)
    assert rule.first_rung(finished) == 2
    assert [e for e in range(1, 9) if rule.is_rung(e, finished)] == [2, 4, 8]
    assert rule.first_rung(finished[:4]) == 3  # four finished: too few to trust, epoch 3 (the default)
    running = Progress({1: 0.9}, None, 1.0, 9)  # a running trial does not count as finished
    assert rule.first_rung([*finished[:4], running]) == 3
    backwards = [done([0.5 - 0.1 * i, 0.5 - 0.1 * i, 0.5 - 0.1 * i, 0.2 + 0.1 * i], i) for i in range(5)]
    assert rule.first_rung(backwards) is None  # no epoch before the last ranks them: nothing is judged
    assert rule.decide(2, Progress({1: 0.0, 2: 0.0}, None, 1.0), backwards).note == "not a rung"
    assert rule.decide(2, Progress({1: 0.0, 2: 0.0}, None, 1.0), finished).prune  # behind all five at epoch 2
    with pytest.raises(ConfigError, match="only the pareto rule"):
        make_curve_pruner("asha", "maximize", min_epochs="auto")
    with pytest.raises(ConfigError, match="min_epochs must be an integer"):
        ParetoRule("maximize", min_epochs="soon")


def test_curve_noise_by_hand():
    # Steps at epoch 2: 0.10, 0.12, 0.08, 0.30 -> median 0.11, |r| = .01 .01 .03 .19; at epoch 3: 0.0, 0.02,
    # -0.02, 0.0 -> median 0.0, |r| = 0 .02 .02 0. Pooled median of the eight |r|: (0.01 + 0.02) / 2 = 0.015.
    curves = [{1: 0.1, 2: 0.2, 3: 0.2}, {1: 0.1, 2: 0.22, 3: 0.24}, {1: 0.1, 2: 0.18, 3: 0.16}, {1: 0.1, 2: 0.4, 3: 0.4}]
    assert curve_noise(curves, 3) == pytest.approx(1.4826 * 0.015 / math.sqrt(2))
    # Epoch 2 alone: |r| = .01 .01 .03 .19, median 0.02.
    assert curve_noise(curves, 2) == pytest.approx(1.4826 * 0.02 / math.sqrt(2))
    assert curve_noise(curves, 1) is None  # one epoch shows no noise
    assert curve_noise(curves[:1], 3) is None  # a step needs another curve's to be told from learning
    assert curve_noise([{1: 0.1, 2: 0.2}, {1: 0.1, 2: 0.3}], 2) is None  # 2 residuals < 4


@pytest.mark.floor
def test_the_pareto_rule_prunes_only_beyond_the_noise_margin_and_names_the_trials_ahead():
    def at(values, seconds, number):  # a curve that ends at `values` on epoch 2; steps of 0.1 +- noise
        return Progress({1: values - 0.1, 2: values}, None, seconds, number)

    others = [at(0.50, 5.0, 0), at(0.48, 5.0, 1), at(0.30, 9.0, 2), at(0.20, 9.0, 3)]
    # n = 4, k = ceil(5 / 2) = 3 go on (r = 2). Every step is 0.1: no noise -> margin 0 with any multiple.
    rule = ParetoRule("maximize", min_epochs=2, reduction_factor=2, n_startup_trials=2, noise_margin=1.0)
    d = rule.decide(2, at(0.45, 5.5, 9), others)  # (0.45, 11 s): 0.50 and 0.48 at 10 s dominate it: 2 < 3, kept
    assert not d.prune and d.margin == pytest.approx(0, abs=1e-12) and d.point == (-0.45, 11.0)
    # A given noise: sigma 0.02, margin 1 sigma. (0.47, 11 s) is treated as 0.49: only 0.50 dominates it.
    fixed = ParetoRule("maximize", min_epochs=2, reduction_factor=3, n_startup_trials=2, noise=0.02, noise_margin=1.0)
    # k = ceil(5 / 3) = 2. Without the margin 0.50 and 0.48 are ahead -> pruned; with it only 0.50 -> kept.
    assert ParetoRule("maximize", min_epochs=2, reduction_factor=3, n_startup_trials=2, noise_margin=0).decide(
        2, at(0.47, 5.5, 9), others).prune
    d = fixed.decide(2, at(0.47, 5.5, 9), others)
    assert not d.prune and d.margin == pytest.approx(0.02) and d.ahead == (0,)
    # (0.44, 11 s) as 0.46: both ahead beyond the noise -> pruned, and the two are named.
    d = fixed.decide(2, at(0.44, 5.5, 9), others)
    assert d.prune and d.ahead == (0, 1) and "beyond a noise margin of 0.02" in d.note
    assert d.reason()["ahead"] == [0, 1] and d.reason()["point"] == [-0.44, 11.0]
    # Estimated from the curves: one epoch shows none, so a first rung at epoch 1 is not judged.
    early = ParetoRule("maximize", min_epochs=1, reduction_factor=2, n_startup_trials=2)
    d = early.decide(1, Progress({1: 0.0}, None, 5.0), [Progress({1: 0.5}, None, 1.0)] * 3)
    assert not d.prune and d.note == "the curves' noise is not known yet (one epoch)"


# The peer's rule (OptunaHub's multi_metric_pruner, as MultiMetricRule writes it). Points (accuracy, seconds) at
# epoch 1: A (0.50, 10) and C (0.30, 2) are the current front; G (0.48, 12) is dominated by A, F by C.
A, C, G = P([0.50], seconds=10.0), P([0.30], seconds=2.0), P([0.48], seconds=12.0)


@pytest.mark.floor
def test_the_multi_metric_rule_breaks_a_fronts_ties_by_hypervolume_contribution():
    """M (0.40, 11 s) is dominated by A, in the second front with G and F. n = 4 others, the median rule keeps
    positions 1..3 of 5 (ceil(5 / 2) = 3). Within the second front, scaled to the reference 10% beyond its
    worst (accuracy -0.227 negated, seconds max + 10% of the range), the exclusive hypervolumes are:
    - F (0.25, 3 s): reference seconds 12.9; G 0.08 x 0.9 = 0.072, M 0.15 x 1 = 0.15, F 0.023 x 8 = 0.184:
      F, M, G -> M is 4th of 5 (two on the front ahead, then F): pruned;
    - F (0.25, 10.5 s): reference seconds 12.15; G 0.08 x 0.15 = 0.012, M 0.15 x 1 = 0.15, F 0.023 x 0.5 = 0.0115:
      M first of its front -> 3rd of 5: kept."""
    rule = MultiMetricRule("maximize", kinds=("quality", "time"), n_startup_trials=3)
    mine = P([0.40], seconds=11.0)
    cut = rule.decide(1, mine, [A, C, G, P([0.25], seconds=3.0)])
    assert cut.prune and cut.note.startswith("front 2, position 4 of 5") and cut.n_compared == 4
    kept = rule.decide(1, mine, [A, C, G, P([0.25], seconds=10.5)])
    assert not kept.prune and kept.note.startswith("front 2, position 3 of 5")
    # Successive halving as the base: at rungs 1, 3, 9 (r = 3) the top ceil(5 / 3) = 2 go on.
    asha = MultiMetricRule("maximize", kinds=("quality", "time"), base="asha", n_startup_trials=3)
    assert asha.decide(1, mine, [A, C, G, P([0.25], seconds=10.5)]).prune
    assert asha.decide(2, P([0.1, 0.40], seconds=11.0), [P([0.5, 0.5], seconds=10.0)] * 4).note == "not a rung"


@pytest.mark.floor
def test_the_multi_metric_rule_never_prunes_the_current_front_and_waits_for_enough_trials():
    rule = make_curve_pruner("multi-metric", "maximize", kinds=("quality", "time"), n_startup_trials=3)
    assert isinstance(rule, MultiMetricRule) and rule.base == "median"
    fast = rule.decide(1, P([0.05], seconds=1.0), [A, C, G, P([0.25], seconds=3.0)])  # the worst, but the fastest
    assert not fast.prune and fast.note == "on the current front"
    assert rule.decide(1, P([0.40], seconds=11.0), [A, C]).note == "too few trials (2 < 3)"
    assert rule.decide(1, P([math.nan], seconds=1.0), [A, C, G]).prune
    with pytest.raises(ConfigError, match="several objectives"):
        make_optuna_pruner("multi-metric", epochs=4)
    with pytest.raises(ConfigError, match="base 'mean'"):
        MultiMetricRule("maximize", base="mean")


def test_a_replay_with_the_multi_metric_rule_prunes_on_the_deep_head_table():
    table = load_table(Path(__file__).resolve().parents[1] / "benchmarks" / "tables" / "vit-cifar10-deep-head-tiny.json")
    result = replay(simulation_search(table, space="deep-head", trials=39, pruner="multi-metric", seed=0), table)
    assert any(r["state"] == "PRUNED" and r["pruned"]["rule"] == "multi-metric" for r in result.trials)
    assert 0 < result.hypervolume <= 1.0 + 1e-9


@pytest.mark.floor
def test_tpe_samples_after_a_pruned_trial_with_a_curve_in_a_study_of_two_objectives():
    """Optuna's TPE ranks a pruned trial by its last intermediate value in `study.direction`, which a study
    of two objectives refuses; headsearch records each epoch's accuracy there, so a bare TPE fails at its
    first sample after a pruning. `make_sampler` hands TPE the curve's direction."""
    from headsearch.search.study import make_sampler

    def study_with_a_pruned_curve(sampler):
        study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
        for i in range(12):  # past TPE's 10 random start-up trials
            t = study.ask()
            x = t.suggest_float("x", 0, 1)
            if i % 3:
                study.tell(t, [x, x * x])
            else:
                study._storage.set_trial_intermediate_value(t._trial_id, 1, x / 2)  # as headsearch records a curve
                study.tell(t, state=TrialState.PRUNED)
        return study

    with pytest.raises(RuntimeError, match="single direction"):
        study_with_a_pruned_curve(optuna.samplers.TPESampler(seed=0, multivariate=True, group=True))
    ours = study_with_a_pruned_curve(make_sampler("tpe", seed=0, trials=20, curve_direction="maximize"))
    assert len(ours.trials) == 12


@pytest.mark.floor
@pytest.mark.parametrize("sampler", ["nsga2", "tpe", "random", "gp"])
def test_every_sampler_runs_a_pruned_search_of_two_objectives(sampler):
    """The whole search's code, on the deep-head table, past every sampler's start-up and with the Pareto rule
    pruning: what `headsearch run --sampler NAME` does."""
    from headsearch.search.study import check_sampler

    try:
        check_sampler(sampler, 2)
    except ConfigError as e:
        pytest.skip(f"the installed Optuna: {e}")
    table = load_table(Path(__file__).resolve().parents[1] / "benchmarks" / "tables" / "vit-cifar10-deep-head-tiny.json")
    result = replay(simulation_search(table, space="deep-head", trials=20, sampler=sampler, pruner="pareto", seed=1), table)
    assert result.trained == 20
    assert any(r["state"] == "PRUNED" for r in result.trials)
    assert 0 < result.hypervolume <= 1.0 + 1e-9


@pytest.mark.floor
def test_pareto_pruning_is_refused_for_one_objective(tmp_path, spa_file, tiny_translation):
    space = write_space(tmp_path / "s.yaml", tiny_translation, schedule={"heads": [1, 2]})
    with pytest.raises(ConfigError, match="pareto judges several objectives"):
        Search(settings(tmp_path, spa_file, space, objectives=("bleu",), pruner="pareto"))
    assert Search(settings(tmp_path, spa_file, space)).definition.pruner_name() == "pareto"
    # hyperband is Optuna's multi-bracket pruner, for one objective; with several: one line that names asha
    with pytest.raises(ConfigError, match="hyperband is Optuna's multi-bracket HyperbandPruner, for one objective: with"
                                          " several use asha"):
        Search(settings(tmp_path, spa_file, space, pruner="hyperband"))
    assert Search(settings(tmp_path, spa_file, space, pruner="asha")).make_pruner()[1].rule == "asha"
    assert Search(settings(tmp_path, spa_file, space, objectives=("bleu",), pruner="asha")).make_pruner()[0].rule.rule == "asha"
    assert Search(settings(tmp_path, spa_file, space, objectives=("bleu",))).definition.pruner_name() == "median"


# ------------------------------------------------------------------------ tables and the simulator


def table_of_search(study, search) -> dict:
    """A table of what a real search trained: one run per trial (its seed), its curve as far as it ran (a paused
    run and its resumptions are one run: the longest curve)."""
    base = search.base.to_dict()
    archs = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        a = t.user_attrs
        over = overrides_of(a["config"], base)
        row = archs.setdefault(arch_key(over), {"arch": a["arch"], "overrides": over, "params": a["params"], "runs": []})
        run = {"seed": a["config"]["seed"], "curve": [t.intermediate_values[e] for e in sorted(t.intermediate_values)],
               "epoch_seconds": a["epoch_seconds_alone"], "test": a.get("test_metrics") or {}}
        same = [r for r in row["runs"] if r["seed"] == run["seed"]]
        if not same:
            row["runs"].append(run)
        elif len(run["curve"]) > len(same[0]["curve"]):
            same[0].update(run)
    return {"format": "headsearch-table/1", "task": search.task.name, "primary_metric": search.task.primary.name,
            "direction": search.task.primary.direction, "preset": search.settings.preset, "epochs": search.base.train.epochs,
            "base_config": base, "architectures": list(archs.values())}


# 8x8 patches: 17 tokens, not 65 (the HAM space's soft branch costs T^2; nothing here depends on the patch).
VIT_SETS = {"arch": {"patch_size": 8}, "train": {"max_steps_per_epoch": 4, "batch_size": 32},
            "data": {"train_limit": 256, "val_size": 64, "test_limit": 64}}


def fixed_speeds(monkeypatch) -> None:
    """Each architecture's epoch seconds alone, as the search's fair clock reports them, made a fixed function
    of its heads and skip instead of a measurement: the Pareto rule on quality x time then decides the same
    on any machine (with measured seconds, whether the tiny run prunes anything depended on this CPU's load).
    The replay reads the same seconds from the table, as it reads measured ones."""
    from headsearch.training.clock import AloneClock

    def alone_clock(self, study, trial, cfg):
        a = cfg.arch
        heads = [*a.enc_heads, *a.dec_heads]
        return AloneClock(self.seat.share, known=1.0 + 0.05 * sum(heads) + 0.25 * (a.skip != "none"))

    monkeypatch.setattr(TrialLife, "alone_clock", alone_clock)


def real_search(task: str, tmp_path, spa_file, cifar_dir, tiny_translation, **kw) -> tuple[Search, str]:
    """A small real search, and the space a replay of it names. The median rule keeps ties, so it is
    checked on the tiny ViT, whose accuracies differ between architectures; the tiny translation model's
    BLEU after 30 steps is the same for most of them (nothing would be pruned)."""
    if task == TASK:
        space = write_space(tmp_path / "s.yaml", tiny_translation,
                            schedule={"families": ["uniform", "halving"], "heads": [1, 2, 4, 8]}, skip=("none", "scores"))
        return Search(settings(tmp_path, spa_file, space, **kw)), str(space)
    s = SearchSettings(task=task, space="ham", preset="tiny", epochs=3, data_dir=str(cifar_dir), storage=f"sqlite:///{tmp_path / 'h.db'}",
                       study="s", run_root=str(tmp_path / "runs"), device="cpu", heartbeat=0,
                       sets=VIT_SETS, **kw)
    return Search(s), "ham"


@pytest.mark.floor
@pytest.mark.slow
@pytest.mark.parametrize("pruner, task, pause", [("pareto", TASK, False), ("median", "vit-cifar10", False),
                                                 ("pareto", TASK, True)])
def test_a_replay_makes_exactly_the_decisions_of_the_real_run(request, monkeypatch, tmp_path, spa_file, cifar_dir, tiny_translation,
                                                              cache_env, one_thread, pruner, task, pause):
    """With --pruner-pause too: the simulator pauses and resumes through the same loop, scheduler and rule."""
    if task != TASK:
        request.getfixturevalue("cifar")  # the real arrays, read once per module
    else:
        fixed_speeds(monkeypatch)
    # Rungs 2, 4, ... (not the default 3, 9): the 3-epoch runs are judged at epoch 2; never at their last
    rungs = dict(pruner_min_epochs=2, pruner_reduction_factor=2, pruner_pause=pause)
    seed = 2 if pause else 3  # seed 2: one of the trials paused at epoch 2 is resumed (3: none is)
    search, space = real_search(task, tmp_path, spa_file, cifar_dir, tiny_translation, trials=9, pruner=pruner,
                                pruner_startup_trials=2, seed=seed, **rungs)
    search.run_worker()
    real = load(search.settings.storage)
    real_trials = real.get_trials(deepcopy=False)
    assert any(t.state == TrialState.PRUNED for t in real_trials), "the check needs a pruned trial"
    if pause:
        assert any("resumes" in t.user_attrs for t in real_trials), "the check needs a resumed trial"
    table = table_of_search(real, search)
    path = write_table(table, tmp_path / "table.json")

    # The replay: the same settings on the table, with the one run each architecture has.
    sim = simulation_search(load_table(path), space=space, trials=9, pruner=pruner, pruner_startup_trials=2, seed=seed,
                            sets=None if task == TASK else VIT_SETS, **rungs)
    result = replay(sim, load_table(path), workers=1)
    assert [r["number"] for r in result.trials] == [t.number for t in real_trials]
    assert decisions_of_rows(result.trials) == decisions_of_rows(rows_of(real_trials))
    base = search.base.to_dict()
    assert sorted(result.front) == sorted({arch_key(overrides_of(t.user_attrs["config"], base)) for t in real.best_trials})


def rows_of(trials) -> list[dict]:
    return [{"number": t.number, "arch": t.user_attrs.get("arch"), "state": t.state.name, "epochs": len(t.intermediate_values),
             "values": t.values, "duplicate_of": t.user_attrs.get("duplicate_of"), "pruned": t.user_attrs.get("pruned"),
             "resumes": t.user_attrs.get("resumes")} for t in trials]


def decisions_of_rows(rows) -> list:
    return [(r["number"], r["state"], r["arch"], r["epochs"], r["values"], r["pruned"], r["duplicate_of"], r.get("resumes"))
            for r in rows]


def small_table(curves: dict[str, tuple[list[float], float]], epochs: int = 2) -> dict:
    """A hand-made table over the 'uniform' heads of the tiny ViT, one seed per architecture."""
    search = Search(SearchSettings(task="vit-cifar10", space="ham", preset="tiny", device="cpu", epochs=epochs))
    base = search.base.to_dict()
    archs = []
    for key, (curve, seconds) in curves.items():
        archs.append({"arch": key, "overrides": {"arch": json.loads(key)}, "params": 1000,
                      "runs": [{"seed": 0, "curve": curve, "epoch_seconds": seconds, "test": {}}]})
    return {"format": "headsearch-table/1", "task": "vit-cifar10", "primary_metric": "accuracy", "direction": "maximize",
            "preset": "tiny", "epochs": epochs, "base_config": base, "architectures": archs}


@pytest.mark.floor
def test_true_points_hypervolume_and_scores_by_hand():
    table = small_table({json.dumps({"skip": "output"}): ([0.2, 0.4], 1.0),
                         json.dumps({"skip": "scores"}): ([0.3, 0.6], 3.0),
                         json.dumps({"fusion": "add"}): ([0.1, 0.3], 2.0)})
    truth = true_points(table, ["accuracy", "time"], ["maximize", "minimize"])
    # (acc, time): output (0.4, 2 s), scores (0.6, 6 s), add (0.3, 4 s: dominated by output).
    # Minimised and scaled over the table: acc -0.6..-0.3, time 2..6.
    out, sc, add = (arch_key({"arch": {"skip": "output"}}), arch_key({"arch": {"skip": "scores"}}),
                    arch_key({"arch": {"fusion": "add"}}))
    assert truth.points[out] == pytest.approx([(-0.4 + 0.6) / 0.3, 0.0])
    assert truth.points[sc] == pytest.approx([0.0, 1.0])
    assert truth.points[add] == pytest.approx([1.0, 0.5])
    assert sorted(truth.front) == sorted([out, sc])
    # Hypervolume to (1.1, 1.1): the union of [2/3, 1.1] x [0, 1.1] and [0, 1.1] x [1, 1.1].
    want = (1.1 - 2 / 3) * 1.1 + (2 / 3) * 0.1
    assert truth.hypervolume == pytest.approx(want)
    assert hypervolume([[2 / 3, 0.0], [0.0, 1.0]], [1.1, 1.1]) == pytest.approx(want)
    from headsearch.search.simulate import score

    hv, recall = score([out], truth)
    assert hv == pytest.approx((1.1 - 2 / 3) * 1.1 / want) and recall == 0.5


def test_a_replay_on_several_workers_ends_trials_out_of_order_and_sees_only_what_has_ended():
    # 'ham' on the tiny ViT: skip x fusion, 9 architectures; here 3 with very different epoch seconds.
    table = small_table({json.dumps({"skip": "output"}): ([0.2, 0.4], 1.0),
                         json.dumps({"skip": "scores"}): ([0.3, 0.6], 10.0),
                         json.dumps({"fusion": "add"}): ([0.1, 0.3], 2.0)})
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "three.yaml"
        p.write_text(yaml.safe_dump({"schedule": {"families": ["uniform"], "heads": [4]}, "skip": ["output", "scores"],
                                     "fusion": ["none"]}))
        # 'fusion: add' with skip none is not in this space: two architectures only, trained on two workers.
        sim = simulation_search(table, space=str(p), trials=5, pruner="none", seed=0)
        r = replay(sim, table, workers=2)
    assert r.trained == 2 and r.epochs == 4
    assert r.seconds == pytest.approx(20.0)  # the slow one: 2 epochs x 10 s, beside the fast one's 2 s
    complete = [t for t in r.trials if t["state"] == "COMPLETE"]
    assert len(complete) == 2
    # The anytime hypervolume, by hand (as test_true_points_hypervolume_and_scores_by_hand): at 2 s the front
    # reported is {output}, at 20 s {output, scores}, the true front.
    true_hv = (1.1 - 2 / 3) * 1.1 + (2 / 3) * 0.1
    assert r.anytime == [(pytest.approx(2.0), pytest.approx((1.1 - 2 / 3) * 1.1 / true_hv)), (pytest.approx(20.0), pytest.approx(1.0))]
    assert (r.time_to(0.85), r.time_to(0.90), r.time_to(1.01)) == (pytest.approx(2.0), pytest.approx(20.0), math.inf)
    assert r.anytime[-1][1] == pytest.approx(r.hypervolume)


def test_a_tables_set_overrides_reach_its_runs_and_its_replays(cifar_dir):
    """`headsearch table --set data.train_limit=2000` (a cheaper epoch): every run of the table's comparison
    trains with it, and a replayed search is built with the same base config (the table records them)."""
    from headsearch.search.table import table_search

    sets = {"data": {"train_limit": 2000}, "train": {"warmup_epochs": 1}}
    search, grid, space_search = table_search("vit-cifar10", "ham", seeds=2, preset="tiny", epochs=16, storage="sqlite://",
                                              data_dir=str(cifar_dir), device="cpu", sets=sets)
    for s in (search, space_search):
        assert (s.base.data.train_limit, s.base.train.warmup_epochs, s.base.train.epochs) == (2000, 1, 16)
    assert grid.points == 9 * 2
    table = small_table({json.dumps({"enc_heads": [4, 4, 4, 4]}): ([0.3, 0.4], 1.0)})
    assert simulation_search(table, space="ham", trials=3, pruner="none").base.data.train_limit == 6000  # the preset's
    table["sets"] = sets
    sim = simulation_search(table, space="ham", trials=3, pruner="none")
    assert (sim.base.data.train_limit, sim.base.train.warmup_epochs) == (2000, 1)


def test_a_table_that_lacks_an_architecture_says_so(tmp_path):
    table = small_table({json.dumps({"skip": "output"}): ([0.2, 0.4], 1.0)})
    sim = simulation_search(table, space="ham", trials=3, pruner="none", seed=0)
    with pytest.raises(ConfigError, match="the table does not hold"):
        replay(sim, table, workers=1)
    sampled = {**table, "architectures_in_space": 9}  # what `headsearch table --sample 1` would write
    with pytest.raises(ConfigError, match="the table holds 1 of the space's 9 architectures"):
        simulation_search(sampled, space="ham", trials=3, pruner="none", seed=0)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="is not a headsearch-table/1 file"):
        load_table(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="no such file"):
        load_table(tmp_path / "missing.json")


def test_the_ham_space_lists_nine_architectures():
    space = load_space("ham")
    assert len(space.skips) * len(space.fusions) == 9
    assert len(Search(SearchSettings(task="vit-cifar10", space="ham", preset="tiny", device="cpu")).archs.listing()) == 9


def test_the_default_pareto_rule_judges_at_epochs_3_9_27_and_a_search_can_set_its_rungs(tmp_path):
    rule = ParetoRule("maximize")
    assert [e for e in range(1, 30) if rule._rungs.is_rung(e)] == [3, 9, 27]
    assert rule.reduction_factor == 3
    # --pruner-min-epochs / --pruner-reduction-factor reach the rule; a bad value is refused before any storage
    s = SearchSettings(task="vit-cifar10", space="deep-head", preset="tiny", device="cpu", trials=8,
                       storage=f"sqlite:///{tmp_path / 'r.db'}", pruner_min_epochs=2, pruner_reduction_factor=2)
    _, rule = Search(s).make_pruner()
    assert (rule.min_epochs, rule.reduction_factor) == (2, 2)
    # The noise margin: 0.9 sigmas of the noise estimated from the curves, unless told (issue 39, RESULTS.md)
    assert (ParetoRule("maximize").noise_margin, ParetoRule("maximize").noise) == (0.9, None)
    told = Search(SearchSettings(**{**s.__dict__, "pruner_noise_margin": 2.0, "pruner_noise": 0.01}))
    assert (told.make_pruner()[1].noise_margin, told.make_pruner()[1].noise) == (2.0, 0.01)
    assert told.study_attrs()["headsearch"]["pruner_options"] == {
        "min_epochs": 2, "reduction_factor": 2, "n_startup_trials": 2, "n_warmup_epochs": 0, "noise_margin": 2.0,
        "noise": 0.01}
    with pytest.raises(ConfigError, match="--pruner-reduction-factor 1: give an integer >= 2"):
        Search(SearchSettings(**{**s.__dict__, "pruner_reduction_factor": 1}))
    assert not (tmp_path / "r.db").exists()


def equal_speeds(monkeypatch, seconds: float = 1.0) -> None:
    """Every architecture's epoch seconds alone the same fixed value (`fixed_speeds` with one speed): a cohort
    trains its slots' epochs in lockstep, and with equal seconds the replay's simulated clock puts its events
    in the same lockstep (ties in scheduling order, which is slot order there)."""
    from headsearch.training.clock import AloneClock

    def alone_clock(self, study, trial, cfg):
        return AloneClock(self.seat.share, known=seconds)

    monkeypatch.setattr(TrialLife, "alone_clock", alone_clock)


def judged_beside_running(trials) -> list[int]:
    """The pruned trials whose decision counted a trial that was still RUNNING when it was judged: its
    `n_compared` exceeds the trials that had reached its epoch and finished (been told) no later than it was.
    (A trial told before it may still have been running at its judgement, in the same cohort epoch: the
    count errs on the side of finished, so a trial listed here surely counted a running one.)"""
    out = []
    for t in trials:
        reason = t.user_attrs.get("pruned")
        if t.state != TrialState.PRUNED or not reason:
            continue
        finished = [o for o in trials if o.number != t.number and o.state in (TrialState.COMPLETE, TrialState.PRUNED)
                    and "rejected" not in o.user_attrs and reason["epoch"] in o.intermediate_values
                    and o.datetime_complete <= t.datetime_complete]
        if reason["n_compared"] > len(finished):
            out.append(t.number)
    return out


@pytest.mark.floor
@pytest.mark.slow
def test_a_replay_on_two_workers_makes_exactly_the_decisions_of_a_real_cohort_of_two(monkeypatch, tmp_path, cifar_dir, cifar,
                                                                                    one_thread):
    """`headsearch run --cohort 2` on the tiny ViT (two trials trained together, each joining at its own epoch 1),
    replayed on two workers: the same decisions, with the Pareto rule judging trials against running ones.

    Why the order is the same: the real cohort trains both slots' epoch e together, then closes slot 0's epoch
    (recorded, judged), then slot 1's, then tells the trials that ended and fills their slots. The replay's
    clock, with every architecture's epoch seconds equal, has both slots' epoch e end at the same simulated
    time, slot 0's first (ties go in scheduling order, and a slot's next epoch is scheduled when its last is
    handled: slot order, a refilled slot included). Each side's judgement sees the same curves: slot 0 sees slot
    1 up to epoch e - 1, slot 1 sees slot 0 up to e (the pareto rule compares COMPLETE, PRUNED and RUNNING trials
    alike, so that the replay has told slot 0's end before it judges slot 1 changes nothing; median, on COMPLETE
    trials only, could differ there). One thing differs: when slot 0's trial ends at epoch e, the replay asks
    its successor before it handles slot 1's epoch e, the cohort after; so the sampler is the random one, whose
    proposals do not depend on the study's history (NSGA-II's generations count the COMPLETE trials when it is
    asked: slot 1's trial completing in that epoch would count in the cohort and not in the replay)."""
    equal_speeds(monkeypatch)
    rungs = dict(pruner_min_epochs=2, pruner_reduction_factor=2)
    search, space = real_search("vit-cifar10", tmp_path, None, cifar_dir, None, trials=9, pruner="pareto",
                                sampler="random", pruner_startup_trials=2, seed=3, cohort=2, **rungs)
    assert search.machine_plan().cohort == 2
    search.run_worker()  # as `headsearch run --cohort 2`: the one loop over a real Cohort of 2 slots
    real = load(search.settings.storage)
    real_trials = real.get_trials(deepcopy=False)
    trained = [t for t in real_trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert {t.user_attrs["cohort"]["size"] for t in trained} == {2}
    assert {t.user_attrs["cohort"]["slot"] for t in trained} == {0, 1}
    assert {t.user_attrs["epoch_seconds_alone"] for t in trained} == {1.0}
    assert any(t.state == TrialState.PRUNED for t in real_trials), "the check needs a pruned trial"
    assert judged_beside_running(real_trials), "the check needs a trial pruned against a running one"
    table = table_of_search(real, search)
    path = write_table(table, tmp_path / "table.json")

    sim = simulation_search(load_table(path), space=space, trials=9, pruner="pareto", sampler="random",
                            pruner_startup_trials=2, seed=3, sets=VIT_SETS, **rungs)
    result = replay(sim, load_table(path), workers=2)
    assert [r["number"] for r in result.trials] == [t.number for t in real_trials]
    assert decisions_of_rows(result.trials) == decisions_of_rows(rows_of(real_trials))
    base = search.base.to_dict()
    assert sorted(result.front) == sorted({arch_key(overrides_of(t.user_attrs["config"], base)) for t in real.best_trials})
    # Two at a time: the simulated clock ran fewer epoch-seconds than the epochs it trained.
    assert result.seconds < result.epochs


@pytest.mark.parametrize("sampler", ["nsga2", "tpe", "random"])
def test_a_search_seeded_past_numpys_32_bits_samples(sampler):
    """Any seed >= 0 is valid, but a trial's sampler was seeded seed x 100,003 + its index, past numpy's 32 bits from
    seed 42,949 on: a search seeded 123456 stopped at its first ask ("Seed must be between 0 and 2**32 - 1"). The
    sampler's seed is now taken modulo 2**32, the same for every seed that worked."""
    from headsearch.search.study import sampler_seed

    assert sampler_seed(3, 7) == 300_016 and sampler_seed(42_948, 5) == 42_948 * 100_003 + 5
    table = load_table(Path(__file__).resolve().parents[1] / "benchmarks" / "tables" / "vit-cifar10-deep-head-tiny.json")
    result = replay(simulation_search(table, space=table["space"]["name"], trials=4, sampler=sampler, pruner="none",
                                      seed=123_456), table)
    assert sum(r["state"] == "COMPLETE" for r in result.trials) == 4
