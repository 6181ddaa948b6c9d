"""Each setting is checked once, where it is declared, whatever rule or command reads it (issue 49): a bad
pruning value under any pruning rule, and a bad HEADSEARCH_* environment variable for `run` and `train`, are
one line and exit 2 before any file or study exists."""
import dataclasses
from pathlib import Path

import pytest

from headsearch.environment import ENVIRONMENT
from headsearch.errors import ConfigError
from headsearch.search.pruning.registry import RULES
from headsearch.search.settings import PRUNING_FIELDS, SearchSettings, check_settings, flag_of

BAD_PRUNING = {"pruner_startup_trials": -1, "pruner_warmup_epochs": -2, "pruner_min_epochs": 0,
               "pruner_reduction_factor": 1, "pruner_noise_margin": -0.5, "pruner_noise": float("nan"),
               "pruner_percentile": 150.0, "pruner_pause": "yes"}
GOOD_PRUNING = {"pruner_startup_trials": 2, "pruner_warmup_epochs": 0, "pruner_min_epochs": 1,
                "pruner_reduction_factor": 2, "pruner_noise_margin": 0.5, "pruner_noise": 0.01, "pruner_percentile": 25.0,
                "pruner_pause": True}
BAD_ENVIRONMENT = {"HEADSEARCH_CACHE": "{file}", "HEADSEARCH_DEVICE_LOCKS": "{file}/locks", "HEADSEARCH_STORAGE_PATIENCE": "-1", "HEADSEARCH_STATUS_EVERY": "abc",
                   "HEADSEARCH_UNHELD_WARM_UP": "maybe", "HEADSEARCH_SHARED_GRAPH_POOL": "2", "HEADSEARCH_WORKER_POOL": "0+1"}


def test_every_pruning_field_has_one_check_and_the_tests_a_bad_value():
    fields = {f.name for f in dataclasses.fields(SearchSettings) if f.name.startswith("pruner_") or f.name == "pruner"}
    assert set(PRUNING_FIELDS) == fields - {"pruner"} == set(BAD_PRUNING) == set(GOOD_PRUNING)
    assert set(BAD_ENVIRONMENT) == set(ENVIRONMENT)


@pytest.mark.parametrize("rule", [None, *RULES])
@pytest.mark.parametrize("field", sorted(BAD_PRUNING))
def test_a_bad_pruning_value_is_refused_whatever_the_rule(rule, field):
    """`--pruner asha --pruner-noise -1` and `--pruner-percentile 150` under the default rule trained as if not
    given: every rule (and none) now refuses each bad value, naming the option."""
    with pytest.raises(ConfigError, match=f"^{flag_of(field)} "):
        check_settings(SearchSettings(task="vit-cifar10", pruner=rule, **{field: BAD_PRUNING[field]}))


def test_the_simulator_replays_every_pruning_field():
    from headsearch.search.simulate import simulation_search
    from headsearch.search.table import load_table
    table = load_table(Path(__file__).resolve().parents[1] / "benchmarks" / "tables" / "vit-cifar10-deep-head-tiny.json")
    search = simulation_search(table, space="deep-head", trials=4, pruner="percentile", **GOOD_PRUNING)
    assert all(getattr(search.settings, name) == value for name, value in GOOD_PRUNING.items())
    assert search.definition.pruner_options()["percentile"] == 25.0
    with pytest.raises(TypeError, match="pruner_percent is not a pruning setting"):
        simulation_search(table, space="deep-head", trials=4, pruner_percent=10)


