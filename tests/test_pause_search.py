"""Pause instead of kill in a real search (--pruner-pause): a trial its rule stops keeps its state and is told PRUNED
with `paused`; a later trial resumes it (`resumes`) when the rule, asked again, lets it go on. The budget counts
the paused trial's place once, the resumption's curve holds the whole run, and it equals the same architecture
trained straight through."""
from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from headsearch.search.pruning import PruneDecision, PruningRule, register_pruner
from headsearch.search.pruning.registry import REACHED, RULES
from headsearch.search.record import counts_toward_budget, epochs_trained
from headsearch.search.report import pruning_savings
from test_custom_task import NAME, SPACE, planted  # noqa: F401 (a fixture)
from test_pause import TIMINGS


class FewSeen:
    """A scripted rule with rungs at epochs 2 and 3: a trial is stopped at a rung while fewer than 3 other trials
    have reached it, and goes on once 3 have. Trained one at a time on a budget of 4 (4 epochs each): trials 0-2
    stop at 2, trial 3 at 3; asked again, trial 0 goes on (trial 4) and stops at 3, trial 1 likewise (5), trial 2
    goes on to the end (6), then trial 3 (7), then the resumptions 4 and 5 are resumed in turn (8, 9): every run
    completes, two of them in three pieces."""

    rule = "few-seen"
    interrupt = False  # Ctrl-C at the first epoch 3 judged with another trial there: trial 0's first resumption

    def decide(self, epoch, curve, others):
        n = sum(1 for other in others if epoch in other)
        if FewSeen.interrupt and epoch == 3 and n == 1:
            FewSeen.interrupt = False
            raise KeyboardInterrupt
        if epoch not in (2, 3):
            return PruneDecision(False, self.rule, epoch, curve[epoch], None, n, "not a rung", judged=False)
        return PruneDecision(n < 3, self.rule, epoch, curve[epoch], 3.0, n)


@pytest.fixture
def few_seen(planted):
    register_pruner(PruningRule("few-seen", lambda direction, options: FewSeen(), "several objectives only", REACHED))
    yield
    RULES.pop("few-seen")


OUTPUTS: dict[Path, str] = {}  # what each search printed, by its folder


def search(invoke, tmp_path, *extra: str, exit_code: int = 0) -> list:
    tmp_path.mkdir(exist_ok=True)
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    result = invoke(["run", "--task", NAME, "--space", str(space), "--trials", "4", "--epochs", "4", "--device", "cpu",
                     "--pruner", "few-seen", "--pruner-pause", "--storage", storage, "--study", "s",
                     "--run-root", str(tmp_path / "runs"), "--seed", "3", *extra])
    assert result.exit_code == exit_code, result.output
    OUTPUTS[tmp_path] = result.output
    return optuna.load_study(study_name="s", storage=storage).get_trials(deepcopy=False)


