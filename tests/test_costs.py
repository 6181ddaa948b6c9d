"""Costs before training (issue 42): `--sampler cost` measures every architecture's epoch seconds alone before
the first trial, stores each in the study under the fair clock's key as it goes (a crash loses none, a resumed
search measures nothing again), says what that took in the plan line and `report`, and its sampler proposes from
them; the trials' `time` stays what their own training measured. The simulator's clock counts the measurement.
Real searches on the tiny translation model (tests/test_search.py's space, narrowed to 6 architectures)."""
import json
import math
import statistics
import subprocess
from pathlib import Path

import pytest
import yaml

import headsearch.search.costs as costs_module
from headsearch.search.costs import MAX_ARCHITECTURES, CostSummary, stored_costs
from headsearch.search.runner import Search
from headsearch.search.simulate import measuring_seconds, replay, simulation_search
from headsearch.search.workers import run_search
from headsearch.training.clock import ALONE_SETTLE, ALONE_STEPS
from tests.test_search import load, run_cmd, space_dict, sqlite_url, sub_env

TABLES = Path(__file__).resolve().parents[1] / "benchmarks" / "tables"
# 3 head counts x 2 skips, no fusion: 6 architectures of the tiny translation model, 10 steps an epoch.
SIX = dict(schedule={"families": ["uniform"], "heads": [1, 2, 4]}, skip=["none", "output"], fusion=["none"])


@pytest.fixture
def six_space(tmp_path, tiny_translation) -> Path:
    path = tmp_path / "six.yaml"
    path.write_text(yaml.safe_dump(space_dict(tiny_translation, **SIX), sort_keys=False))
    return path


