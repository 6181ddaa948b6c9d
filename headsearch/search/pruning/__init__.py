"""Learning-curve pruning for multi-objective studies, and the same rules for single-objective ones.

Optuna refuses `trial.report` / `trial.should_prune` in multi-objective studies, so headsearch
judges a trial itself: after every epoch the search calls `CurvePruner.decide` with the trial's
curve of its primary metric (`{epoch: value}`, epochs numbered from 1) and the curves that
`comparison_curves` selects from the study, and raises `optuna.TrialPruned` when the decision says
prune, storing `decision.reason()` in the trial's user_attrs. Single-objective studies use Optuna's
own pruners, built with matching parameters by `make_optuna_pruner`, or (``"asha"``) the same
`RungRule` wrapped as an Optuna pruner (`RulePruner`): one rule, one code path, for one objective or several.

Which trials a trial is compared with (`comparison_curves`, each rule's `compares` in `registry.RULES`):

- median / percentile: the COMPLETE trials only, as Optuna's `MedianPruner` / `PercentilePruner`
  (which read ``study.get_trials(states=(COMPLETE,))``). A pruned trial's curve takes no part:
  however bad it was, it does not lower the bar for the trials after it. So single- and
  multi-objective studies prune alike.
- asha, pareto, multi-metric (rung rules): the COMPLETE, PRUNED and RUNNING trials, every trial that
  reached the rung, finished or not, as in ASHA (a trial pruned at a later rung did reach the earlier ones, and its value there counts).

Rejected trials (an invalid architecture, stored PRUNED with user_attr "rejected") and the trial
being judged are never compared with. A trial that repeats an architecture another trial holds (user_attr
"duplicate_of") is told FAIL before it trains, so it is never compared with either. (Studies from before
that rule kept such a trial COMPLETE with its twin's curve: `progress_of` does not count it as finished.)

Rules (`registry.RULES`, one row each; `register_pruner` adds one):

- ``"median"`` / ``"percentile"`` (`MedianRule`, `PercentileRule`): Optuna's `MedianPruner` /
  `PercentilePruner` (optuna/pruners/_percentile.py), decision for decision: a trial is pruned
  when its best value so far is strictly worse than the given percentile of the complete trials'
  values at the same epoch.
- ``"asha"`` (`RungRule`): asynchronous successive halving (ASHA; Li et al. 2020, "A System for
  Massively Parallel Hyperparameter Tuning", MLSys; successive halving: Jamieson & Talwalkar 2016,
  "Non-stochastic Best Arm Identification and Hyperparameter Optimization", AISTATS), one bracket:
  at the rung epochs ``min_epochs * reduction_factor**k`` only the top ``1/reduction_factor`` go on.
  The same decisions with one objective (`RulePruner`) and several. Optuna's counterpart is
  `SuccessiveHalvingPruner` (one bracket too; it differs in the cut and the startup, see `RungRule`).
- ``"hyperband"``: Optuna's `HyperbandPruner` (Li et al. 2018, "Hyperband: A Novel Bandit-Based Approach
  to Hyperparameter Optimization", JMLR): several brackets of successive halving, each with its own first
  rung, trials assigned to brackets by a hash. Single-objective studies only: with several objectives it
  is refused (`make_curve_pruner`), as ``"pareto"`` is with one. Before, ``hyperband`` meant this with
  one objective and `RungRule` with several: that rule is now called ``"asha"``.
- ``"multi-metric"`` (`MultiMetricRule`): the rule of OptunaHub's `multi_metric_pruner` (S. Watanabe, 2026),
  Optuna's own answer to pruning with several objectives, written here from its description as a baseline
  for the simulator: at each epoch the trials that reported it are ranked by non-dominated sorting, ties
  broken by hypervolume contribution; a trial on the current front is never pruned; the rank goes to a
  median rule (or, ``base="asha"``, to successive halving at the rungs). Several objectives only.
- ``"none"``: no pruning (`make_curve_pruner` returns None, `make_optuna_pruner` a `NopPruner`).

Modules: `rules` (the rules on one curve), `progress` (the rules on several objectives), `registry` (the
table, which trials are compared, the factories).

Steps and epochs: the search reports epoch ``e`` to Optuna as ``step=e``. Optuna's warm-up is
``step < n_warmup_steps`` (its steps usually count from 0, so ``n_warmup_steps`` steps are
protected); ours protects the first ``n_warmup_epochs`` epochs, ``1..n_warmup_epochs``, so the
Optuna pruner gets ``n_warmup_steps = n_warmup_epochs + 1``. Both paths then judge the same epochs.
"""
from headsearch.search.pruning.progress import (AUTO_FALLBACK, AUTO_FINISHED, AUTO_RHO, MIN_NOISE_SAMPLES, NOISE_MARGIN,
                                                PROGRESS_KINDS, MultiMetricRule, ParetoRule, Progress, best_so_far,
                                                curve_noise, hypervolume_contributions, non_dominated_ranks,
                                                progress_of, progress_point)
from headsearch.search.pruning.registry import (RULES, PrunerOptions, PruningRule, RulePruner, comparison_curves,
                                                comparison_trials, judges_progress, make_curve_pruner,
                                                make_optuna_pruner, pruner_names, pruning_rule, register_pruner,
                                                rule_rungs)
from headsearch.search.pruning.rules import (DIRECTIONS, CurvePruner, MedianRule, PercentileRule, PruneDecision,
                                             RungRule, rung_epochs)

__all__ = [
    "AUTO_FALLBACK", "AUTO_FINISHED", "AUTO_RHO", "DIRECTIONS", "MIN_NOISE_SAMPLES", "NOISE_MARGIN", "PROGRESS_KINDS",
    "RULES", "CurvePruner", "MedianRule", "MultiMetricRule", "ParetoRule", "PercentileRule", "Progress",
    "PruneDecision", "PrunerOptions", "PruningRule", "RulePruner", "RungRule", "best_so_far", "comparison_curves",
    "comparison_trials", "curve_noise", "hypervolume_contributions", "judges_progress",
    "make_curve_pruner", "make_optuna_pruner", "non_dominated_ranks", "progress_of", "progress_point",
    "pruner_names", "pruning_rule", "register_pruner", "rule_rungs", "rung_epochs",
]