def lines(run_dir) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS | {"epoch_seconds_alone"}}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_paused_trials_are_resumed_where_they_stopped_and_equal_a_straight_run(few_seen, invoke, tmp_path, one_thread,
                                                                              optuna_dashboard):
    trials = search(invoke, tmp_path)
    by_number = {t.number: t for t in trials}
    paused = {t.number: t.user_attrs["paused"]["epoch"] for t in trials if "paused" in t.user_attrs}
    resumed_by = {t.user_attrs["resumes"]: t.number for t in trials if "resumes" in t.user_attrs}
    first = [t for t in trials if "resumes" not in t.user_attrs and "duplicate_of" not in t.user_attrs]
    assert [paused.get(t.number) for t in first] == [2, 2, 2, 3]  # (the sampler may propose a duplicate between)
    assert sorted(paused.values()) == [2, 2, 2, 3, 3, 3] and set(resumed_by) == set(paused)  # every pause resumed
    assert all(by_number[n].state == TrialState.PRUNED and by_number[n].user_attrs["pruned"]["pause"] for n in paused)
    chains = [n for n in paused if "resumes" in by_number[n].user_attrs]
    assert len(chains) == 2  # two runs paused at epoch 2, resumed, paused again at 3 and resumed again
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 4 and all("resumes" in t.user_attrs for t in complete)

    # The budget: four places, one per architecture; the resumptions take none, and no epoch is trained twice.
    assert sum(counts_toward_budget(t) for t in trials) == 4
    assert len({t.user_attrs["arch"] for t in trials}) == 4
    assert sum(epochs_trained(t) for t in trials) == 16
    savings = pruning_savings(trials, 4)
    assert (savings.trials, savings.epochs_run, savings.epochs_without_pruning) == (4, 16, 16)
    for t in trials:
        if "resumes" in t.user_attrs:
            before = by_number[t.user_attrs["resumes"]]
            assert t.params == before.params and t.user_attrs["run_dir"] == before.user_attrs["run_dir"]
            assert t.user_attrs["resumed_at"] == paused[before.number]
            assert t.user_attrs["resumed_because"] == (f"the few-seen rule, asked again at epoch {paused[before.number]}"
                                                       " with 3 trials there, lets it go on")
            assert dict(before.intermediate_values).items() <= dict(t.intermediate_values).items()
    runs = tmp_path / "runs" / "s"
    assert sorted(p.name for p in runs.iterdir()) == [f"trial-{t.number:05d}" for t in first]  # one directory a run
    assert not list(runs.glob("*/pause.pt"))  # every run complete: no pause can matter any more

    # Each run, paused once or twice, equals its architecture trained straight through.
    assert_equal_to_straight(invoke, tmp_path, complete)

    # The pruning audit replays each run once (its last trial's curve, in the place it started), and the rule's
    # false prunes are known: every run it stops was resumed to its end here.
    from headsearch.analysis.stats import wilson_interval
    from headsearch.search.audit import pruning_audit

    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}")
    audit = pruning_audit(study)
    own = next(r for r in audit.rules if r.own)
    assert audit.trials == 4 and own.rule == "few-seen"
    assert [s.epoch for s in own.pruned] == [2, 2, 2, 3]  # as the search stopped them, in the order they started
    on_front = sum(1 for t in complete if t.number in audit.front)
    assert 1 <= on_front and own.stopped_known == 4 and own.false_prunes == on_front
    assert own.false_prune_rate == on_front / 4 and own.false_prune_interval == wilson_interval(on_front, 4)
    assert audit.rule("none").false_prune_rate is None  # it stops nothing

    # optuna-dashboard's notes say which trial paused where, and which trial resumed it.
    from headsearch.search.notes import write_dashboard_notes
    from test_pruning_audit import _notes

    write_dashboard_notes(study)
    notes = _notes(study)
    for number, resumption in resumed_by.items():
        epoch = paused[number]
        assert notes[number].startswith(f"**Paused at epoch {epoch}")
        assert f"trial #{resumption} resumed it after epoch {epoch}" in notes[number]
        assert f"Resumes trial #{number} after epoch {epoch}" in notes[resumption]
        assert f"resumed because the few-seen rule, asked again at epoch {epoch}" in notes[resumption].replace("Resumed", "resumed")

    # The report's notes say the same, and the live lines count the four places of --trials, never a resumption.
    from headsearch.search.report import summarize

    report_notes = {r.number: r.note for r in summarize(f"sqlite:///{tmp_path / 'study.db'}", "s").trials}
    for number, resumption in resumed_by.items():
        assert f"paused, state kept, resumed by trial {resumption}: " in report_notes[number]
        assert f"resumes trial {number} after epoch {paused[number]}" in report_notes[resumption]
        assert not report_notes[resumption].endswith(":")  # a complete resumption's note is that alone
    counts = [line.rsplit("; ", 1)[-1] for line in OUTPUTS[tmp_path].splitlines() if line.endswith(" finished)")]
    assert counts and all(c.endswith("/4 finished)") and int(c.split("/")[0].split("(")[-1]) <= 4 for c in counts)
    done = next(line for line in OUTPUTS[tmp_path].splitlines() if line.startswith("done after"))
    resumptions = sum(1 for t in trials if "resumes" in t.user_attrs)
    assert "4/4 finished" in done and f"; {resumptions} of them resumptions)" in done, done


def assert_equal_to_straight(invoke, tmp_path, complete: list) -> None:
    """Each complete run equals its architecture trained straight through: the same search without pausing
    trains the same four architectures (the sampler's seed), none stopped."""
    straight = {t.user_attrs["arch"]: t for t in search(invoke, tmp_path / "straight", "--pruner", "none")
                if t.state == TrialState.COMPLETE}
    assert len(straight) == 4 == len(complete)
    for t in complete:
        twin = straight[t.user_attrs["arch"]]
        assert dict(t.intermediate_values) == dict(twin.intermediate_values)
        assert lines(Path(t.user_attrs["run_dir"])) == lines(tmp_path / "straight" / "runs" / "s" / f"trial-{twin.number:05d}")


