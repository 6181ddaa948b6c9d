"""The search checks its own rungs (issue 39): Spearman's rho between each epoch's best value so far and the
final value of the trials that ran to the end (`headsearch.search.rungcheck`), in `report` (table, JSON,
plots) and as a one-time warning of `run`'s progress display. Hand-made studies with curves designed so
that each rho is known exactly; no training."""
from __future__ import annotations

import io
import json
import warnings

import optuna
import pytest
from optuna.trial import TrialState, create_trial
from rich.console import Console

from headsearch.search.report import summarize
from headsearch.search.rungcheck import (
    RungCorrelation,
    check_rungs,
    low_first_rung,
    ran_to_the_end,
    rung_correlations,
    rung_schedule,
    study_rungs,
)

COMPLETE = TrialState.COMPLETE


def trial(curve, state=COMPLETE, **attrs):
    """A FrozenTrial whose curve is `curve` (epochs from 1); a complete one's value is its best (max)."""
    values = [max(curve)] if state == COMPLETE else None
    return create_trial(state=state, values=values, intermediate_values=dict(enumerate(curve, start=1)), user_attrs=attrs)


def crossing(n=5):
    """n trials whose epoch-1 ranks are the reverse of their final ranks, and whose epoch 3 is their final
    value: rho -1 at epochs 1 and 2 (epoch 2 is lower than epoch 1 for all: the best so far is still
    epoch 1's), +1 at epoch 3."""
    return [trial([0.5 - 0.1 * i, 0.01 * i, 0.6 + 0.1 * i]) for i in range(n)]


def by_epoch(rows):
    return {r.epoch: r for r in rows}


# -- rung_correlations ------------------------------------------------------------------------------

def test_reversed_ranks_give_minus_one_and_kept_ranks_plus_one():
    rows = rung_correlations(crossing(), "maximize", rungs=[3])
    assert [(r.epoch, r.n, r.is_rung) for r in rows] == [(1, 5, False), (2, 5, False), (3, 5, True)]
    assert [r.rho for r in rows] == pytest.approx([-1.0, -1.0, 1.0])
    assert all(isinstance(r, RungCorrelation) for r in rows)
    assert not any(r.is_rung for r in rung_correlations(crossing(), "maximize"))  # no rungs given: none marked


def test_the_value_at_an_epoch_is_the_best_so_far_and_the_final_value_the_best_of_the_curve():
    # Epoch 2 dips for A: its best so far stays 0.9, so epoch 2 ranks A, B, C as the end does (raw values
    # would give rho -0.5).
    rows = by_epoch(rung_correlations([trial([0.9, 0.1, 0.95]), trial([0.5, 0.6, 0.7]), trial([0.2, 0.3, 0.4])], "maximize"))
    assert rows[2].rho == pytest.approx(1.0)
    # X peaks at epoch 2 (0.8) and ends at 0.5: its final value is 0.8, so the finals rank X > Y > Z and epoch 1
    # (Y > X > Z) gives rho 1 - 6 * (1 + 1 + 0) / (3 * (9 - 1)) = 0.5 (with the last values it would be 1).
    rows = by_epoch(rung_correlations([trial([0.3, 0.8, 0.5]), trial([0.4, 0.6, 0.7]), trial([0.1, 0.2, 0.3])], "maximize"))
    assert rows[1].rho == pytest.approx(0.5)
    assert rows[3].rho == pytest.approx(1.0)


def test_minimize_takes_the_lowest_value_so_far():
    # Losses: epoch 1 ranks the trials backwards, epoch 3 is each one's lowest and final value.
    trials = [create_trial(state=COMPLETE, values=[0.4 - 0.05 * i], intermediate_values={1: 0.5 + 0.1 * i, 2: 0.9, 3: 0.4 - 0.05 * i})
              for i in range(5)]
    rows = rung_correlations(trials, "minimize", rungs=[1, 3])
    assert [r.rho for r in rows] == pytest.approx([-1.0, -1.0, 1.0])
    assert [r.is_rung for r in rows] == [True, False, True]
    # Read as accuracies instead, the best of each curve is epoch 2's 0.9 for all: the finals are constant.
    assert [r.rho for r in rung_correlations(trials, "maximize")] == [None, None, None]
    with pytest.raises(ValueError, match="direction"):
        rung_correlations(trials, "up")


