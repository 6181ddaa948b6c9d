"""`headsearch run` end to end: real (tiny) trials on the real English-Spanish corpus, real storages.

Every trial here trains a real model: the translation task on /work/shared/data/spa-eng/spa.txt with a
search space whose `fixed` section shrinks it (d_model 32, 30 steps, 1,000 training pairs), so a
trial takes well under a second on one CPU thread. What is checked is what the storage holds after
a search: budgets ("up to N finished"), resume, intermediate values and pruning reasons, rejected
combinations, diverged trials, several workers on PostgreSQL, a killed worker (heartbeat + retry)
and Ctrl-C.

Threads: torch defaults to one thread per core; on a 2-core machine that is also running other
work, two threads make these tiny models ~10x slower than one. In-process searches run with one
thread (fixture `one_thread`) and subprocesses get OMP_NUM_THREADS=1.

PostgreSQL: tests that need it use $HEADSEARCH_TEST_PG (default
postgresql+psycopg2://postgres@127.0.0.1:5432/test, fixture `pg_url` in conftest.py); when it cannot
be reached they fail in CI and are skipped elsewhere.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
import weakref
from pathlib import Path

import numpy as np
import optuna
import pytest
from conftest import OWN_GROUP
import yaml
from optuna.trial import TrialState

from headsearch.errors import ConfigError, HeadsearchError
from headsearch.machine.plan import process_count, visible_gpus, worker_devices
from headsearch.search.pruning import MedianRule
from headsearch.search.runner import Search, SearchCallback, SearchSettings
from headsearch.search.storage import open_storage

TASK = "translation-en-es"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)

# The searched part of the space; its `fixed` section is the tiny translation model, data and steps of
# conftest.py (3 epochs of 10 steps here), which make each trial a fraction of a second.
SEARCHED = {
    "schedule": {"families": ["uniform", "halving", "doubling"], "heads": [1, 2, 4, 8]},
    "skip": ["none", "output", "scores"],
    "fusion": ["none", "add"],
}
TRAIN = {"epochs": 3, "max_steps_per_epoch": 10}


# ----------------------------------------------------------------------------------------- helpers


def space_dict(tiny: dict, *, ranges=None, train=None, **top) -> dict:
    """The space: SEARCHED with `ranges`, extra fixed train values and top-level keys replaced."""
    d = json.loads(json.dumps({**SEARCHED, "fixed": tiny}))
    d["fixed"]["train"] = {**TRAIN, **(train or {})}
    if ranges:
        d["ranges"] = ranges
    d.update(top)
    return d


@pytest.fixture(scope="session")
def write_space(tiny_translation):
    """`write_space(path, ranges=None, train=None, **top) -> path`: the space (`space_dict`) as YAML."""

    def write(path: Path, **kw) -> Path:
        path.write_text(yaml.safe_dump(space_dict(tiny_translation, **kw), sort_keys=False))
        return path

    return write


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


def settings_for(tmp_path: Path, spa_file: Path, space: Path, **kw) -> SearchSettings:
    base = dict(task=TASK, space=str(space), storage=sqlite_url(tmp_path / "h.db"),
                study="s", data_file=str(spa_file), run_root=str(tmp_path / "runs"), device="cpu")
    base.update(kw)
    return SearchSettings(**base)


@pytest.fixture
def make_settings(tmp_path, spa_file, write_space):
    """`make_settings(space=None, **settings)`: SearchSettings of a search in tmp_path (sqlite storage
    h.db, study "s", the CPU) on the default space unless `space` (a path) is given."""

    def make(space: Path | None = None, **kw) -> SearchSettings:
        return settings_for(tmp_path, spa_file, space or write_space(tmp_path / "space.yaml"), **kw)

    return make


def load(storage: str, study: str) -> optuna.Study:
    """The study, on any URL headsearch takes (journal: and redis:// through headsearch's own opener)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return optuna.load_study(study_name=study, storage=open_storage(storage, heartbeat=None))


def by_state(study: optuna.Study, *states: TrialState) -> list:
    return [t for t in study.get_trials(deepcopy=False) if t.state in states]


def finished(study: optuna.Study) -> list:
    return by_state(study, *FINISHED)


def epochs_1_to(n: int) -> list[int]:
    return list(range(1, n + 1))


def run_cmd(space: Path, storage: str, study: str, trials: int, spa_file: Path, run_root: Path, *extra) -> list[str]:
    return [sys.executable, "-m", "headsearch", "run", "--task", TASK, "--space", str(space), "--data-file", str(spa_file),
            "--storage", storage, "--study", study, "--trials", str(trials), "--run-root", str(run_root),
            "--device", "cpu", *map(str, extra)]


def sub_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "HEADSEARCH_CACHE": str(cache), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


class StoragePoller:
    """Reads a study that a subprocess is writing. None until `ready` exists (the first trial's run
    directory: the study is there by then, so the poller never races the worker creating the tables)."""

    def __init__(self, url: str, study: str, ready: Path):
        self.url, self.study, self.ready, self.storage = url, study, ready, None

    def trials(self) -> list | None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if self.storage is None:
                    if not self.ready.exists():
                        return None
                    self.storage = optuna.storages.RDBStorage(self.url)
                return optuna.load_study(study_name=self.study, storage=self.storage).get_trials(deepcopy=True)
        except Exception:  # the study is not there yet, or the database is busy: ask again
            return None


def wait_until(predicate, proc: subprocess.Popen, timeout: float, what: str):
    """Poll `predicate()` until it returns something truthy; fail if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the worker exited ({proc.returncode}) before {what}:\n{err[-3000:]}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}")


def running_after_a_complete_trial(poller: StoragePoller):
    """(trials, running trial) once a trial is COMPLETE and another RUNNING has reported >= 1 epoch."""
    trials = poller.trials()
    if not trials or not any(t.state == TrialState.COMPLETE for t in trials):
        return None
    running = [t for t in trials if t.state == TrialState.RUNNING and t.intermediate_values]
    return (trials, running[0]) if running else None


# ------------------------------------------------------------------ a real multi-objective search


@pytest.mark.floor
@pytest.mark.slow
def test_search_budget_curves_pruning_and_resume(tmp_path, spa_file, cache_env, one_thread, make_settings):
    settings = make_settings(trials=8, pruner="median", pruner_startup_trials=2)
    Search(settings).run_worker()

    study = load(settings.storage, "s")
    trials = study.get_trials(deepcopy=False)
    assert len(finished(study)) == 8
    duplicates = [t for t in trials if "duplicate_of" in t.user_attrs]
    held = [t for t in trials if "duplicate_of" not in t.user_attrs]
    assert len(held) == 8, [t.state.name for t in trials]  # nothing FAIL, RUNNING or WAITING left over ...
    assert all(t.state == TrialState.FAIL for t in duplicates)  # ... but the proposals of a held architecture
    assert len({json.dumps(t.user_attrs["config"], sort_keys=True) for t in held}) == 8  # 8 distinct architectures
    assert study.metric_names == ["bleu", "time"]
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    attrs = study.user_attrs["headsearch"]
    assert attrs["sampler"] == "nsga2" and attrs["pruner"] == "median" and attrs["primary_metric"] == "bleu"

    complete = by_state(study, TrialState.COMPLETE)
    pruned = [t for t in by_state(study, TrialState.PRUNED) if "rejected" not in t.user_attrs]
    assert complete and pruned, "8 trials with pruning from the third on: some are pruned, some complete"

    for t in complete:
        for key in ("config", "run_dir", "val_metrics", "arch", "epochs_run"):
            assert key in t.user_attrs, (t.number, key)
        run_dir = Path(t.user_attrs["run_dir"])
        final = json.loads((run_dir / "final.json").read_text())
        assert final["status"] == "completed"
        # one intermediate value per epoch run; the objective is the best of them (validation BLEU)
        assert sorted(t.intermediate_values) == epochs_1_to(3) == epochs_1_to(t.user_attrs["epochs_run"])
        assert t.values[0] == pytest.approx(max(t.intermediate_values.values()))
        assert t.values[0] == pytest.approx(t.user_attrs["val_metrics"]["bleu"])
        # time: the best epoch at the architecture's speed alone (epoch 1 measured it); the raw seconds beside it
        a = t.user_attrs
        assert t.values[1] == pytest.approx(a["best_seconds_alone"]) == pytest.approx(a["best_epoch"] * a["epoch_seconds_alone"])
        assert t.values[1] > 0 and a["best_train_seconds"] > 0
        if "duplicate_of" not in t.user_attrs:
            assert run_dir.name == f"trial-{t.number:05d}"
            assert t.user_attrs["config"] == yaml.safe_load((run_dir / "config.yaml").read_text())

    numbers = {t.number: t for t in trials}
    for t in pruned:
        reason = t.user_attrs["pruned"]
        assert set(reason) >= {"rule", "epoch", "value", "threshold", "n_compared"}
        assert reason["rule"] == "median" and reason["prune"] is True
        epoch = reason["epoch"]
        # the curve up to the pruning epoch is stored, and nothing after it
        assert sorted(t.intermediate_values) == epochs_1_to(epoch) == epochs_1_to(t.user_attrs["epochs_run"])
        assert reason["value"] == pytest.approx(max(t.intermediate_values.values()))  # best so far (BLEU: max)
        assert reason["threshold"] is not None and reason["value"] < reason["threshold"]  # strictly worse
        # The threshold is the median, at that epoch, of the trials COMPLETE when it was judged: with
        # one worker, the complete trials numbered before it.
        earlier = [o.intermediate_values[epoch] for o in complete if o.number < t.number]
        assert reason["n_compared"] == len(earlier) >= 2
        assert reason["threshold"] == pytest.approx(float(np.percentile(earlier, 50)))
        final = json.loads((Path(t.user_attrs["run_dir"]) / "final.json").read_text())
        assert final["status"] == "stopped" and final["epochs_run"] == epoch
    # ... and no complete trial should have been pruned: the same rule on the same curves keeps it at every epoch.
    rule = MedianRule("maximize", n_startup_trials=2)
    for t in complete:
        if "duplicate_of" not in t.user_attrs:
            earlier = [o.intermediate_values for o in complete if o.number < t.number]
            for epoch in t.intermediate_values:
                curve = {e: v for e, v in t.intermediate_values.items() if e <= epoch}
                assert not rule.decide(epoch, curve, earlier).prune, (t.number, epoch)
    for t in duplicates:  # a duplicate names the earlier trial that holds the same config, and was never trained
        twin = numbers[t.user_attrs["duplicate_of"]]
        assert twin.state in (TrialState.COMPLETE, TrialState.PRUNED) and twin.number < t.number
        assert t.user_attrs["config"] == twin.user_attrs["config"] and t.values is None and "run_dir" not in t.user_attrs

    # Resume: "up to N finished" -- the same settings add nothing.
    before = {t.number: (t.state, t.values) for t in trials}
    Search(settings).run_worker()
    study = load(settings.storage, "s")
    assert {t.number: (t.state, t.values) for t in study.get_trials(deepcopy=False)} == before

    # Raising the budget to 10 adds exactly two trials and changes none of the others.
    Search(make_settings(trials=10, pruner="median", pruner_startup_trials=2)).run_worker()
    study = load(settings.storage, "s")
    after = study.get_trials(deepcopy=False)
    assert len([t for t in after if "duplicate_of" not in t.user_attrs]) == 10 and len(finished(study)) == 10
    assert {t.number: (t.state, t.values) for t in after if t.number in before} == before


# ------------------------------------------------------------------------ single objective


@pytest.mark.floor
@pytest.mark.slow
def test_single_objective_uses_optunas_pruner_and_tpe(tmp_path, spa_file, cache_env, one_thread, make_settings):
    settings = make_settings(trials=6, objectives=("bleu",), pruner_startup_trials=2)
    search = Search(settings)
    assert not search.multi_objective
    assert search.sampler_name() == "tpe"
    assert isinstance(search.make_sampler(), optuna.samplers.TPESampler)
    optuna_pruner, curve_pruner = search.make_pruner()
    assert isinstance(optuna_pruner, optuna.pruners.MedianPruner) and curve_pruner is None
    search.run_worker()

    study = load(settings.storage, "s")
    assert len(study.directions) == 1 and study.direction == optuna.study.StudyDirection.MAXIMIZE
    assert study.metric_names == ["bleu"]
    assert study.user_attrs["headsearch"]["sampler"] == "tpe"
    assert len(finished(study)) == 6 == len(study.trials)
    pruned = by_state(study, TrialState.PRUNED)
    assert pruned, "seed 0 has trials pruned at epoch 1 by Optuna's MedianPruner"
    # Optuna's pruner decides as the curve rule does on the complete trials' curves (pruning.py's claim)
    rule = MedianRule("maximize", n_startup_trials=2)
    complete = by_state(study, TrialState.COMPLETE)
    for t in finished(study):
        if "duplicate_of" in t.user_attrs:
            continue
        earlier = [o.intermediate_values for o in complete if o.number < t.number]
        decisions = [rule.decide(e, {k: v for k, v in t.intermediate_values.items() if k <= e}, earlier).prune
                     for e in sorted(t.intermediate_values)]
        assert decisions == [False] * (len(decisions) - 1) + [t.state == TrialState.PRUNED], t.number
    for t in finished(study):
        n = t.user_attrs["epochs_run"]
        assert sorted(t.intermediate_values) == epochs_1_to(n)  # reported through Trial.report
        if t.state == TrialState.COMPLETE:
            assert n == 3 and t.value == pytest.approx(max(t.intermediate_values.values()))
        else:
            reason = t.user_attrs["pruned"]
            assert reason["note"].startswith("Optuna's pruner (single objective)") and reason["epoch"] == n
            assert reason["value"] == pytest.approx(t.intermediate_values[n])


# ------------------------------------------------------------------------ head diversity


def test_track_diversity_records_each_trials_scalars(cache_env, one_thread, make_settings):
    settings = make_settings(trials=2, pruner="none", track_diversity=8)
    Search(settings).run_worker()
    study = load(settings.storage, "s")
    assert study.user_attrs["headsearch"]["base_config"]["train"]["diversity_samples"] == 8
    complete = by_state(study, TrialState.COMPLETE)
    assert len(complete) == 2
    for t in complete:
        diversity = t.user_attrs["diversity"]  # at the best epoch (report correlates it with the objectives)
        assert diversity and all(v is None or isinstance(v, float) for v in diversity.values())
        if "duplicate_of" not in t.user_attrs:
            records = [json.loads(line) for line in (Path(t.user_attrs["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
            assert all(set(r["diversity"]) == set(diversity) for r in records)
            assert records[t.user_attrs["best_epoch"] - 1]["diversity"] == diversity


class PruneAtOnce(SearchCallback):
    """Keeps a weak reference to each trial's model and prunes every trial after its first epoch."""

    def __init__(self):
        self.models = []

    def on_evaluate(self, model, bound, record):
        self.models.append(weakref.ref(model))

    def on_epoch_end(self, record):
        raise optuna.TrialPruned("pruned by the test")


def test_a_pruned_trials_model_is_freed_when_it_ends(cache_env, one_thread, make_settings):
    """With the cyclic collector off, a pruned trial's model (on a GPU: its weights, graphs and optimizer
    state) is gone as soon as the trial is told: no reference cycle through the stored exception keeps
    it until the collector happens to run."""
    settings = make_settings(trials=2, pruner="none")
    search = Search(settings)
    pruning = PruneAtOnce()
    gc.collect()
    gc.disable()
    try:
        search.run_worker(callbacks=[pruning])
        alive = [ref() is not None for ref in pruning.models]
    finally:
        gc.enable()
    assert len(alive) == 2 and not any(alive)
    assert [t.state for t in load(settings.storage, "s").get_trials()] == [TrialState.PRUNED] * 2


@pytest.mark.floor
def test_a_storage_write_is_retried_when_the_storage_fails_for_a_moment(monkeypatch):
    """After Ctrl-C the interrupted trial is told FAIL; a storage briefly locked by another reader (SQLite)
    must not turn the interruption into a storage error that leaves the trial RUNNING."""
    from optuna.exceptions import StorageInternalError

    from headsearch.search.runner import with_storage_retries

    monkeypatch.setattr("time.sleep", lambda s: None)
    calls = []

    def locked_twice():
        calls.append(1)
        if len(calls) < 3:
            raise StorageInternalError("database is locked")
        return "told"

    assert with_storage_retries(locked_twice) == "told" and len(calls) == 3
    calls.clear()
    with pytest.raises(StorageInternalError):
        with_storage_retries(lambda: calls.append(1) or (_ for _ in ()).throw(StorageInternalError("down")), attempts=4)
    assert len(calls) == 4


# ------------------------------------------------------------------------ rejected combinations


@pytest.mark.slow
def test_invalid_combinations_are_rejected_untrained(tmp_path, spa_file, cache_env, one_thread, make_settings, write_space):
    space = write_space(tmp_path / "space.yaml", ranges={"d_model": [30, 32]},
                        schedule={"families": ["uniform", "halving", "doubling"], "heads": [4, 8]})
    settings = make_settings(space, trials=6, pruner="none")
    search = Search(settings)
    # Seed 0's first draws all take d_model 32: queue one trial of each d_model (the rest are sampled).
    opened = search.open()
    opened.enqueue_trial({"d_model": 30})
    opened.enqueue_trial({"d_model": 32})
    search.run_worker()

    study = load(settings.storage, "s")
    assert len(finished(study)) == 6 == len(study.trials)  # the queued (WAITING) trials counted in the budget
    rejected = [t for t in study.trials if t.params["d_model"] == 30]
    valid = [t for t in study.trials if t.params["d_model"] == 32]
    assert rejected and valid, [t.params for t in study.trials]
    run_dirs = study.user_attrs["headsearch"]["run_root"]
    for t in rejected:  # 4 and 8 heads never divide 30
        assert t.state == TrialState.PRUNED
        assert "does not divide" in t.user_attrs["rejected"] and "d_model = 30" in t.user_attrs["rejected"]
        assert "run_dir" not in t.user_attrs and "config" not in t.user_attrs and "pruned" not in t.user_attrs
        assert not t.intermediate_values
        assert not (Path(run_dirs) / f"trial-{t.number:05d}").exists()
    for t in valid:
        assert t.state == TrialState.COMPLETE and "rejected" not in t.user_attrs
        assert (Path(t.user_attrs["run_dir"]) / "final.json").exists()


# ------------------------------------------------------------------------ a diverging trial


@pytest.mark.slow
def test_diverged_trials_fail_and_do_not_count(tmp_path, spa_file, cache_env, one_thread, make_settings, write_space):
    space = write_space(tmp_path / "space.yaml", ranges={"lr": [1.0e-4, 1.0e30]})
    settings = make_settings(space, trials=4, pruner="none", timeout=150)
    start = time.monotonic()
    Search(settings).run_worker()
    assert time.monotonic() - start < 150, "the worker ran to its safety timeout instead of filling its budget"

    study = load(settings.storage, "s")
    failed = [t for t in by_state(study, TrialState.FAIL) if "duplicate_of" not in t.user_attrs]
    duplicates = [t for t in study.trials if "duplicate_of" in t.user_attrs]
    assert failed, "some trials draw lr = 1e4, which diverges"
    assert len(finished(study)) == 4  # the budget counts COMPLETE + PRUNED only ...
    assert len(study.trials) == 4 + len(failed) + len(duplicates)  # ... and each FAIL was replaced by one more trial
    for t in failed:
        assert t.params["lr"] == 1.0e30
        assert "diverged" in t.user_attrs["fail_reason"] and "non-finite loss" in t.user_attrs["fail_reason"]
        assert json.loads((Path(t.user_attrs["run_dir"]) / "final.json").read_text())["status"] == "diverged"
    for t in finished(study):
        assert t.params["lr"] == 1.0e-4 and t.state == TrialState.COMPLETE


def test_a_space_where_every_trial_diverges_stops_with_an_error(tmp_path, spa_file, cache_env, one_thread, make_settings, write_space):
    """FAIL trials do not fill the budget; so that the loop cannot spin, a worker refuses to go on once
    max(5, 2 * trials) trials failed -- also when started again."""
    space = write_space(tmp_path / "space.yaml", train={"lr": 1.0e30})
    settings = make_settings(space, trials=2, pruner="none", timeout=120)
    with pytest.raises(HeadsearchError, match="5 trials failed"):
        Search(settings).run_worker()
    study = load(settings.storage, "s")
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 5
    assert all("diverged" in t.user_attrs["fail_reason"] for t in study.trials)
    with pytest.raises(HeadsearchError, match="fix the cause"):
        Search(settings).run_worker()
    assert len(load(settings.storage, "s").trials) == 5


def test_interrupted_trials_do_not_count_toward_the_failure_cap(tmp_path, spa_file, cache_env, one_thread, make_settings):
    settings = make_settings(trials=2, pruner="none")
    search = Search(settings)
    study = search.open()
    for _ in range(3):  # what three Ctrl-C's leave behind (see the Ctrl-C test)
        study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={"fail_reason": "interrupted (Ctrl-C)"}))
    search.run_worker()
    assert len(finished(load(settings.storage, "s"))) == 2


