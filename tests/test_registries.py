"""The tables a name is looked up in, row by row, as test_pruning_registry.py goes through the pruning rules:
every sampler of `SAMPLERS` proposes an architecture for one objective and for two, or is refused in one line;
every convergence objective of `CONVERGENCE` is one a search takes and a trial's record keeps; every storage
scheme of `SCHEMES` declares a liveness of `LIVENESS`. A name no row holds is refused in one ConfigError line."""
import json
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import torch

from headsearch.errors import ConfigError
from headsearch.search.objectives import CONVERGENCE, MINIMIZE, Objective, axis_label, objective_for, resolve_objectives
from headsearch.search.record import KEYS, record_result
from headsearch.search.runner import Search, SearchSettings
from headsearch.search.simulate import simulation_search
from headsearch.search.storage import LIVENESS, SCHEMES, register_storage
from headsearch.search.study import SAMPLERS
from headsearch.tasks.registry import get_task
from headsearch.training.trainer import TrainResult

optuna.logging.set_verbosity(optuna.logging.WARNING)
TABLE = Path(__file__).resolve().parents[1] / "benchmarks" / "tables" / "vit-cifar10-deep-head-tiny.json"


@pytest.fixture(scope="module")
def table():
    return json.loads(TABLE.read_text())


@pytest.mark.floor  # which samplers take several objectives depends on Optuna's version (study.GP_MULTI_OBJECTIVE)
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_every_sampler_proposes_for_one_objective_and_two_or_is_refused_in_one_line(name, table):
    """Through the search a run builds (`cost`, with no builder in `SAMPLERS`, from the table's costs): each
    sampler proposes an architecture of the space in a study of that many objectives, or the search is refused
    before any study, in one line naming the sampler."""
    built = []
    for objectives in (["accuracy"], ["accuracy", "time"]):
        try:
            search = simulation_search(table, space="deep-head", trials=8, sampler=name, objectives=objectives)
        except ConfigError as e:
            assert "\n" not in str(e) and f"--sampler {name}" in str(e), e
            continue
        assert search.sampler_name() == name
        study = optuna.create_study(directions=[o.direction for o in search.objectives], sampler=search.make_sampler())
        trial = study.ask()
        assert search.archs.sample_config(trial, torch.device("cpu")).arch.enc_heads  # an architecture of the space
        built.append(len(objectives))
    assert built or name == "gp", f"{name} proposes for no search"  # gp: refused where scipy is not installed
    assert name != "cost" or built == [2]  # the cost-aware sampler: quality x time only, built from the costs


def test_every_convergence_objective_is_taken_by_a_search_and_kept_by_its_record():
    task = get_task("vit-cifar10")
    for name, c in CONVERGENCE.items():
        assert objective_for(task, name) == objective_for(None, name) == Objective(name, MINIMIZE)
        assert [o.name for o in resolve_objectives(task, [task.primary.name, name])] == [task.primary.name, name]
        assert c.unit and c.label and c.description and axis_label(name, MINIMIZE).startswith(c.label)
        # The record: a TrainResult field, written by record_result under its name, listed in KEYS, read back.
        assert c.attr in TrainResult.__dataclass_fields__ and c.attr in KEYS, c.attr
        written = {}
        fields = {**dict.fromkeys(TrainResult.__dataclass_fields__), "best_metrics": {}, "test_metrics": {}, c.attr: 7}
        result = SimpleNamespace(**fields)
        record_result(SimpleNamespace(set_user_attr=written.__setitem__), result)
        assert Objective(name, MINIMIZE).trial_value(SimpleNamespace(user_attrs=written)) == 7
        assert Objective(name, MINIMIZE).value(result) == 7.0


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_every_storage_scheme_declares_a_liveness(name):
    """Each row says how a dead worker's trial is found there; registering it again checks it as a new row is."""
    row = SCHEMES[name]
    assert row.liveness in LIVENESS
    assert register_storage(row, replace=True) is row


@pytest.mark.parametrize("field, value, refusal", [
    ("sampler", "tpe2", "unknown sampler 'tpe2': use one of nsga2, tpe, random, gp, cost"),
    ("objectives", ("accuracy", "speed"), "unknown objective 'speed' for task vit-cifar10: use accuracy, loss, time,"
                                          " epochs, params"),
    ("pruner", "asha2", "unknown pruner 'asha2': use one of "),
])
def test_a_name_without_a_row_is_refused_in_one_line_before_any_study(field, value, refusal, tmp_path):
    with pytest.raises(ConfigError) as refused:
        Search(SearchSettings(task="vit-cifar10", storage=f"sqlite:///{tmp_path / 'h.db'}", **{field: value}))
    assert str(refused.value).startswith(refusal) and "\n" not in str(refused.value), refused.value
    assert not (tmp_path / "h.db").exists()