def test_fewer_than_three_trials_or_constant_values_give_no_rho():
    rows = rung_correlations(crossing(2), "maximize")
    assert [(r.n, r.rho) for r in rows] == [(2, None), (2, None), (2, None)]
    flat = [trial([0.5, 0.6 + 0.1 * i]) for i in range(4)]  # epoch 1 the same for all
    assert [(r.epoch, r.rho) for r in rung_correlations(flat, "maximize")] == [(1, None), (2, pytest.approx(1.0))]
    assert rung_correlations([], "maximize") == []


def test_only_trials_that_ran_to_the_end_count_and_later_rungs_count_those_that_reached_them():
    trials = crossing(4) + [
        trial([0.9, 0.1], state=TrialState.PRUNED),  # no final value
        trial([0.5, 0.01, 0.6], duplicate_of=0),  # an older study's duplicate: its twin's curve again
        trial([0.2], state=TrialState.PRUNED, rejected="3 heads do not divide 32"),
        trial([0.99, 0.99, 0.99], epochs_run=4),  # its last epoch's value is missing
        trial([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.99]),  # ran longer: the only one to reach rung 9
    ]
    assert [ran_to_the_end(t) for t in trials] == [True] * 4 + [False] * 4 + [True]
    rows = rung_correlations(trials, "maximize", rungs=[3, 9, 27])
    # Epochs 1-3 (every finished trial has them) and rung 9 (one trial reached it; 27 none).
    assert [(r.epoch, r.n, r.is_rung) for r in rows] == [(1, 5, False), (2, 5, False), (3, 5, True), (9, 1, True)]
    assert rows[-1].rho is None
    # The long trial is last at epoch 1 and first at the end: epoch 1 ranks the other four backwards too.
    assert rows[0].rho == pytest.approx(-1.0)
    assert [r.epoch for r in rung_correlations(trials, "maximize", rungs=[3, 9], epochs=[3])] == [3]


# -- low_first_rung ---------------------------------------------------------------------------------

def test_low_first_rung_says_which_rung_how_low_and_what_to_try():
    rows = [RungCorrelation(1, 12, 0.1), RungCorrelation(3, 12, 0.2, True), RungCorrelation(9, 12, 0.9, True)]
    text = low_first_rung(rows, 3, metric="accuracy")
    assert text == ("the first rung (epoch 3) ranks the finished trials poorly: Spearman's rho 0.20 between epoch 3"
                    " and the final accuracy over 12 trials; pruning there may drop slow starters (see `headsearch"
                    " report --pruning-audit`; try --pruner-min-epochs auto or a later rung)")
    assert "\n" not in text
    assert "final value over" in low_first_rung(rows, 3)


@pytest.mark.parametrize("rows, first", [
    ([RungCorrelation(3, 12, 0.5, True)], 3),  # at the threshold: not low
    ([RungCorrelation(3, 12, 0.9, True)], 3),
    ([RungCorrelation(3, 4, -1.0, True)], 3),  # too few trials to tell
    ([RungCorrelation(3, 12, None, True)], 3),  # not known
    ([RungCorrelation(3, 12, 0.1, True)], None),  # the pruner has no rungs
    ([RungCorrelation(3, 12, 0.1, True)], 9),  # no row at the first rung (no trial reached it)
    ([], 3),
])
def test_low_first_rung_is_none_when_nothing_is_wrong_or_known(rows, first):
    assert low_first_rung(rows, first) is None


def test_thresholds_can_be_changed():
    rows = [RungCorrelation(3, 3, 0.6, True)]
    assert low_first_rung(rows, 3) is None
    assert "rho 0.60" in low_first_rung(rows, 3, threshold=0.7, min_trials=3)


# -- a study's rungs ----------------------------------------------------------------------------------

