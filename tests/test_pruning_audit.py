"""The pruning audit (`headsearch report --pruning-audit`) and the dashboard notes, on a study made by hand.

The study: accuracy (maximised) and time (minimised), 6 epochs a trial, the Pareto rule at rungs 3, 9, ...
(min_epochs 3, reduction factor 3) judging from 2 trials on, with no noise margin (MO-ASHA as published).
Each trial's point at epoch e is (accuracy so far, e x its epoch seconds). The curves are made so that each
rule's decisions can be followed by hand:

    trial  s/epoch  accuracy by epoch                  state in the study
    0      10       .50 .60 .70 .75 .78 .80            complete (dominated by 1: same time, less accurate)
    1      10       .60 .70 .80 .85 .88 .90            complete, front
    2      20       .30 .50 .82 .90 .93 .95            complete, front (the most accurate, slow to start)
    3      10       .55 .60 .62                        pruned at 3 (behind 1, 2 and 0)
    4       5       .40 .45 .50 .52 .55 .56            complete, front (the fastest)
    5      10       .20 .40 .75                        pruned at 3 (dominated by 1; 1, 2 and 4 ahead)
    6      -        -                                  rejected (never trained)
    7      -        -                                  duplicate of 1 (FAIL, not trained)

Pareto at rungs 3 (min_epochs 3, r 3; 9 is past the end) decides as the study did: 0 and 1 are judged
against fewer than 2 trials; 2 at epoch 3 (0.82 after 60 s) is on the first front; 3 (0.62, 30 s) has 3 of 4
ahead, where the top ceil(4/3) = 2 go on; 5 (0.75, 30 s) has 1, 2 and 4 ahead of it, the top 2 of 6 go on.
30 epochs against no pruning's 36.

Pareto at rungs 1, 3 (min_epochs 1): at epoch 1 trial 2 (0.30 after 20 s) is behind both 0 and 1 (0.50 and
0.60 after 10 s) -> pruned, losing a front member; 3 survives epoch 1 (only 1 ahead, the top 2 of 4 go on)
and is pruned at 3 as before (0 and 1 ahead; 2 stopped at 1, so only 2 others have a value there: top 1 of
3); 5 is pruned at epoch 1 (1, 4, 3 and 0 ahead). 6 + 6 + 1 + 3 + 6 + 1 = 23 epochs.
"""
import json
import time
import warnings

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from headsearch.search.audit import RuleSpec, pruning_audit

EPOCHS = 6
SECONDS = {0: 10.0, 1: 10.0, 2: 20.0, 3: 10.0, 4: 5.0, 5: 10.0}
CURVES = {
    0: (0.50, 0.60, 0.70, 0.75, 0.78, 0.80),
    1: (0.60, 0.70, 0.80, 0.85, 0.88, 0.90),
    2: (0.30, 0.50, 0.82, 0.90, 0.93, 0.95),
    3: (0.55, 0.60, 0.62),
    4: (0.40, 0.45, 0.50, 0.52, 0.55, 0.56),
    5: (0.20, 0.40, 0.75),
}
FRONT = [1, 2, 4]
PRUNED_3 = {"prune": True, "rule": "pareto", "epoch": 3, "value": 0.62, "threshold": None, "n_compared": 3,
            "note": "front 3: 3 trials in fronts ahead of it, the top 2 of 4 go on", "ahead": [1, 2, 0]}
# An older record: no "ahead".
PRUNED_5 = {"prune": True, "rule": "pareto", "epoch": 3, "value": 0.75, "threshold": None, "n_compared": 5,
            "note": "front 2: 3 trials in fronts ahead of it, the top 2 of 6 go on"}


