"""The table of pruning rules (`headsearch.search.pruning.RULES`): every row through both factories, names it
does not hold refused in one line, and a rule added in the one place docs/architecture.md names
(`register_pruner`) running a real search with one objective and with several."""
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from test_custom_task import NAME, SPACE, TASK

from headsearch.errors import ConfigError
from headsearch.search.pruning import (RULES, MultiMetricRule, ParetoRule, PruneDecision, PruningRule, RulePruner,
                                       judges_progress, make_curve_pruner, make_optuna_pruner, pruner_names,
                                       pruning_rule, register_pruner)
from headsearch.search.runner import Search, SearchSettings

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.mark.floor  # Optuna's pruners are built here, on the floor as on the newest
@pytest.mark.parametrize("name", pruner_names())
def test_every_rule_builds_for_one_objective_or_several_and_says_why_not_for_the_other(name):
    rule = pruning_rule(name)
    built = {}
    for kind, build in (("several", lambda: make_curve_pruner(name, "maximize")),
                        ("one", lambda: make_optuna_pruner(name, epochs=9))):
        try:
            built[kind] = build()
        except ConfigError as e:
            assert isinstance(getattr(rule, kind), str) and str(e) == getattr(rule, kind)
            assert "\n" not in str(e) and name in str(e)
    assert built, f"{name} builds for neither one objective nor several"
    one = built.get("one")
    assert one is None or isinstance(one, optuna.pruners.BasePruner)
    judge = built.get("several")
    if judge is None:  # none, or a rule for one objective only: it compares no trials itself
        assert name in ("none", "hyperband") and not rule.compares
        return
    assert judge.rule == name and rule.compares
    assert judges_progress(judge) == isinstance(judge, (ParetoRule, MultiMetricRule)) == rule.judges_progress
    if rule.rungs is not None:  # the row's default rungs are the rule's own
        assert (judge.min_epochs, judge.reduction_factor) == rule.rungs
        if isinstance(one, RulePruner):
            assert (one.rule.min_epochs, one.rule.reduction_factor) == rule.rungs
    else:
        assert not hasattr(judge, "min_epochs") or name == "multi-metric"  # multi-metric: median base by default
    if not rule.auto_first_rung and name != "none":
        with pytest.raises(ConfigError, match="only the pareto rule chooses its first rung"):
            make_curve_pruner(name, "maximize", min_epochs="auto")


def test_a_name_not_in_the_table_is_refused_by_each_factory_and_by_the_settings(tmp_path):
    for build in (lambda: make_curve_pruner("asha2", "maximize"), lambda: make_optuna_pruner("asha2", epochs=3),
                  lambda: pruning_rule("asha2")):
        with pytest.raises(ConfigError, match="^unknown pruner 'asha2': use one of pareto, median, percentile, asha,"):
            build()
    with pytest.raises(ConfigError, match="unknown pruner 'asha2'"):
        Search(SearchSettings(task="vit-cifar10", pruner="asha2", storage=f"sqlite:///{tmp_path / 'h.db'}"))
    assert not (tmp_path / "h.db").exists()
    with pytest.raises(ConfigError, match="'median' is registered already"):
        register_pruner(RULES["median"])


# -- a toy rule, added where the doc says --------------------------------------------------------------------

class AfterTwo:
    """Prunes a trial at epoch 1 once two trials have run: the first two always finish, the rest stop."""

    rule = "after-two"

    def decide(self, epoch, curve, others):
        n = sum(1 for o in others if epoch in o)
        return PruneDecision(epoch == 1 and n >= 2, self.rule, epoch, curve[epoch], None, n)


class Never(optuna.pruners.BasePruner):  # Optuna's side of the toy: prunes every trial at its first report
    def prune(self, study, trial):
        return trial.last_step is not None


@pytest.fixture
def toy_rule(monkeypatch):
    from headsearch.tasks import registry

    monkeypatch.setitem(registry._REGISTRY, NAME, TASK)
    rule = register_pruner(PruningRule("after-two", lambda direction, o: AfterTwo(), lambda epochs, o: Never(),
                                       (TrialState.COMPLETE, TrialState.PRUNED)))
    yield rule
    RULES.pop(rule.name)


@pytest.mark.parametrize("objectives", [None, ("accuracy",)], ids=["several", "one"])
def test_a_rule_added_with_register_pruner_runs_a_search(toy_rule, tmp_path: Path, objectives):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    url = f"sqlite:///{tmp_path / 'h.db'}"
    Search(SearchSettings(task=NAME, space=str(space), storage=url, study="s", trials=4, preset="tiny", epochs=3,
                          run_root=str(tmp_path / "runs"), device="cpu", pruner="after-two", objectives=objectives,
                          seed=0)).run_worker()
    trials = [t for t in optuna.load_study(study_name="s", storage=url).get_trials(deepcopy=False)
              if "duplicate_of" not in t.user_attrs]
    assert len(trials) >= 3
    states = [t.state for t in trials]
    if objectives is None:  # the curve judge: the first two finish, every later one stops at epoch 1
        assert states[:2] == [TrialState.COMPLETE] * 2 and set(states[2:]) == {TrialState.PRUNED}
        for t in trials[2:]:
            assert t.user_attrs["pruned"]["rule"] == "after-two" and t.user_attrs["pruned"]["epoch"] == 1
    else:  # Optuna's pruner of the row: every trial stops at its first report
        assert set(states) == {TrialState.PRUNED} and all(t.last_step == 1 for t in trials)


@pytest.mark.parametrize("objectives", [None, ("accuracy",)], ids=["several", "one"])
def test_pruner_percentile_reaches_the_percentile_rule_and_the_study_record(toy_rule, tmp_path: Path, objectives):
    """`--pruner percentile` was always the 25th percentile: `--pruner-percentile` now reaches the rule."""
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    search = Search(SearchSettings(task=NAME, space=str(space), storage=f"sqlite:///{tmp_path / 'h.db'}", trials=4,
                                   preset="tiny", device="cpu", pruner="percentile", pruner_percentile=40.0,
                                   objectives=objectives))
    optuna_pruner, curve_pruner = search.make_pruner()
    if objectives is None:
        assert curve_pruner.percentile == 40.0
    else:
        assert isinstance(optuna_pruner, optuna.pruners.PercentilePruner) and optuna_pruner._percentile == 40.0
    assert search.pruner_options()["percentile"] == 40.0