def test_the_rungs_come_from_the_study_settings_or_the_rule_defaults():
    assert study_rungs({"pruner": "pareto"}, 30) == [3, 9, 27]  # ParetoRule's defaults
    assert study_rungs({"pruner": "asha"}, 10) == [1, 3, 9]  # RungRule's
    stored = {"pruner": "pareto", "pruner_options": {"min_epochs": 2, "reduction_factor": 2, "n_startup_trials": 3}}
    assert study_rungs(stored, 16) == [2, 4, 8, 16]
    assert rung_schedule({"pruner": "pareto", "pruner_options": {"min_epochs": "auto"}}) == (3, 3)
    for rule in ("median", "percentile", "hyperband", "multi-metric", "none", None):
        assert study_rungs({"pruner": rule}, 30) == []
    assert study_rungs({"pruner": "pareto"}, 2) == []


META = {"task": "vit-cifar10", "primary_metric": "accuracy", "pruner": "pareto", "epochs": 4,
        "objectives": [{"name": "accuracy", "direction": "maximize"}, {"name": "time", "direction": "minimize"}]}


def slow_starters(n=6):
    """4-epoch trials whose rank at the first rung (epoch 3) is the reverse of their final rank."""
    return [[0.5 - 0.05 * i] * 3 + [0.6 + 0.05 * i] for i in range(n)]


def test_check_rungs_marks_the_study_rungs_and_warns_on_the_first():
    trials = [trial(c, epochs_run=4) for c in slow_starters()]
    rows, warning = check_rungs(trials, META)
    assert [(r.epoch, r.is_rung) for r in rows] == [(1, False), (2, False), (3, True), (4, False)]
    assert warning.startswith("the first rung (epoch 3) ranks the finished trials poorly: Spearman's rho -1.00")
    assert "final accuracy over 6 trials" in warning
    assert check_rungs(trials[:2], META) == ([], None)  # fewer than 3 finished trials: no rows
    assert check_rungs(trials, {**META, "pruner": "median"})[1] is None  # no rungs: rows, no warning
    assert check_rungs(trials, {**META, "pruner": "median"})[0] == [RungCorrelation(r.epoch, r.n, r.rho) for r in rows]
    # Read as a loss, each curve's best is its lowest value, epochs 1-3: the first rung ranks as the end does.
    rows, warning = check_rungs(trials, {**META, "objectives": [{"name": "accuracy", "direction": "minimize"}]})
    assert by_epoch(rows)[3].rho == pytest.approx(1.0) and warning is None


# -- report: summarize, --format json, the table ------------------------------------------------------

