"""The resume rule of --pruner-pause (`headsearch.search.pruning.resume`): a paused trial's end projected with the
finished trials' gains, against their front. Every figure below is computed by hand."""
import pytest

from headsearch.search.pruning import ParetoRule, Progress
from headsearch.search.pruning.resume import could_reach_front, gain_after

RULE = ParetoRule("maximize", kinds=("quality", "time"))
# Three finished trials over 4 epochs: gains after epoch 2 of 0.1, 0.3 and 0.1; their ends (accuracy, seconds):
# (0.7, 4.0), (0.8, 8.0), (0.45, 2.0).
FINISHED = [
    Progress({1: 0.5, 2: 0.6, 3: 0.65, 4: 0.7}, epoch_seconds=1.0, number=0, finished=True),
    Progress({1: 0.4, 2: 0.5, 3: 0.6, 4: 0.8}, epoch_seconds=2.0, number=1, finished=True),
    Progress({1: 0.3, 2: 0.35, 3: 0.4, 4: 0.45}, epoch_seconds=0.5, number=2, finished=True),
]


def test_the_gains_are_each_finished_trials_best_at_the_end_less_its_best_at_the_epoch():
    assert gain_after(2, FINISHED, "maximize") == pytest.approx([0.1, 0.3, 0.1])
    dipping = Progress({1: 0.5, 2: 0.7, 3: 0.6, 4: 0.65}, finished=True)  # the best so far, not the last value
    assert gain_after(2, [dipping], "maximize") == [0.0]
    assert gain_after(2, [Progress({1: 2.0, 2: 1.5, 3: 1.2}, finished=True)], "minimize") == pytest.approx([0.3])


def test_a_paused_trial_goes_on_when_its_projected_end_is_dominated_by_no_finished_end():
    # The 0.9 quantile of [0.1, 0.1, 0.3] (numpy's linear interpolation): 0.1 + 0.8 * 0.2 = 0.26. A trial paused at
    # epoch 2 at 0.5, 3 s an epoch, ends at best at (0.76, 12 s): the second finished trial, (0.8, 8 s), dominates it.
    behind = Progress({1: 0.3, 2: 0.5}, epoch_seconds=3.0, number=5)
    assert could_reach_front(RULE, 2, behind, FINISHED, quantile=0.9, sigmas=0.0, gains="all") is False
    # At 0.6 it ends at (0.86, 12 s): more accurate than any finished end, so on the front.
    ahead = Progress({1: 0.3, 2: 0.6}, epoch_seconds=3.0, number=6)
    assert could_reach_front(RULE, 2, ahead, FINISHED, quantile=0.9, sigmas=0.0, gains="all") is True
    # Credited with the largest gain (0.3) instead, the first one ends at (0.8, 12 s): still dominated (8 s < 12 s).
    assert could_reach_front(RULE, 2, behind, FINISHED, quantile=1.0, sigmas=0.0, gains="all") is False
    # As fast as the fastest (0.5 s an epoch: 2 s at the end), it is dominated by no one.
    quick = Progress({1: 0.3, 2: 0.5}, epoch_seconds=0.5, number=7)
    assert could_reach_front(RULE, 2, quick, FINISHED, quantile=0.9, sigmas=0.0, gains="all") is True


def test_a_slow_trial_is_credited_with_the_slower_trials_gains_or_the_largest_while_too_few_finished():
    """RESUME_GAINS "slower": bigger models learn later, so the gains of the fast trials that finish first would
    undersell a slow starter. The trial at 0.5 and 3 s an epoch: no finished trial is as slow, so it gets the largest
    gain of all (0.3): (0.8, 12 s), dominated by (0.8, 8 s); at 0.51 it ends at (0.81, 12 s), on the front."""
    assert could_reach_front(RULE, 2, Progress({1: 0.3, 2: 0.5}, epoch_seconds=3.0, number=5), FINISHED,
                             quantile=0.25, sigmas=0.0, gains="slower") is False
    assert could_reach_front(RULE, 2, Progress({1: 0.3, 2: 0.51}, epoch_seconds=3.0, number=5), FINISHED,
                             quantile=0.25, sigmas=0.0, gains="slower") is True
    # As fast as the fastest (0.5 s): all three are as slow, and it gets their 0.25 quantile, 0.1 (of 0.1, 0.1, 0.3):
    # at 0.3 it ends at (0.4, 2 s), dominated by (0.45, 2 s); credited with all gains' 0.9 quantile (0.26) it is not.
    quick = Progress({1: 0.2, 2: 0.3}, epoch_seconds=0.5, number=7)
    assert could_reach_front(RULE, 2, quick, FINISHED, quantile=0.25, sigmas=0.0, gains="slower") is False
    assert could_reach_front(RULE, 2, quick, FINISHED, quantile=0.9, sigmas=0.0, gains="slower") is True