# ------------------------------------------------------------------------ bad input for `run`


def _bad_space(**top):
    """The arguments of a space with `top` keys replaced: `make(tmp, write_space)`."""
    def make(tmp: Path, write_space) -> list[str]:
        return ["--space", str(write_space(tmp / "bad.yaml", **top))]
    return make


BAD_RUN_INPUTS = {
    "unknown space": (lambda tmp, _: ["--space", "no-such-space"], "unknown search space 'no-such-space'"),
    "unknown task": (lambda tmp, _: ["--task", "chess"], "unknown task 'chess'"),
    "unknown sampler": (lambda tmp, _: ["--sampler", "cmaes"], "unknown sampler 'cmaes'"),
    "unknown pruner": (lambda tmp, _: ["--pruner", "wavelet"], "unknown pruner 'wavelet'"),
    "unknown objective": (lambda tmp, _: ["--objectives", "bleu,accuracy"], "unknown objective 'accuracy'"),
    "objective twice": (lambda tmp, _: ["--objectives", "bleu,bleu"], "name one twice"),
    "space skip bogus": (_bad_space(skip=["bogus"]), "skip has unknown value(s) ['bogus']"),
    "space family spiral": (_bad_space(schedule={"families": ["spiral"]}), "schedule.families has unknown value(s) ['spiral']"),
    "space unknown key": (_bad_space(colour="red"), "unknown key(s) colour"),
    "space bad range": (_bad_space(ranges={"lr": {"low": 1, "high": 0}}), "ranges.lr"),
    "space for another task": (_bad_space(tasks=["vit-cifar10"]), "not translation-en-es"),
    "storage scheme": (lambda tmp, _: ["--storage", "foo://x"], "is not a storage URL"),
    "storage folder missing": (lambda tmp, _: ["--storage", f"sqlite:///{tmp}/nowhere/h.db"], "does not exist"),
    "zero trials": (lambda tmp, _: ["--trials", "0"], "--trials 0: give a number of trials >= 1"),
    "missing data file": (lambda tmp, _: ["--data-file", str(tmp / "nope.txt")], "does not exist"),
    "negative pruner startup": (lambda tmp, _: ["--pruner-startup", "-1"], "--pruner-startup-trials -1: give a number of trials >= 0"),
    "negative pruner warm-up": (lambda tmp, _: ["--pruner-warmup", "-1"], "--pruner-warmup-epochs -1: give a number of epochs >= 0"),
    "pruner percentile over 100": (lambda tmp, _: ["--pruner", "percentile", "--pruner-percentile", "150"],
                                   "--pruner-percentile 150: give a percentile in [0, 100]"),
    "workers and trials per GPU": (lambda tmp, _: ["--workers", "2", "--trials-per-gpu", "2"],
                                   "--workers and --trials-per-gpu both set the number of worker processes: pass one of them"),
    "workers 1 and trials per GPU": (lambda tmp, _: ["--workers", "1", "--trials-per-gpu", "1"], "pass one of them"),
    "zero trials per GPU": (lambda tmp, _: ["--trials-per-gpu", "0"], "--trials-per-gpu 0: run at least 1 trial per GPU"),
    "unknown compile mode": (lambda tmp, _: ["--compile", "fast"], "compile = 'fast' is not known"),
    "negative timeout": (lambda tmp, _: ["--timeout", "-5"], "--timeout -5: give a positive number of seconds"),
    "negative diversity samples": (lambda tmp, _: ["--track-diversity", "-1"], "--track-diversity -1: give 0 (off) or a number of samples"),
    "negative heartbeat": (lambda tmp, _: ["--heartbeat", "-1"], "--heartbeat -1"),
    "run root is a file": (lambda tmp, _: _file(tmp / "taken", "x") and ["--run-root", str(tmp / "taken")],
                           "is a file: give a folder for the trials' run directories"),
    "run root under a file": (lambda tmp, _: _file(tmp / "taken", "x") and ["--run-root", str(tmp / "taken" / "runs")],
                              "which is a file"),
    "no valid architecture in the space": (_bad_space(schedule={"families": ["uniform"], "heads": [7]}),
                                           "no architecture of space bad is valid for translation-en-es (200 random samples,"
                                           " all rejected), e.g. space bad: none of the head counts [7] divides d_model"),
    # The data is read once in this process before any worker starts: the same line as with one worker.
    "malformed data with two workers": (lambda tmp, _: ["--workers", "2", "--data-file", str(_file(tmp / "pairs.txt", "hello\n"))],
                                        "pairs.txt, line 1"),
    "storage is a folder": (lambda tmp, _: _folder(tmp / "db") and ["--storage", f"sqlite:///{tmp / 'db'}"], "is a folder, not a database file"),
    "storage is not SQLite": (lambda tmp, _: _file(tmp / "x.db", "not a database") and ["--storage", f"sqlite:///{tmp / 'x.db'}"],
                              "is not a SQLite database"),
}