def _study(url: str, curves) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=url, study_name="rungs", directions=["maximize", "minimize"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(["accuracy", "time"])
    study.set_user_attr("headsearch", META)
    for i, c in enumerate(curves):
        study.add_trial(create_trial(values=[max(c), 10.0 + i], intermediate_values=dict(enumerate(c, start=1)),
                                     user_attrs={"arch": f"trial {i}", "epochs_run": len(c)}))
    study.add_trial(create_trial(state=TrialState.PRUNED, intermediate_values={1: 0.1, 2: 0.1, 3: 0.1},
                                 user_attrs={"epochs_run": 3}))
    return study


def test_summarize_puts_the_rung_check_into_the_report_and_its_json(tmp_path):
    url = f"sqlite:///{tmp_path / 'rungs.db'}"
    _study(url, slow_starters())
    rep = summarize(url, None)
    assert [(r.epoch, r.n, r.is_rung) for r in rep.rung_check] == [(1, 6, False), (2, 6, False), (3, 6, True), (4, 6, False)]
    assert rep.rung_check[2].rho == pytest.approx(-1.0) and rep.rung_check[3].rho == pytest.approx(1.0)
    assert "the first rung (epoch 3)" in rep.rung_warning
    data = json.loads(json.dumps(rep.to_dict()))  # JSON as is
    assert data["rung_check"][2] == {"epoch": 3, "n": 6, "rho": pytest.approx(-1.0), "is_rung": True}
    assert data["rung_warning"] == rep.rung_warning

    few = f"sqlite:///{tmp_path / 'few.db'}"
    _study(few, slow_starters(2))
    rep = summarize(few, None)
    assert rep.rung_check == [] and rep.rung_warning is None
    assert rep.to_dict()["rung_check"] == []


def test_the_report_table_shows_the_rungs_line_and_the_warning(tmp_path, cli):
    url = f"sqlite:///{tmp_path / 'rungs.db'}"
    _study(url, slow_starters())
    result = cli(["report", "--storage", url])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    rungs = [x for x in lines if x.startswith("rungs: ")]
    assert rungs == ["rungs: Spearman's rho between each epoch and the final accuracy, over 6 finished trials:"
                     " epoch 1 -1.00; epoch 3 (rung) -1.00; epoch 4 (last) 1.00"]
    warning = [x for x in lines if x.startswith("warning: ")]
    assert len(warning) == 1 and "the first rung (epoch 3) ranks the finished trials poorly" in warning[0]
    assert "--pruner-min-epochs auto" in warning[0]


@pytest.mark.parametrize("with_rungs", [True, False])
@pytest.mark.slow  # matplotlib and plotly draw two figures
def test_the_plots_draw_the_rung_check_when_there_are_rows(tmp_path, with_rungs):
    pytest.importorskip("matplotlib")
    pytest.importorskip("plotly")
    from headsearch.search.plots import write_plots
    from headsearch.search.report import load_study

    url = f"sqlite:///{tmp_path / 'rungs.db'}"
    _study(url, slow_starters() if with_rungs else slow_starters(2))
    study = load_study(url, None)
    rep = summarize(url, None, study=study)
    paths, figures = write_plots(study, rep, tmp_path / "plots")
    names = {p.name for p in paths}
    assert ({"rungs-rungs.png", "rungs-rungs.html"} <= names) is with_rungs
    assert ("headsearch-rungs" in figures) is with_rungs
    if with_rungs:
        assert (tmp_path / "plots" / "rungs-rungs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "Spearman" in (tmp_path / "plots" / "rungs-rungs.html").read_text()


# -- run's progress: the warning, once ---------------------------------------------------------------

def _memory_study(meta=META) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.set_user_attr("headsearch", meta)
    return study


def _add(study, curves):
    for c in curves:
        study.add_trial(create_trial(values=[max(c), 1.0], intermediate_values=dict(enumerate(c, start=1)),
                                     user_attrs={"epochs_run": len(c)}))


def test_the_progress_warning_comes_once_and_is_checked_cheaply():
    from headsearch.search.rungcheck import RungWatch

    now = [0.0]
    study = _memory_study()
    watch = RungWatch(study, every=30, clock=lambda: now[0])
    _add(study, slow_starters(4))
    assert watch.warning(study.trials) is None  # 4 trials: too few to tell
    _add(study, slow_starters(6)[4:])
    assert "the first rung (epoch 3)" in watch.warning(study.trials)
    _add(study, slow_starters(1))
    now[0] += 3600
    assert watch.warning(study.trials) is None  # said once per run

    # Throttled: more complete trials within 30 s of the last check wait, unless it is the run's last look.
    watch = RungWatch(study, every=30, clock=lambda: now[0])
    kept = [trial([0.1 * i] * 4) for i in range(1, 6)]  # the first rung ranks them as the end does
    assert watch.warning(kept) is None
    crossed = [trial(c) for c in slow_starters()]
    now[0] += 29
    assert watch.warning(crossed) is None
    assert watch.warning(crossed, final=True) is not None
    assert RungWatch(_memory_study({**META, "pruner": "median"})).done  # no rungs: never checked


def test_the_plain_progress_log_prints_the_warning_once():
    from headsearch.cli.progress import SearchProgress

    study = _memory_study()
    buf = io.StringIO()
    with SearchProgress(study, 8, console=Console(file=buf, force_terminal=False, width=80)) as display:
        _add(study, slow_starters())
        display.refresh()
        _add(study, slow_starters(1))
        display.refresh()
    warnings_printed = [x for x in buf.getvalue().splitlines() if x.startswith("warning: ")]
    assert len(warnings_printed) == 1 and "the first rung (epoch 3)" in warnings_printed[0]


def test_a_search_without_the_display_warns_of_a_low_first_rung_once():
    """The API's searches get the check as an Optuna callback (`FIRST_RUNG_CHECK`, loaded like --callback)."""
    from headsearch.search.rungcheck import FIRST_RUNG_CHECK, RungWarning
    from headsearch.search.settings import load_callback

    check, study = load_callback(FIRST_RUNG_CHECK), _memory_study()
    _add(study, slow_starters())
    with pytest.warns(RungWarning, match="the first rung"):
        check(study, study.trials[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(study, study.trials[-1])  # said once per study
