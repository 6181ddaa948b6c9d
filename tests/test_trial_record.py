"""The trial record (headsearch.search.record): one answer, everywhere, to whether a trial counts toward the
budget, holds its architecture or its grid point, or was trained; and a search's parts that a worker builds
from its parent's resolved config instead of resolving it again."""
from __future__ import annotations

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from headsearch.config import RunConfig, stable_key
from headsearch.search.record import (KEYS, config_key, counts_toward_budget, failed_for_good, holds_architecture,
                                      holds_point, was_trained)

CONFIG = {"task": "vit-cifar10", "seed": 0}


def trial(state: TrialState, **attrs):
    values = [0.5] if state == TrialState.COMPLETE else None
    return create_trial(state=state, values=values, params={"x": 1}, distributions={"x": IntDistribution(0, 2)},
                        user_attrs=attrs, intermediate_values={1: 0.4} if state != TrialState.WAITING else {})


# (the trial, counts toward the budget, holds its architecture, holds its grid point, was trained)
CASES = {
    "complete": (trial(TrialState.COMPLETE, config=CONFIG), True, True, True, True),
    "pruned": (trial(TrialState.PRUNED, config=CONFIG), True, True, True, True),
    "running": (trial(TrialState.RUNNING, config=CONFIG), True, True, True, False),
    "waiting (a retry)": (trial(TrialState.WAITING), True, False, True, False),
    "rejected": (trial(TrialState.PRUNED, config=CONFIG, rejected="4 heads do not divide 30"), True, False, True, False),
    "duplicate": (trial(TrialState.FAIL, config=CONFIG, duplicate_of=0), False, False, False, False),
    "over budget": (trial(TrialState.FAIL, over_budget=7), False, False, False, False),
    "diverged": (trial(TrialState.FAIL, config=CONFIG, fail_reason="diverged at step 3"), False, True, True, False),
    "interrupted": (trial(TrialState.FAIL, config=CONFIG, fail_reason="interrupted (Ctrl-C)"), False, False, False, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_predicate_on_each_kind_of_trial(name):
    t, counts, holds, point, trained = CASES[name]
    assert (counts_toward_budget(t), holds_architecture(t), holds_point(t), was_trained(t)) == (counts, holds, point, trained)
    assert failed_for_good(t) == (name == "diverged")


def test_a_configs_key_is_the_key_of_its_stored_dict():
    cfg = RunConfig(task="vit-cifar10", seed=3, data={"b": 2, "a": 1})
    stored = optuna.create_study()  # through a real storage: JSON in, JSON out, as a trial keeps it
    t = stored.ask()
    t.set_user_attr("config", cfg.to_dict())
    assert cfg.key() == config_key(stored.trials[0].user_attrs["config"]) == stable_key(cfg.to_dict())
    assert cfg.key("data", "seed") == stable_key([{"a": 1, "b": 2}, 3])
    assert cfg.key() != cfg.replace(seed=4).key()


def test_every_key_the_record_names_says_what_it_means():
    assert all(isinstance(v, str) and v for v in KEYS.values())
    assert {"config", "arch", "rejected", "duplicate_of", "over_budget", "fail_reason", "pruned"} <= set(KEYS)


def test_a_worker_takes_its_parents_resolved_config_and_resolves_nothing(tmp_path, spa_file, monkeypatch, tiny_translation):
    """The parent resolves and checks the base config once; a worker built with it (`resolved_base`, as
    `headsearch.search.workers` builds one) neither resolves the config nor samples the space again."""
    import yaml

    from headsearch.search import runner
    from headsearch.search.architectures import SpaceArchitectures
    from headsearch.search.runner import Search, SearchSettings

    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"tasks": ["translation-en-es"], "fixed": tiny_translation,
                                     "schedule": {"families": ["uniform"], "heads": [1, 2]}}))
    settings = SearchSettings(task="translation-en-es", space=str(space), data_file=str(spa_file), device="cpu",
                              storage=f"sqlite:///{tmp_path / 'h.db'}", trials=2, epochs=1)
    parent = Search(settings)

    def never(*a, **k):
        raise AssertionError("a worker resolved or checked the config again")

    monkeypatch.setattr(runner, "resolve_config", never)
    monkeypatch.setattr(runner, "preflight", never)
    monkeypatch.setattr(SpaceArchitectures, "check_feasible", never)
    worker = Search(settings, resolved_base=parent.base)
    assert worker.base is parent.base and worker.study_name == parent.study_name
    assert worker.study_attrs() == parent.study_attrs()
    with pytest.raises(AssertionError, match="resolved or checked"):
        Search(settings)