@pytest.mark.parametrize("name", sorted(BAD_ENVIRONMENT))
def test_a_bad_environment_value_stops_run_and_train_in_one_line_before_anything_exists(name, cli, cifar_dir, tmp_path,
                                                                                      monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(name, BAD_ENVIRONMENT[name].format(file=tmp_path / "a-file"))
    monkeypatch.chdir(tmp_path)
    common = ["--task", "vit-cifar10", "--preset", "tiny", "--data-dir", cifar_dir, "--device", "cpu"]
    cli.error_line(cli(["run", *common, "--trials", "1", "--storage", "sqlite:///h.db", "--run-root", "runs"]), name)
    cli.error_line(cli(["train", *common, "--out", "run"]), name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no study, no run directory


# A bad value of every setting that has a check, as the command line gives it.
# A flag takes no value on the command line: its check guards `api.search` (test_a_bad_pruning_value_is_refused...).
FLAGS = {"pruner_pause"}
BAD_RUN_VALUES = {"trials": "0", "timeout": "-5", "sampler": "annealing", "seed": "-1", "pruner": "sometimes",
                  **{name: str(value) for name, value in BAD_PRUNING.items() if name not in FLAGS}, "study": " padded ",
                  "workers": "0",
                  "trials_per_gpu": "0", "cohort": "65", "heartbeat": "-1", "epochs": "0", "track_diversity": "-1",
                  "tensorboard": "{file}"}


def test_each_setting_is_one_run_option_and_one_api_parameter_of_its_name():
    """The settings tree declares each option once: `run` takes exactly one option per field, whose flag is the
    field's name (in the singular for a repeatable one), and `api.search` a keyword parameter of that name."""
    import inspect

    import typer

    from headsearch import api
    from headsearch.cli.main import app
    from headsearch.search.settings import SETTINGS, option_of

    run = typer.main.get_command(app).commands["run"]
    assert sorted(p.name for p in run.params) == sorted([*SETTINGS, "enqueue"])
    for name in SETTINGS:
        (param,) = [p for p in run.params if p.name == name]
        dashed = "--" + name.replace("_", "-")
        assert param.opts[0] == flag_of(name) == (dashed.removesuffix("s") if option_of(name).repeat else dashed)
        for function in (api.search, api.search_study):
            assert name in inspect.signature(function).parameters
    flags = [flag for p in run.params for flag in p.opts]
    assert len(flags) == len(set(flags))
    assert {name for name in SETTINGS if option_of(name).check} - FLAGS == set(BAD_RUN_VALUES)


def test_run_hands_the_api_the_settings_a_python_caller_would_give(cli, monkeypatch, tmp_path):
    """What `run` reads from its command line is what `api.search_study` gets: the same `SearchSettings`."""
    from headsearch import api

    given = {}
    monkeypatch.setattr(api, "search_study", lambda task, **kw: given.update(task=task, **kw))
    monkeypatch.chdir(tmp_path)
    result = cli(["run", "--task", "vit-cifar10", "--objectives", "accuracy, time", "--pruner-startup", "2",
                  "--pruner-min-epochs", "auto", "--set", "train.lr=0.1", "--set", "data.train_limit=64",
                  "--callback", "json:dumps", "--track-diversity", "8", "--run-root", "trials"])
    assert result.exit_code == 0, result.output
    for hook in ("enqueue", "watch", "argv"):
        given.pop(hook)
    assert SearchSettings(**given) == SearchSettings(
        task="vit-cifar10", objectives=("accuracy", "time"), pruner_startup_trials=2, pruner_min_epochs="auto",
        sets={"train": {"lr": 0.1}, "data": {"train_limit": 64}}, callbacks=("json:dumps",), track_diversity=8,
        run_root="trials")


@pytest.mark.parametrize("name", sorted(BAD_RUN_VALUES))
def test_a_bad_value_of_any_setting_stops_run_in_one_line_before_anything_exists(name, cli, cifar_dir, tmp_path,
                                                                                 monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.chdir(tmp_path)
    value = BAD_RUN_VALUES[name].format(file=tmp_path / "a-file")
    line = cli.error_line(cli(["run", "--task", "vit-cifar10", "--preset", "tiny", "--data-dir", cifar_dir,
                               "--storage", "sqlite:///h.db", flag_of(name), value]))
    assert flag_of(name) in line or name in ("sampler", "pruner", "tensorboard")  # these name what they know
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no study, no run directory


@pytest.mark.parametrize("name", ["workers", "cohort", "study"])
@pytest.mark.parametrize("command", ["compare", "table"])
def test_a_bad_value_of_a_shared_setting_stops_compare_and_table_the_same_way(command, name, cli, cifar_dir, tmp_path,
                                                                              monkeypatch):
    """`compare` and `table` take these settings as `run` does: the same check, the same line."""
    monkeypatch.chdir(tmp_path)
    examples = Path(__file__).resolve().parents[1] / "examples"
    given = [str(examples / "ham-a.yaml"), str(examples / "ham-b.yaml")] if command == "compare" else ["--out", "t.json"]
    line = cli.error_line(cli([command, *given, "--task", "vit-cifar10", "--preset", "tiny", "--data-dir", cifar_dir,
                               "--storage", "sqlite:///h.db", flag_of(name), BAD_RUN_VALUES[name]]))
    assert line.startswith(f"error: {flag_of(name)} ")
    assert list(tmp_path.iterdir()) == []