def make_study(url: str, name: str = "audit", **options) -> optuna.Study:
    """The study of the module docstring, shaped as `headsearch run` writes one (no training)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=url, study_name=name, directions=["maximize", "minimize"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(["accuracy", "time"])
    study.set_user_attr("headsearch", {
        "task": "vit-cifar10", "primary_metric": "accuracy", "epochs": EPOCHS, "trials": 6, "seed": 0,
        "objectives": [{"name": "accuracy", "direction": "maximize"}, {"name": "time", "direction": "minimize"}],
        "sampler": "nsga2", "pruner": "pareto", "workers": 2,
        "pruner_options": {"n_startup_trials": 2, "min_epochs": 3, "reduction_factor": 3, "n_warmup_epochs": 0,
                           "noise_margin": 0.0, "noise": None, **options}})
    dist = {"n": CategoricalDistribution(list(range(8)))}

    def add(number, state, values=None, curve=(), **attrs):
        ua = {"config": {"arch": {"enc_heads": [number + 1] * 2}, "train": {"epochs": EPOCHS}}, "arch": f"arch {number}",
              **attrs}
        study.add_trial(create_trial(state=state, params={"n": number}, distributions=dist, values=values,
                                     intermediate_values=dict(enumerate(curve, start=1)), user_attrs=ua))

    for n, curve in CURVES.items():
        common = dict(curve=curve, epoch_seconds_alone=SECONDS[n], params=1000 * (n + 1), epochs_run=len(curve))
        if len(curve) == EPOCHS:
            add(n, TrialState.COMPLETE, values=[curve[-1], EPOCHS * SECONDS[n]], **common)
        else:
            add(n, TrialState.PRUNED, pruned=PRUNED_3 if n == 3 else PRUNED_5, **common)
    add(6, TrialState.PRUNED, rejected="enc_heads[0] = 7 does not divide d_model")
    add(7, TrialState.FAIL, duplicate_of=1)
    return study


@pytest.fixture
def study(tmp_path):
    return make_study(f"sqlite:///{tmp_path / 'audit.db'}")


def test_the_audit_by_hand(study):
    audit = pruning_audit(study)
    assert audit.trials == 6 and audit.front == FRONT and audit.epochs == EPOCHS
    assert audit.own_rule == "pareto" and audit.options_stored and audit.options["n_startup_trials"] == 2

    none = audit.rule("none")
    assert (none.epochs, none.epochs_at_most, none.epochs_saved, none.fewer_than_none) == (36, 36, 0, 1.0)
    assert none.pruned == [] and none.front_lost == [] and none.unknown == 2 and none.unknown_trials == [3, 5]

    own = audit.rule("pareto", 3, 3)
    assert own.own and own.rungs == [3] and own.rungs_text == "3 (top 1/3)"
    assert [(s.number, s.epoch) for s in own.pruned] == [(3, 3), (5, 3)]
    assert (own.epochs, own.epochs_saved, own.front_lost, own.unknown) == (30, 6, [], 0)
    assert own.fewer_than_none == pytest.approx(36 / 30)
    assert audit.own_differs == []  # the replay of the study's own rule decides as the study did

    early = audit.rule("pareto", 1, 3)
    assert not early.own and early.rungs == [1, 3]
    assert [(s.number, s.epoch) for s in early.pruned] == [(2, 1), (3, 3), (5, 1)]
    assert (early.epochs, early.epochs_saved, early.front_lost, early.unknown) == (23, 13, [2], 0)
    assert early.fewer_than_none == pytest.approx(36 / 23)

    # Rungs 4, 8, ... (only 4 before the end): 3 and 5 were pruned at 3 and have no value at 4, so the rule
    # lets them run on: unknown, counted with the 3 epochs known (it could still stop them at 4), 6 at most.
    late = audit.rule("pareto", 4, 2)
    assert late.pruned == [] and late.unknown == 2 and (late.epochs, late.epochs_at_most) == (30, 36)

    # The default rules: none, the own rule, pareto at each rung set whose first rung is before epoch 6
    # ((9, 3) is left out; (3, 3) is the own rule, once), asha and multi-metric.
    assert [(r.rule, r.min_epochs, r.reduction_factor) for r in audit.rules] == [
        ("none", None, None), ("pareto", 3, 3), ("pareto", 1, 3), ("pareto", 2, 2), ("pareto", 4, 2),
        ("asha", 1, 3), ("multi-metric", None, None)]
    assert sum(r.own for r in audit.rules) == 1
    json.dumps(audit.to_dict())  # JSON as it is


def test_the_study_noise_margin_is_replayed_and_a_replay_that_differs(tmp_path):
    """With the noise margin the search now gives (1 sigma, here a given sigma of 0.06), trial 5 at epoch 3
    counts as 0.81 after 30 s: no longer behind trial 1 (0.80), it is on the first front and runs on. Its
    epochs after 3 were never trained: unknown, and counted to the end (no rung is left before epoch 6)."""
    study = make_study(f"sqlite:///{tmp_path / 'noise.db'}", noise_margin=1.0, noise=0.06)
    audit = pruning_audit(study)
    own = audit.rule("pareto", 3, 3)
    assert own.own and [(s.number, s.epoch) for s in own.pruned] == [(3, 3)]
    assert (own.unknown_trials, own.epochs, own.epochs_at_most) == ([5], 33, 33)
    assert audit.own_differs == [5]  # the study (no margin then) pruned it


def test_chosen_rules(study):
    """Rules by name or RuleSpec; no pruning is always there to measure against. Replaying asha (accuracy
    alone, rungs 1, 3) says how it would have treated the same trials."""
    audit = pruning_audit(study, rules=[RuleSpec("asha", 1, 3), "median"])
    assert [r.rule for r in audit.rules] == ["none", "asha", "median"]
    asha = audit.rule("asha")
    # Epoch 1, top ceil(3/3) = 1 of 0.50, 0.60, 0.30 -> 2 pruned; 3 (0.55 vs 0.50, 0.60, 0.30: 1 ahead, top 2
    # of 4) kept; at 3 against 0.70, 0.80 -> pruned; 4 at 1 (0.40 vs .5 .6 .3 .55: 3 ahead, top 2) pruned;
    # 5 at 1 (0.20: 4 ahead, top 2) pruned.
    assert [(s.number, s.epoch) for s in asha.pruned] == [(2, 1), (3, 3), (4, 1), (5, 1)]
    assert asha.front_lost == [2, 4] and asha.epochs == 6 + 6 + 1 + 3 + 1 + 1
    # median never compares pruned trials and judges every epoch from 2 complete trials on.
    assert audit.rule("median").rungs is None and audit.rule("median").rungs_text == "every epoch"


def test_the_audit_is_fast_on_fifty_trials(tmp_path):
    """50 trials of 16 epochs: every default rule replayed in a few seconds."""
    import random

    rng = random.Random(0)
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'big.db'}", directions=["maximize", "minimize"])
    study.set_user_attr("headsearch", {"primary_metric": "accuracy", "epochs": 16, "trials": 50, "pruner": "pareto",
                                       "objectives": [{"name": "accuracy", "direction": "maximize"},
                                                      {"name": "time", "direction": "minimize"}]})
    trials = []
    for n in range(50):
        rate, top, secs = rng.uniform(0.1, 0.6), rng.uniform(0.5, 0.95), rng.uniform(1, 20)
        curve = [top * (1 - (1 - rate) ** e) for e in range(1, 17)]
        ran = 16 if n % 3 else 3
        state = TrialState.COMPLETE if ran == 16 else TrialState.PRUNED
        trials.append(create_trial(state=state, values=[max(curve), 16 * secs] if ran == 16 else None,
                                   intermediate_values=dict(enumerate(curve[:ran], start=1)),
                                   user_attrs={"epoch_seconds_alone": secs, "params": 1000 + n, "epochs_run": ran}))
    study.add_trials(trials)
    start = time.perf_counter()
    audit = pruning_audit(study)
    assert time.perf_counter() - start < 10
    assert audit.trials == 50 and len(audit.rules) == 8
    assert pruning_audit(study).to_dict() == audit.to_dict()  # deterministic


# ------------------------------------------------------------------------------ the CLI


def test_report_pruning_audit_table_and_json(study, tmp_path, cli):
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    result = cli(["report", "--storage", url, "--study", "audit", "--pruning-audit"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "pruning audit: 6 trained trials' curves replayed under each rule (* this study's rule)" in out
    rows = {" ".join(c.strip() for c in line.split("│")[1:3]): [c.strip() for c in line.split("│")[3:-1]]
            for line in out.splitlines() if line.startswith("│") and ("pareto" in line or "none" in line)}
    # epochs, saved, trials pruned, front lost, unknown, false prunes (of the stops whose end is known: 1 of 1 on the
    # front, Wilson's 95% interval (0.21, 1); the study's own stops were pruned for good, their ends unknown: -)
    assert rows["none -"] == ["36", "-", "0", "-", "2", "-"]
    assert rows["pareto * 3 (top 1/3)"] == ["30", "6 (1.20x fewer)", "2", "-", "0", "-"]
    assert rows["pareto 1, 3 (top 1/3)"] == ["23", "13 (1.57x fewer)", "3", "2", "0", "1/1: 100% (21%-100%)"]
    assert rows["pareto 4 (top 1/2)"] == ["30-36", "0-6 (1.00-1.20x fewer)", "0", "-", "2", "-"]
    assert "front: trials 1, 2, 4" in out

    result = cli(["report", "--storage", url, "--study", "audit", "--pruning-audit", "--format", "json"])
    assert result.exit_code == 0, result.output
    audit = json.loads(result.stdout)["pruning_audit"]
    assert audit == pruning_audit(study).to_dict()
    own = [r for r in audit["rules"] if r["own"]]
    assert [(r["rule"], r["epochs"], r["pruned"]) for r in own] == [
        ("pareto", 30, [{"number": 3, "epoch": 3}, {"number": 5, "epoch": 3}])]

    # Without the flag the report carries no audit; with csv or --robust the flag is refused in one line.
    result = cli(["report", "--storage", url, "--format", "json"])
    assert "pruning_audit" not in json.loads(result.stdout)
    cli.error_line(cli(["report", "--storage", url, "--pruning-audit", "--format", "csv"]), "--pruning-audit")


# ------------------------------------------------------------------------------ dashboard notes


def _notes(study) -> dict:
    """Every note of `study` as optuna-dashboard reads it back (its own reader), by trial number ("study": the study's)."""
    from optuna_dashboard._note import get_note_from_system_attrs

    attrs = study._storage.get_study_system_attrs(study._study_id)
    notes = {t.number: get_note_from_system_attrs(attrs, t._trial_id)["body"] for t in study.get_trials()}
    notes["study"] = get_note_from_system_attrs(attrs, None)["body"]
    return {k: v for k, v in notes.items() if v}


def test_dashboard_notes_say_why_each_trial_was_pruned(study, optuna_dashboard):
    from optuna_dashboard import save_note

    from headsearch.search.notes import write_dashboard_notes

    done = write_dashboard_notes(study)
    assert done.written == ["trial 3", "trial 5", "study"] and done.summary() == "the study's note, 2 pruned trials' notes"
    notes = _notes(study)
    assert set(notes) == {3, 5, "study"}  # not the rejected trial 6, nor the complete ones
    assert notes[3].splitlines() == [
        "**Pruned at epoch 3** (the first rung; rung 3) **by the pareto rule.**",
        "",
        "Its point there: accuracy 0.62 so far, time 30 s so far (3 epochs x 10 s alone).",
        "Ranked behind trials #0, #1, #2 (those ahead of it at epoch 3).",
        "",
        "The rule's record: pareto rule at epoch 3: 0.62 (3 trials compared); front 3: 3 trials in fronts ahead of"
        " it, the top 2 of 4 go on.",
    ]
    assert "Ranked behind" not in notes[5] and "accuracy 0.75 so far" in notes[5]  # an older record: no "ahead"
    assert "Plan: pareto pruning at rung 3 of 6 epochs (the top 1/3 go on at each), judging once 2 trials reached" \
           " an epoch; 2 workers." in notes["study"]
    assert "Saved: 6 trained trials ran 30 epochs; without pruning 36 -> 6 epochs saved (17%)." in notes["study"]

    # Again: nothing to write. A note someone edited in the dashboard stays theirs; an empty one is written again.
    assert write_dashboard_notes(study).unchanged == ["trial 3", "trial 5", "study"]
    save_note(study, "my own notes")
    done = write_dashboard_notes(study)
    assert done.kept == ["study"] and not done.written and _notes(study)["study"] == "my own notes"
    save_note(study, "")
    assert write_dashboard_notes(study).written == ["study"] and _notes(study)["study"] == notes["study"]


@pytest.mark.slow
def test_report_plots_writes_the_notes(study, tmp_path, cli, optuna_dashboard):
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    result = cli(["report", "--storage", url, "--plots", tmp_path / "plots"])
    assert result.exit_code == 0, result.output
    assert "notes saved in the study for optuna-dashboard: the study's note, 2 pruned trials' notes" in result.stdout
    assert set(_notes(study)) == {3, 5, "study"}


@pytest.mark.server
@pytest.mark.slow
def test_a_pruned_trials_note_on_its_dashboard_page(study, tmp_path, optuna_dashboard, processes):
    """`headsearch dashboard` writes the notes before serving; headless Chromium renders trial 3's page, as the
    dashboard draws it from what it serves (the pattern of test_report_export's browser test)."""
    import subprocess
    import sys

    from test_report_export import _chromium, _free_port, _Page, _render, _studies_once_up

    chromium = _chromium()
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    port = _free_port()
    with open(tmp_path / "dashboard.log", "w") as log:
        server = processes.start([sys.executable, "-m", "headsearch", "dashboard", "--storage", url, "--port", str(port),
                                  "--study", "audit"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    (summary,) = [s for s in _studies_once_up(server, base)["study_summaries"] if s["study_name"] == "audit"]
    dom = _render(chromium, f"{base}/dashboard/studies/{summary['study_id']}/trials?numbers=3", tmp_path / "trial.png",
                  processes)
    processes.stop(server, grace=10)
    (tmp_path / "trial.html").write_text(dom)
    texts = _Page(dom).root.texts()
    assert "Pruned at epoch 3" in texts and "by the pareto rule." in texts, texts[:80]
    assert any("Ranked behind trials #0, #1, #2" in t for t in texts), texts[:80]
    assert "notes written for optuna-dashboard: the study's note, 2 pruned trials' notes" in (tmp_path / "dashboard.log").read_text()