def _file(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _folder(path: Path) -> Path:
    path.mkdir()
    return path
# Once checked only when the study was opened, after the storage (the SQLite file) was created; now with the
# settings (search/settings.py's SearchSettings fields): test_pruner_options_are_checked_before_the_storage_is_created.
LATE_CHECKS = ("negative pruner startup", "negative pruner warm-up", "pruner percentile over 100")


@pytest.fixture
def invoke_bad_run(tmp_path, spa_file, cache_env, monkeypatch, cli, write_space):
    """`invoke_bad_run(name)`: run `headsearch run` in-process on one bad input; return (result, expected
    text, db, work, files before)."""

    def invoke(name):
        work = tmp_path / "work"
        work.mkdir()
        monkeypatch.chdir(work)
        space = write_space(tmp_path / "space.yaml")
        db = work / "h.db"
        make_args, expected = BAD_RUN_INPUTS[name]
        args = ["run", "--task", TASK, "--space", space, "--data-file", spa_file, "--trials", "2",
                "--storage", sqlite_url(db), "--run-root", work / "runs", "--device", "cpu"]
        args += make_args(work, write_space)  # later options win
        before = sorted(work.rglob("*"))
        return cli(args), expected, db, work, before

    return invoke


@pytest.mark.floor
@pytest.mark.parametrize("name", list(BAD_RUN_INPUTS))
def test_run_bad_input_exits_2_and_creates_no_study(name, invoke_bad_run, cli):
    result, expected, db, work, before = invoke_bad_run(name)
    cli.error_line(result, expected)
    # No study. No database either, except for the late checks (an empty one: see the xfail test below).
    if name in LATE_CHECKS and db.exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert optuna.get_all_study_names(storage=sqlite_url(db)) == []
        before.append(db)
    # and nothing else: no budget lock, no run directories
    assert sorted(work.rglob("*")) == sorted(before)


@pytest.mark.floor
@pytest.mark.parametrize("name", LATE_CHECKS)
def test_pruner_options_are_checked_before_the_storage_is_created(name, invoke_bad_run):
    result, _, db, _, _ = invoke_bad_run(name)
    assert result.exit_code == 2
    assert not db.exists()


@pytest.mark.processes
def test_run_bad_space_in_a_real_subprocess(tmp_path, spa_file, tokenizer_cache, write_space):
    space = _bad_space(schedule={"families": ["spiral"]})(tmp_path, write_space)[1]
    db = tmp_path / "h.db"
    proc = subprocess.run(run_cmd(Path(space), sqlite_url(db), "s", 2, spa_file, tmp_path / "runs"), capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=sub_env(tokenizer_cache))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: search space ") and "spiral" in proc.stderr
    assert not db.exists() and not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------ worker processes and GPUs


def test_workers_go_round_robin_over_the_visible_gpus():
    assert worker_devices(3, []) == [None, None, None]  # no GPU: the processes share the CPU
    assert worker_devices(3, ["0"]) == ["0", "0", "0"]  # one GPU x K=3
    assert worker_devices(4, ["2", "3"]) == ["2", "3", "2", "3"]  # CUDA_VISIBLE_DEVICES=2,3 x K=2: its own IDs
    assert worker_devices(3, ["GPU-5f1c", "MIG-2a"]) == ["GPU-5f1c", "MIG-2a", "GPU-5f1c"]


def test_process_count_is_workers_or_trials_per_gpu_times_the_gpus():
    settings = lambda **kw: SearchSettings(task=TASK, **kw)  # noqa: E731
    assert process_count(settings(), 4) == 1
    assert process_count(settings(workers=3), 4) == 3
    assert process_count(settings(trials_per_gpu=2), 4) == 8
    assert process_count(settings(trials_per_gpu=2), 0) == 2  # no GPU: K processes on the CPU


@pytest.mark.parametrize("listed, visible", [("2,3", ["2", "3"]), (" 1 ,", ["1"]), ("", []), ("-1", []), ("0,-1,1", ["0"])])
def test_visible_gpus_are_the_ids_cuda_visible_devices_lists(listed, visible, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    assert visible_gpus() == visible


def test_trials_per_gpu_pins_workers_to_the_listed_gpus(monkeypatch, make_settings):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    auto = Search(make_settings(trials_per_gpu=2, device="auto"))
    assert auto.machine_plan().devices == ("2", "3", "2", "3")
    assert Search(make_settings(workers=3, device="auto")).machine_plan().devices == ("2", "3", "2")
    # --device cpu: no pinning, the processes share the CPU whatever GPUs there are.
    assert Search(make_settings(trials_per_gpu=2)).machine_plan().devices == (None, None)


def proposals(search: Search, n: int, study=None) -> list[dict]:
    """The parameters of the next `n` trials `search` asks for, under its budget lock as a worker does
    (sampled, not trained); on its own study unless `study` is given."""
    study = study if study is not None else search.open()
    out = []
    for _ in range(n):
        trial = search.scheduler.next_trial(study)
        search.space.sample(trial, search.base)
        out.append(trial.params)
    return out


def test_workers_asking_in_turn_propose_what_one_worker_would(tmp_path, spa_file, write_space):
    """The sampler is seeded by the index of the trial about to start, counted under the budget lock:
    which worker asks does not change what is proposed, so two workers never repeat each other's
    proposals (NSGA-II's first generation, 4 trials here, is drawn at random)."""
    space = write_space(tmp_path / "space.yaml")
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    alone = proposals(Search(settings_for(tmp_path / "one", spa_file, space, trials=6)), 4)
    a, b = Search(settings_for(tmp_path / "two", spa_file, space, trials=6)), Search(settings_for(tmp_path / "two", spa_file, space, trials=6))
    study_a, study_b = a.open(), b.open()
    in_turn = [proposals(w, 1, st)[0] for w, st in ((a, study_a), (b, study_b), (b, study_b), (a, study_a))]
    assert in_turn == alone
    assert all(p != q for i, p in enumerate(alone) for q in alone[i + 1:]), alone  # four different architectures


@pytest.mark.processes
@pytest.mark.slow
def test_trials_per_gpu_on_the_cpu_runs_k_workers_and_exactly_the_budget(tmp_path, spa_file, tokenizer_cache, write_space):
    space = write_space(tmp_path / "space.yaml")
    url = sqlite_url(tmp_path / "h.db")
    proc = subprocess.run(run_cmd(space, url, "s", 4, spa_file, tmp_path / "runs", "--trials-per-gpu", 2),
                          cwd=tmp_path, env=sub_env(tokenizer_cache),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = load(url, "s")
    assert len(finished(study)) == 4 == len(study.trials)
    logs = tmp_path / "runs" / "s" / "workers"
    assert sorted(p.name for p in logs.iterdir()) == ["worker-0.log", "worker-1.log"]
    assert "Traceback" not in "".join(p.read_text() for p in logs.iterdir())


# ------------------------------------------------------------------------ workers on PostgreSQL


def _check_budget_filled_once(url: str, study_name: str, n: int) -> optuna.Study:
    study = load(url, study_name)
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials].count(TrialState.FAIL) == 0
    assert len(finished(study)) == n == len(trials), [t.state.name for t in trials]
    assert sorted(t.number for t in trials) == list(range(n))
    return study


# Two `headsearch run` processes started together on one PostgreSQL study, as two nodes start them:
# tests/test_slurm_example.py (the Slurm job array's per-task command, run twice).


def shared_storage(kind: str, request, tmp_path: Path) -> tuple[str, str]:
    """(storage URL, study name) of a storage several workers share: SQLite, PostgreSQL, MySQL (MariaDB here), a
    journal file or a Redis journal."""
    if kind == "sqlite":
        return sqlite_url(tmp_path / "h.db"), "s"
    if kind == "postgresql":
        return request.getfixturevalue("pg_url"), request.getfixturevalue("pg_study")
    if kind == "mysql":
        return request.getfixturevalue("mysql_url"), request.getfixturevalue("mysql_study")
    if kind == "redis":
        return request.getfixturevalue("redis_url"), request.getfixturevalue("redis_study")
    return f"journal:{tmp_path / 'h.log'}", "s"


@pytest.mark.processes
@pytest.mark.floor
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_workers_option_runs_exactly_the_budget_on_each_shared_storage(kind, request, tmp_path, spa_file, tokenizer_cache,
                                                                        write_space):
    """`--workers 2` on the default storage and the one for many workers, each with its own budget lock
    (search/storage/): an flock, an advisory lock. The other storages' locks (GET_LOCK, an NFS-safe lock file, a
    Redis lock) hold four processes of the same loop in tests/test_light_workers.py, at a fifth of the cost."""
    url, study_name = shared_storage(kind, request, tmp_path)
    space = write_space(tmp_path / "space.yaml")
    proc = subprocess.Popen(run_cmd(space, url, study_name, 4, spa_file, tmp_path / "runs", "--workers", 2),
                            cwd=tmp_path, env=sub_env(tokenizer_cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    study = _check_budget_filled_once(url, study_name, 4)
    assert f"study {study_name}: " in out  # the summary
    logs = tmp_path / "runs" / study_name / "workers"
    assert sorted(p.name for p in logs.iterdir()) == ["worker-0.log", "worker-1.log"]
    assert "Traceback" not in "".join(p.read_text() for p in logs.iterdir())
    # the trials ran in the spawned worker processes, not in the command's own
    pids = {int(t.user_attrs["worker"].rsplit(":", 1)[1]) for t in study.trials}
    assert 1 <= len(pids) <= 2 and proc.pid not in pids


@pytest.mark.floor
def test_plain_postgresql_url_opens_with_the_postgres_extra(pg_url):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        open_storage(pg_url.replace("postgresql+psycopg2://", "postgresql://"), heartbeat=None)


@pytest.mark.floor
@pytest.mark.parametrize("url, drivers, hint", [
    ("mysql://u@127.0.0.1:3306/x", ["MySQLdb", "pymysql"], "the mysql driver is not installed: pip install pymysql"),
    ("postgresql://u@127.0.0.1:5432/x", ["psycopg", "psycopg2"],
     "the postgresql driver is not installed: pip install 'headsearch[postgres]' (psycopg2)"),
    ("redis://127.0.0.1:6379", ["redis"], "the redis driver is not installed: pip install 'headsearch[redis]' (redis)"),
])
def test_missing_driver_message_names_the_driver(url, drivers, hint, monkeypatch):
    for module in drivers:  # not importable here, whether or not it is installed
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(HeadsearchError) as e:
        open_storage(url, heartbeat=None)
    assert hint in str(e.value) and "None" not in str(e.value)


class FreshDatabase:
    """A new, empty database on the server of `url` (PostgreSQL or MySQL/MariaDB), dropped at the end."""

    def __init__(self, url: str):
        from sqlalchemy.engine import make_url

        self.parsed, self.base = make_url(url), url.rsplit("/", 1)[0]
        self.mysql = self.parsed.drivername.startswith("mysql")
        self.name = f"headsearch_fresh_{uuid.uuid4().hex[:10]}"

    def _admin(self, sql: str) -> None:
        u = self.parsed
        if self.mysql:
            import pymysql

            conn = pymysql.connect(host=u.host, port=u.port or 3306, user=u.username, password=u.password or "",
                                   autocommit=True)
        else:
            import psycopg2

            conn = psycopg2.connect(host=u.host, port=u.port or 5432, user=u.username, password=u.password,
                                    dbname="postgres")
            conn.autocommit = True
        try:
            conn.cursor().execute(sql)
        finally:
            conn.close()

    def __enter__(self) -> str:
        self._admin(f"CREATE DATABASE {self.quoted}")
        return f"{self.base}/{self.name}"

    def __exit__(self, *exc) -> None:
        self._admin(f"DROP DATABASE IF EXISTS {self.quoted}" + ("" if self.mysql else " WITH (FORCE)"))

    @property
    def quoted(self) -> str:
        return f"`{self.name}`" if self.mysql else f'"{self.name}"'


@pytest.mark.processes
@pytest.mark.floor
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_workers_starting_together_on_a_fresh_database(kind, request):
    """N processes opening one new, empty database at once (a Slurm array's nodes, a new CI machine): Optuna
    creates its tables on first use, and without headsearch's schema lock the losers of that race fail
    (MariaDB: "Table 'study_directions' already exists", 8 of 12 opens with 3 processes)."""
    url = request.getfixturevalue("pg_url" if kind == "postgresql" else "mysql_url")
    code = ("import sys, warnings; warnings.simplefilter('ignore');"
            "from headsearch.search.storage import open_storage; open_storage(sys.argv[1], 1)")
    errors = []
    for _ in range(2):  # each round: a fresh database and four workers opening it at once
        with FreshDatabase(url) as fresh:
            procs = [subprocess.Popen([sys.executable, "-c", code, fresh], stderr=subprocess.PIPE, text=True)
                     for _ in range(4)]
            errors += [err.strip().splitlines()[-1] for p in procs for err in [p.communicate(timeout=60)[1]] if p.returncode]
    assert not errors, errors


# ------------------------------------------------------------------------ a killed worker


SLOW_TRAIN = {"epochs": 3, "max_steps_per_epoch": 30}  # ~0.6 s per epoch: time to catch a trial mid-run
# The Ctrl-C test must interrupt the budget's last trial mid-run: give it a window of seconds, not one.
SLOWER_TRAIN = {"epochs": 12, "max_steps_per_epoch": 30}  # 1,000 pairs are 16 steps an epoch: length comes from epochs


@pytest.mark.processes
@pytest.mark.slow
def test_sigint_to_the_parent_alone_stops_its_workers(tmp_path, spa_file, tokenizer_cache, write_space):
    """`kill -INT` of the `headsearch run` process alone (not its process group, as a terminal's Ctrl-C
    would): its workers are told too, record their running trials as failed, and nobody trains on."""
    space = write_space(tmp_path / "space.yaml", train={"epochs": 200, "max_steps_per_epoch": 30})
    url = sqlite_url(tmp_path / "h.db")
    cmd = run_cmd(space, url, "s", 4, spa_file, tmp_path / "runs", "--pruner", "none", "--workers", 2)
    poller = StoragePoller(url, "s", tmp_path / "runs" / "s")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=sub_env(tokenizer_cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **OWN_GROUP)  # a process group of its own
    try:
        wait_until(lambda: len([t for t in poller.trials() or () if t.state == TrialState.RUNNING and t.intermediate_values]) == 2,
                   proc, 120, "two trials ran together")
        proc.send_signal(signal.SIGINT)  # the parent only
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert err.rstrip().endswith("run the same command to resume")
    trials = load(url, "s").get_trials(deepcopy=False)
    assert [t.state for t in trials].count(TrialState.RUNNING) == 0
    assert sorted(t.user_attrs.get("fail_reason") for t in trials if t.state == TrialState.FAIL) == ["interrupted (Ctrl-C)"] * 2
    # Worker processes (multiprocessing's spawn_main) of the group; its resource tracker may outlive the parent briefly.
    alive = subprocess.run(["pgrep", "-g", str(proc.pid), "-f", "spawn_main"], capture_output=True, text=True).stdout.split()
    assert alive == [], f"worker processes left running: {alive}"


@pytest.mark.processes
@pytest.mark.slow
def test_killed_worker_trial_is_failed_and_retried(tmp_path, spa_file, tokenizer_cache, write_space):
    space = write_space(tmp_path / "space.yaml", train=SLOWER_TRAIN)
    url, n = sqlite_url(tmp_path / "h.db"), 2
    cmd = run_cmd(space, url, "s", n, spa_file, tmp_path / "runs", "--heartbeat", 1, "--pruner", "none")
    env = sub_env(tokenizer_cache)
    poller = StoragePoller(url, "s", tmp_path / "runs" / "s")
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        trials, victim = wait_until(lambda: running_after_a_complete_trial(poller), first, 120,
                                    "a trial was running after one completed")
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
    assert first.returncode == -signal.SIGKILL
    done_before = {t.number: (t.values, t.intermediate_values) for t in trials if t.state == TrialState.COMPLETE}
    killed_at = time.monotonic()

    # The killed trial is stale after 3 x heartbeat without a beat; the next worker's trial start fails it.
    assert load(url, "s").trials[victim.number].state == TrialState.RUNNING  # nobody told the storage
    time.sleep(max(0.0, 3 * 1 + 0.5 - (time.monotonic() - killed_at)))
    second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]

    study = load(url, "s")
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert trials[victim.number].state == TrialState.FAIL
    retries = [t for t in trials.values() if t.system_attrs.get("failed_trial") == victim.number]
    assert len(retries) == 1
    retry = retries[0]
    assert retry.number > victim.number and retry.params == victim.params
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["run_dir"].endswith(f"trial-{retry.number:05d}")
    assert len(finished(study)) == n
    assert len(trials) == n + 1  # the budget, plus the killed trial
    for number, (values, curve) in done_before.items():  # no finished trial lost or changed
        assert trials[number].state == TrialState.COMPLETE
        assert trials[number].values == values and trials[number].intermediate_values == curve


# ------------------------------------------------------------------------ Ctrl-C


@pytest.mark.processes
@pytest.mark.slow
def test_ctrl_c_fails_the_running_trial_and_the_same_command_resumes(tmp_path, spa_file, tokenizer_cache, write_space):
    space = write_space(tmp_path / "space.yaml", train=SLOWER_TRAIN)
    url, n = sqlite_url(tmp_path / "h.db"), 2
    cmd = run_cmd(space, url, "s", n, spa_file, tmp_path / "runs", "--pruner", "none")
    env = sub_env(tokenizer_cache)
    poller = StoragePoller(url, "s", tmp_path / "runs" / "s")
    # A shell's background jobs inherit SIGINT as ignored, and Python then installs no KeyboardInterrupt handler:
    # the suite runs with Python's own (conftest.py), which the child's exec resets to the default, as a terminal
    # would give it, whatever launched pytest.
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        trials, victim = wait_until(lambda: running_after_a_complete_trial(poller), proc, 120,
                                    "a trial was running after one completed")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in out + err
    # The error is the last thing on stderr. (It should start a line of its own: it does not, because the
    # live display leaves its last row open on a non-terminal -- test_live_display_ends_its_last_line.)
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].rstrip().endswith(
        "error: interrupted: finished trials are kept in the study; run the same command to resume"), lines[-3:]
    assert err.count("error: ") == 1
    assert "1 failed" in out  # the summary is printed on the way out

    study = load(url, "s")
    now = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert now[victim.number].state == TrialState.FAIL
    assert now[victim.number].user_attrs["fail_reason"] == "interrupted (Ctrl-C)"
    done_before = {t.number: t.values for t in trials if t.state == TrialState.COMPLETE}
    for number, values in done_before.items():
        assert now[number].state == TrialState.COMPLETE and now[number].values == values

    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    study = load(url, "s")
    assert len(finished(study)) == n
    assert len(study.trials) == n + 1  # the budget, plus the interrupted trial (not retried: it did not die)
    assert study.trials[victim.number].state == TrialState.FAIL
    for number, values in done_before.items():
        assert study.trials[number].values == values


def test_live_display_ends_its_last_line_on_a_non_terminal():
    import io

    from rich.console import Console

    from headsearch.cli.progress import SearchProgress

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study = optuna.create_study(directions=["maximize", "minimize"])
    buf = io.StringIO()
    with SearchProgress(study, 3, console=Console(file=buf, force_terminal=False, width=120)):
        pass
    assert buf.getvalue().endswith("\n"), repr(buf.getvalue()[-80:])



@pytest.mark.floor
def test_a_study_resumes_with_compile_changed_but_not_with_the_seed_changed(tmp_path, spa_file, make_settings):
    from headsearch.errors import HeadsearchError

    Search(make_settings()).open()
    Search(make_settings(compile="default")).open()  # how trials run, not what they compute
    with pytest.raises(HeadsearchError, match="different base_config"):
        Search(make_settings(seed=7)).open()


# -- what the installed Optuna can run ---------------------------------------------------------------


@pytest.mark.floor
def test_gp_with_several_objectives_is_refused_on_an_optuna_without_it(monkeypatch):
    import optuna

    from headsearch.search.study import check_sampler, release

    assert [release(v) for v in ("4.0.0", "4.4.0.dev0", "5.0.0rc1", "2.11.0+cu130")] == [(4, 0, 0), (4, 4, 0), (5, 0, 0), (2, 11, 0)]
    monkeypatch.setattr(optuna, "__version__", "4.3.0")
    with pytest.raises(ConfigError, match=r"^--sampler gp with 2 objectives needs optuna >= 4.4 \(installed: 4.3.0\)"):
        check_sampler("gp", 2)
    check_sampler("gp", 1)  # one objective: every Optuna 4 has it
    check_sampler("nsga2", 2)
    monkeypatch.setattr(optuna, "__version__", "4.4.0")
    check_sampler("gp", 2)


@pytest.mark.floor
def test_gp_without_scipy_is_refused_in_one_line(monkeypatch):
    import importlib.util

    from headsearch.search.study import check_sampler

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "scipy" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^--sampler gp needs scipy, which is not installed: pip install scipy"):
        check_sampler("gp", 1)
    check_sampler("tpe", 1)


@pytest.mark.floor
def test_the_installed_optuna_runs_exactly_what_the_sampler_check_lets_through():
    """On the floor's Optuna the check refuses GP with two objectives and Optuna itself fails there; on a
    newer one the check lets it through and a two-objective GP search runs past its random start-up."""
    import optuna

    from headsearch.search.study import check_sampler, make_sampler

    def objective(trial):
        x = trial.suggest_float("x", 0, 1)
        return x, (1 - x) ** 2

    study = optuna.create_study(directions=["maximize", "minimize"], sampler=make_sampler("gp", seed=0, trials=12))
    try:
        check_sampler("gp", 2)
    except ConfigError:
        with pytest.raises(ValueError, match="multi-objective optimization"):
            study.optimize(objective, n_trials=12)
        return
    study.optimize(objective, n_trials=12)
    assert len([t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]) == 12