@pytest.mark.slow
def test_a_resumption_stopped_by_ctrl_c_is_resumed_again_by_the_next_run_and_loses_nothing(few_seen, invoke, tmp_path,
                                                                                         one_thread):
    """Ctrl-C while trial 0's run is resumed, after its epoch 3 was kept (metrics.jsonl, maybe a better
    checkpoint): the resumption is told FAIL (interrupted) and not retried, so trial 0 is paused again as it was;
    the same command resumes it from its pause, and every run ends as if none had stopped."""
    FewSeen.interrupt = True
    stopped = search(invoke, tmp_path, exit_code=130)
    (cut,) = [t for t in stopped if t.state == TrialState.FAIL and "resumes" in t.user_attrs]
    assert cut.user_attrs["fail_reason"].startswith("interrupted")
    first = cut.user_attrs["resumes"]
    assert [json.loads(line)["epoch"] for line in (Path(cut.user_attrs["run_dir"]) / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]

    trials = search(invoke, tmp_path)
    assert sum(1 for t in trials if t.user_attrs.get("resumes") == first) == 2  # the cut one, and the next run's
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert sum(counts_toward_budget(t) for t in trials) == 4 and not list((tmp_path / "runs").glob("*/*/pause.pt"))
    assert_equal_to_straight(invoke, tmp_path, complete)


def test_a_paused_trial_is_shown_paused_and_a_resumption_names_its_trial():
    """The live lines (headsearch run): a trial the rule paused reads "paused", not "pruned"; its resumption says
    which trial it goes on from."""
    from optuna.distributions import IntDistribution
    from optuna.trial import create_trial

    from headsearch.cli.progress import resumed_text, shown_state

    dist = {"x": IntDistribution(0, 3)}
    paused = create_trial(state=TrialState.PRUNED, params={"x": 1}, distributions=dist,
                          user_attrs={"pruned": {"pause": True, "epoch": 2}, "paused": {"epoch": 2}})
    killed = create_trial(state=TrialState.PRUNED, params={"x": 2}, distributions=dist, user_attrs={"pruned": {"epoch": 2}})
    resumption = create_trial(state=TrialState.COMPLETE, params={"x": 1}, distributions=dist, values=[0.5, 1.0],
                              user_attrs={"resumes": 7, "resumed_at": 2})
    assert [shown_state(t, "pruned") for t in (paused, killed)] == ["paused", "pruned"]
    assert shown_state(resumption, "complete") == "complete"
    assert resumed_text(resumption) == "(resumes trial 7)" and resumed_text(paused) == ""

    # The report's note (headsearch report), whose state column says pruned as Optuna's record does.
    from headsearch.search.report import pause_words

    assert pause_words(paused, 9) == "paused, state kept, resumed by trial 9"
    assert pause_words(paused, None) == "paused, state kept, not resumed"
    assert pause_words(killed, None) == "" and pause_words(resumption, None) == "resumes trial 7 after epoch 2"


def test_the_pauses_a_study_keeps_are_those_of_paused_trials_no_trial_resumes(tmp_path):
    """What `headsearch run` says it leaves on disk at its end: the pause.pt of each paused trial not resumed."""
    from optuna.distributions import IntDistribution
    from optuna.trial import create_trial

    from headsearch.search.record import kept_pauses

    dist = {"x": IntDistribution(0, 3)}
    files = [tmp_path / f"trial-{n}" / "pause.pt" for n in range(3)]
    for f in files[:2]:
        f.parent.mkdir()
        f.write_bytes(b"x" * 10)

    def paused(number: int):
        return create_trial(state=TrialState.PRUNED, params={"x": number}, distributions=dist,
                            user_attrs={"paused": {"epoch": 2, "checkpoint": str(files[number])}})

    trials = [paused(0), paused(1), paused(2)]  # trial 2's file is gone (another machine's run root)
    for number, t in enumerate(trials):
        t.number = number
    resumption = create_trial(state=TrialState.RUNNING, params={"x": 1}, distributions=dist, user_attrs={"resumes": 1})
    resumption.number = 3
    assert kept_pauses(trials) == files[:2]
    assert kept_pauses([*trials, resumption]) == files[:1]