@pytest.fixture(scope="module")
def cost_search(tmp_path_factory, spa_file, tokenizer_cache):
    """One real 4-trial search with --sampler cost, in process, with what it announced and heard; then the
    same command again with 6 trials (resumed: nothing measured again). Torch on one thread (`one_thread`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("cost")
    from tests.conftest import TINY_TRANSLATION

    space = tmp / "six.yaml"
    space.write_text(yaml.safe_dump(space_dict(json.loads(json.dumps(TINY_TRANSLATION)), **SIX), sort_keys=False))

    def run(trials: int):
        from headsearch.search.runner import SearchSettings

        s = Search(SearchSettings(task="translation-en-es", space=str(space), trials=trials, sampler="cost", study="c",
                                  storage=sqlite_url(tmp / "h.db"), data_file=str(spa_file), run_root=str(tmp / "runs"),
                                  device="cpu"))
        lines, heard = [], []
        from headsearch.search.workers import open_search

        open_search(s)
        assert run_search(s, announce=lines.append, on_cost=lambda *a: heard.append(a)) == []
        return s, lines, heard

    try:
        first = run(4)
        again = run(6)
    finally:
        torch.set_num_threads(threads)
    return dict(first=first, again=again, study=load(sqlite_url(tmp / "h.db"), "c"), url=sqlite_url(tmp / "h.db"),
                tmp=tmp)


@pytest.mark.slow
def test_every_architecture_is_measured_before_the_first_trial_and_stored_under_the_fair_clocks_key(cost_search):
    search, lines, heard = cost_search["first"]
    study = cost_search["study"]
    stored = stored_costs(study)
    assert len(stored) == 6 == len(heard) and [h[:2] for h in heard] == [(i, 6) for i in range(1, 7)]
    assert {c["config_key"] for c in stored.values()} == set(search.archs.listing())
    assert all(c["epoch_seconds_alone"] > 0 and c["seconds"] > 0 and c["source"] == "measured" for c in stored.values())
    # Measured before any trial: each trial starts after the last cost was stored (the study's first trial is the
    # first one asked, after the plan line).
    assert len(lines) == 1 and "costs: 6 architectures' epoch seconds alone measured before training (" in lines[0]
    total = sum(c["seconds"] for c in stored.values())
    assert CostSummary(6, 6, total).line() in lines[0]
    # The key is the fair clock's: a trial of the architecture looks its own time up under the same key.
    trials = [t for t in study.get_trials(deepcopy=False) if t.state.name in ("COMPLETE", "PRUNED")]
    assert trials and all(t.user_attrs["alone_key"] in stored for t in trials)
    assert study.user_attrs["headsearch"]["sampler"] == "cost"


def test_the_cost_sampler_proposes_from_the_measured_costs_and_time_stays_the_trials_own(cost_search):
    study = cost_search["study"]
    stored = stored_costs(study)
    trials = sorted((t for t in study.get_trials(deepcopy=False) if t.state.name in ("COMPLETE", "PRUNED")),
                    key=lambda t: t.number)
    assert len(trials) == 6 and len({t.user_attrs["alone_key"] for t in trials}) == 6  # no architecture twice
    assert not [t for t in study.get_trials(deepcopy=False) if "duplicate_of" in t.user_attrs]
    cheapest = min(stored, key=lambda k: stored[k]["epoch_seconds_alone"])
    assert trials[0].user_attrs["alone_key"] == cheapest  # the first proposal: the cheapest architecture
    # `time` is what each trial's own training measured (its first epoch's steps alone), not the cost figure.
    for t in trials:
        a = t.user_attrs
        assert a["epoch_seconds_alone"] != stored[a["alone_key"]]["epoch_seconds_alone"]
        if t.state.name == "COMPLETE":
            assert t.values[1] == pytest.approx(a["best_epoch"] * a["epoch_seconds_alone"])


def test_a_resumed_search_measures_nothing_again(cost_search):
    _, lines, heard = cost_search["again"]
    assert heard == []
    first_total = sum(c["seconds"] for c in stored_costs(cost_search["study"]).values())
    assert CostSummary(6, 0, first_total).line() in lines[0] and lines[0].endswith("; 0 now)")


def test_report_shows_what_measuring_the_costs_took(cost_search, cli):
    total = sum(c["seconds"] for c in stored_costs(cost_search["study"]).values())
    result = cli(["report", "--storage", cost_search["url"], "--study", "c"])
    assert result.exit_code == 0, result.output
    assert CostSummary(6, None, total).line() in result.stdout
    as_json = cli(["report", "--storage", cost_search["url"], "--study", "c", "--format", "json"])
    costs = json.loads(as_json.stdout)["costs"]
    assert costs["architectures"] == 6 and costs["seconds"] == pytest.approx(total)


@pytest.mark.slow
def test_a_crash_while_measuring_keeps_what_was_measured(tmp_path, six_space, spa_file, cache_env, one_thread, monkeypatch):
    from headsearch.search.runner import SearchSettings
    from headsearch.training import clock

    settings = SearchSettings(task="translation-en-es", space=str(six_space), trials=2, sampler="cost", study="s",
                              storage=sqlite_url(tmp_path / "h.db"), data_file=str(spa_file),
                              run_root=str(tmp_path / "runs"), device="cpu")
    real, calls = clock.measure_alone, []

    def dies_on_the_fourth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(clock, "measure_alone", dies_on_the_fourth)
    s = Search(settings)
    with pytest.raises(KeyboardInterrupt):
        run_search(s)
    study = load(settings.storage, "s")
    assert len(stored_costs(study)) == 3 and study.get_trials() == []  # 3 kept; no trial began
    monkeypatch.setattr(clock, "measure_alone", real)
    lines = []
    assert run_search(Search(settings), announce=lines.append) == []
    assert len(stored_costs(load(settings.storage, "s"))) == 6 and "; 3 now)" in lines[0]


@pytest.mark.slow
def test_a_trial_timed_alone_before_lends_its_figure_instead_of_a_measurement(tmp_path, six_space, spa_file, cache_env,
                                                                               one_thread):
    from headsearch.search.runner import SearchSettings

    common = dict(task="translation-en-es", space=str(six_space), study="s", storage=sqlite_url(tmp_path / "h.db"),
                  data_file=str(spa_file), run_root=str(tmp_path / "runs"), device="cpu")
    Search(SearchSettings(trials=2, sampler="random", **common)).run_worker()  # two architectures timed by trials
    timed = {t.user_attrs["alone_key"]: t.user_attrs["epoch_seconds_alone"] for t in load(common["storage"], "s").trials
             if "epoch_seconds_alone" in t.user_attrs}
    assert len(timed) == 2
    heard = []
    run_search(Search(SearchSettings(trials=3, sampler="cost", **common)), on_cost=lambda *a: heard.append(a[2]))
    by_trial = [c for c in heard if c.source == "trial"]
    assert {c.alone_key: c.epoch_seconds_alone for c in by_trial} == timed and all(c.seconds == 0 for c in by_trial)
    assert sum(c.source == "measured" for c in heard) == 4


@pytest.mark.parametrize("args, fragment", [
    (["--objectives", "bleu,params"], "--sampler cost searches bleu x time (objectives: bleu, params)"),
    (["--objectives", "bleu"], "--sampler cost searches bleu x time (objectives: bleu)"),
])
def test_bad_input_for_the_cost_sampler_is_one_line(args, fragment, tmp_path, six_space, spa_file, cache_env, cli):
    result = cli(["run", "--task", "translation-en-es", "--space", six_space, "--data-file", spa_file, "--trials", "2",
                  "--storage", sqlite_url(tmp_path / "h.db"), "--run-root", tmp_path / "runs", "--device", "cpu",
                  "--sampler", "cost", *args])
    cli.error_line(result, fragment)
    assert not (tmp_path / "h.db").exists()


def test_a_space_too_big_to_measure_whole_is_refused(tmp_path, spa_file, cache_env, cli, tiny_translation, monkeypatch):
    monkeypatch.setattr(costs_module, "MAX_ARCHITECTURES", 5)
    path = tmp_path / "six.yaml"
    path.write_text(yaml.safe_dump(space_dict(tiny_translation, **SIX), sort_keys=False))
    result = cli(["run", "--task", "translation-en-es", "--space", path, "--data-file", spa_file, "--trials", "2",
                  "--storage", sqlite_url(tmp_path / "h.db"), "--run-root", tmp_path / "runs", "--device", "cpu",
                  "--sampler", "cost"])
    cli.error_line(result, "holds 6 (at most 5)")
    assert MAX_ARCHITECTURES >= 39 * 3  # every built-in space's architectures (deep-head: 39) fit, several times over


@pytest.mark.processes
@pytest.mark.slow
def test_with_two_workers_one_process_measures_first_and_the_workers_share_it(tmp_path, six_space, spa_file,
                                                                              tokenizer_cache):
    url = sqlite_url(tmp_path / "h.db")
    proc = subprocess.run(run_cmd(six_space, url, "s", 3, spa_file, tmp_path / "runs", "--workers", 2, "--sampler", "cost"),
                          cwd=tmp_path, env=sub_env(tokenizer_cache), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = load(url, "s")
    stored = stored_costs(study)
    assert len(stored) == 6
    assert "costs: 6 architectures' epoch seconds alone measured before training" in proc.stderr
    assert proc.stderr.count("cost ") >= 6 and "cost 6/6:" in proc.stderr
    trials = [t for t in study.get_trials(deepcopy=False) if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(trials) == 3 and len({t.user_attrs["alone_key"] for t in trials}) == 3
    assert all(t.user_attrs["alone_key"] in stored for t in trials)
    logs = tmp_path / "runs" / "s" / "workers"
    assert sorted(p.name for p in logs.iterdir()) == ["worker-0.log", "worker-1.log", "worker-costs.log"]
    assert "Traceback" not in "".join(p.read_text() for p in logs.iterdir())


# -- the simulator ---------------------------------------------------------------------------------

def test_the_cost_line_by_hand():
    assert CostSummary(39, 39, 84.4).line() == "costs: 39 architectures' epoch seconds alone measured before training (84 s)"
    assert CostSummary(39, 12, 8.44).line().endswith("(8.4 s; 12 now)")
    assert CostSummary(39, None, 84.4).line().endswith("(84 s)")


def test_the_simulators_clock_starts_after_the_cost_measurement(monkeypatch):
    table = json.loads((TABLES / "vit-cifar10-deep-head-tiny16.json").read_text())
    # By hand: 2,000 training images in batches of 128 are 16 steps an epoch; measuring times 5 + 16 of them,
    # so each architecture costs 21/16 of its mean epoch seconds.
    assert math.ceil(2000 / 128) == 16 and ALONE_SETTLE + min(ALONE_STEPS, 16) == 21
    by_hand = sum(statistics.fmean(r["epoch_seconds"] for r in a["runs"]) * 21 / 16 for a in table["architectures"])
    assert measuring_seconds(table) == pytest.approx(by_hand)
    cost = replay(simulation_search(table, space="deep-head", trials=3, sampler="cost", seed=0), table)
    # The same replay with a measurement that costs nothing: the same trials, the clock earlier by exactly that much.
    import headsearch.search.simulate as simulate

    monkeypatch.setattr(simulate, "measuring_seconds", lambda table: 0.0)
    free = replay(simulation_search(table, space="deep-head", trials=3, sampler="cost", seed=0), table)
    assert [t["arch"] for t in free.trials] == [t["arch"] for t in cost.trials] and len(cost.trials) == 3
    assert cost.seconds - free.seconds == pytest.approx(by_hand)