def test_nothing_is_told_before_three_finished_trials_or_without_the_epoch_seconds():
    behind = Progress({1: 0.3, 2: 0.5}, epoch_seconds=3.0, number=5)
    assert could_reach_front(RULE, 2, behind, FINISHED[:2], quantile=0.9, sigmas=0.0, gains="all") is None
    running = [Progress(p.curve, epoch_seconds=p.epoch_seconds, number=p.number) for p in FINISHED]  # not finished
    assert could_reach_front(RULE, 2, behind, running, quantile=0.9, sigmas=0.0, gains="all") is None
    unknown = Progress({1: 0.3, 2: 0.5}, epoch_seconds=None, number=5)
    assert could_reach_front(RULE, 2, unknown, FINISHED, quantile=0.9, sigmas=0.0, gains="all") is None


def test_the_noise_of_the_curves_adds_to_the_hope():
    # The steps 1->2 up to the paused epoch: 0.1, 0.1, 0.05 and the paused one's 0.2; median 0.1, residuals 0, 0,
    # 0.05, 0.1 (four: enough), so sigma = 1.4826 * median(0, 0, 0.05, 0.1) / sqrt(2) = 1.4826 * 0.025 / 1.41421
    # = 0.02621. With 2 sigmas (0.0524) the trial at 0.5 projects to 0.8124 at 12 s: the
    # finished (0.8, 8 s) no longer dominates it.
    behind = Progress({1: 0.3, 2: 0.5}, epoch_seconds=3.0, number=5)
    assert could_reach_front(RULE, 2, behind, FINISHED, quantile=0.9, sigmas=2.0, gains="all") is True
    assert could_reach_front(RULE, 2, behind, FINISHED, quantile=0.9, sigmas=0.5, gains="all") is False  # 0.7731: still dominated


@pytest.mark.parametrize("pause, given, margin", [(False, None, 0.9), (True, None, 0.0), (True, 0.5, 0.5)])
def test_with_pause_the_pareto_rule_stops_on_plain_dominance_unless_told(pause, given, margin):
    """--pruner-pause makes a stop undoable, so the Pareto rule's default noise margin becomes 0 (PAUSE_NOISE_MARGIN);
    a margin given is kept, and without pause the default stays 0.9 sigmas."""
    from pathlib import Path

    from headsearch.search.simulate import simulation_search
    from headsearch.search.table import load_table

    table = load_table(Path(__file__).resolve().parents[1] / "benchmarks" / "tables" / "vit-cifar10-deep-head-tiny.json")
    search = simulation_search(table, space="deep-head", trials=3, pruner="pareto", pruner_pause=pause,
                               pruner_noise_margin=given)
    assert search.definition.make_pruner()[1].noise_margin == margin


def test_a_resumption_by_the_projection_says_where_the_projected_end_lies():
    """What the resumption records (`resumed_because`): the trial at 0.51 and 3 s an epoch, with the defaults
    (slower trials' gains, none as slow: the largest gain, 0.3), is projected to 0.81 at epoch 4."""
    from headsearch.search.pruning.resume import projected_end
    from headsearch.search.trial_pruning import projection_words

    mine = Progress({1: 0.3, 2: 0.51}, epoch_seconds=3.0, number=5)
    projected, last = projected_end(RULE, 2, mine, FINISHED)
    assert last == 4 and projected.curve[4] == pytest.approx(0.81) and projected.epoch_seconds == 3.0
    assert projection_words(2, projected, last) == ("its end projected to epoch 4 (a best value of 0.81, with the"
                                                        " gains the finished trials made after epoch 2) is dominated"
                                                        " by no finished trial's")
