"""The pruning rules by name, in one table (`RULES`): for each, what it builds for a study with one objective
(an Optuna pruner) and with several (a judge the search calls after each epoch), which trials it compares a
trial with, and its default rungs. Adding a rule is one `register_pruner` call; a name not in the table is
refused in one line wherever it is asked for."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import optuna
from optuna.trial import TrialState

from headsearch.errors import ConfigError
from headsearch.search.pruning.progress import MultiMetricRule, ParetoRule
from headsearch.search.pruning.rules import MedianRule, PercentileRule, PruneDecision, RungRule, _direction, _int
from headsearch.search.record import resumed

# The rung rules judge a trial against every trial that reached the rung, running ones included, as asynchronous
# successive halving does (Li et al. 2020): with 8 workers the first 8 trials would otherwise never be judged.
# The percentile rules read the COMPLETE trials only, as Optuna's MedianPruner and PercentilePruner do.
REACHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
FINISHED = (TrialState.COMPLETE,)


@dataclass(frozen=True)
class PrunerOptions:
    """The pruning settings a user may give (`--pruner-*`); None takes the rule's default, and a rule
    ignores those it has no use for."""

    n_startup_trials: int | None = None
    n_warmup_epochs: int | None = None
    percentile: float | None = None
    min_epochs: int | str | None = None
    reduction_factor: int | None = None
    kinds: Sequence[str | None] | None = None
    noise_margin: float | None = None
    noise: float | None = None

    def given(self, *names: str) -> dict[str, Any]:
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


@dataclass(frozen=True)
class PruningRule:
    """One row of `RULES`.

    - `several(direction, options)`: the judge for a study with several objectives (None: no pruning), or a
      str saying why the rule refuses them. `one(epochs, options)`: Optuna's pruner for one objective, or why not.
    - `compares`: the states of the trials a trial is judged against (rejected trials and itself aside);
      () for a rule that compares none itself.
    - `rungs`: (first rung, reduction factor) by default, for a rule that judges at rungs only.
    - `judges_progress`: its judge reads a trial's `Progress` (curve, parameters, seconds), not its curve alone.
    - `auto_first_rung`: it accepts ``min_epochs="auto"``."""

    name: str
    several: Callable[[str, PrunerOptions], Any] | str
    one: Callable[[int, PrunerOptions], optuna.pruners.BasePruner] | str
    compares: tuple[TrialState, ...] = ()
    rungs: tuple[int, int] | None = None
    judges_progress: bool = False
    auto_first_rung: bool = False


RULES: dict[str, PruningRule] = {}


def register_pruner(rule: PruningRule, *, replace: bool = False) -> PruningRule:
    """Add `rule` to `RULES` (for this process), so `--pruner NAME` reaches it; a name taken is refused
    unless `replace`."""
    if rule.name in RULES and not replace:
        raise ConfigError(f"a pruning rule named {rule.name!r} is registered already")
    RULES[rule.name] = rule
    return rule


def pruner_names() -> tuple[str, ...]:
    return tuple(RULES)


def pruning_rule(name: str) -> PruningRule:
    """The row of rule `name`; ConfigError naming the known ones when there is none."""
    try:
        return RULES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown pruner {name!r}: use one of {', '.join(RULES)}") from None


# ---------------------------------------------------------------------------------------------
# which trials a trial is judged against


def comparison_trials(trials: Iterable[Any], rule: str, number: int) -> list[Any]:
    """The trials (Optuna FrozenTrials) that trial `number` is judged against under `rule`: those in a state
    the rule compares with, leaving out rejected trials, trial `number` itself and the paused trials a later trial
    resumes (its curve holds theirs: each run counts once)."""
    states = pruning_rule(rule).compares
    if not states:
        raise ConfigError(f"pruner {rule!r} compares no trials itself")
    trials = list(trials)
    gone_on = resumed(trials)
    return [t for t in trials if t.state in states and "rejected" not in t.user_attrs and t.number != number
            and t.number not in gone_on]


def comparison_curves(trials: Iterable[Any], rule: str, number: int) -> list[dict[int, float]]:
    """The learning curves ``{epoch: value}`` of `comparison_trials`."""
    return [dict(t.intermediate_values) for t in comparison_trials(trials, rule, number)]


class RulePruner(optuna.pruners.BasePruner):
    """`RungRule` as an Optuna pruner: `Trial.should_prune` in a single-objective study decides as the
    rule decides for a multi-objective one, on the same trials (`comparison_curves`). The rule is judged
    for the study's direction (the rule's own direction is ignored). `last` holds the latest decision,
    so the search can record its threshold and count in ``user_attrs["pruned"]``."""

    def __init__(self, rule: RungRule) -> None:
        self.rule = rule
        self.last: PruneDecision | None = None

    def __repr__(self) -> str:
        return f"RulePruner({self.rule!r})"

    def prune(self, study: "optuna.study.Study", trial: "optuna.trial.FrozenTrial") -> bool:
        epoch = trial.last_step
        if epoch is None:
            return False
        direction = "maximize" if study.direction == optuna.study.StudyDirection.MAXIMIZE else "minimize"
        rule = self.rule if direction == self.rule.direction else RungRule(
            direction, self.rule.min_epochs, self.rule.reduction_factor, self.rule.n_startup_trials)
        others = comparison_curves(study.get_trials(deepcopy=False), rule.rule, trial.number)
        self.last = rule.decide(epoch, dict(trial.intermediate_values), others)
        return self.last.prune


# ---------------------------------------------------------------------------------------------
# the factories


def make_curve_pruner(name: str, direction: str, **options: Any):
    """The judge of rule `name` for a study with several objectives whose primary metric goes `direction`
    (None for "none"). `options`: `PrunerOptions`' fields. Unknown name, or a rule for one objective only ->
    ConfigError."""
    rule = pruning_rule(name)
    if isinstance(rule.several, str):
        raise ConfigError(rule.several)
    _direction(direction)
    opts = PrunerOptions(**options)
    # "none" compares no trials and takes no options; every other rule says whether it chooses its first rung.
    if opts.min_epochs == "auto" and rule.compares and not rule.auto_first_rung:
        raise ConfigError(f"--pruner-min-epochs auto: only the pareto rule chooses its first rung from the finished"
                          f" trials; give {name} a number of epochs")
    return rule.several(direction, opts)


def make_optuna_pruner(name: str, *, epochs: int, **options: Any) -> optuna.pruners.BasePruner:
    """Optuna's pruner of rule `name` for a single-objective study that reports epoch e as step e; `epochs`:
    a trial's last epoch. `options`: `PrunerOptions`' fields (defaults: the curve rules'). Unknown name, or a
    rule for several objectives only -> ConfigError."""
    rule = pruning_rule(name)
    if isinstance(rule.one, str):
        raise ConfigError(rule.one)
    return rule.one(_int("epochs", epochs, 1), PrunerOptions(**options))


# ---------------------------------------------------------------------------------------------
# the built-in rules (docs/design.md §7 gives each with its reference)


def _median(direction: str, o: PrunerOptions) -> MedianRule:
    return MedianRule(direction, **o.given("n_startup_trials", "n_warmup_epochs"))


def _percentile(direction: str, o: PrunerOptions) -> PercentileRule:
    return PercentileRule(direction, **o.given("percentile", "n_startup_trials", "n_warmup_epochs"))


def _optuna_percentile(build: Callable[..., optuna.pruners.BasePruner], with_percentile: bool):
    """Optuna's MedianPruner / PercentilePruner deciding exactly as `PercentileRule` given the COMPLETE
    trials' curves: ``n_warmup_steps = n_warmup_epochs + 1`` because Optuna's warm-up is ``step <
    n_warmup_steps`` and our epochs start at 1; ``n_min_trials`` because our startup counts trials with a
    value at the epoch judged."""
    def one(epochs: int, o: PrunerOptions) -> optuna.pruners.BasePruner:
        rule = _percentile("maximize", o) if with_percentile else _median("maximize", o)
        common = dict(n_startup_trials=rule.n_startup_trials, n_warmup_steps=rule.n_warmup_epochs + 1,
                      interval_steps=rule.interval_epochs, n_min_trials=max(rule.n_startup_trials, 1))
        return build(rule.percentile, **common) if with_percentile else build(**common)
    return one


def _asha(direction: str, o: PrunerOptions) -> RungRule:
    return RungRule(direction, **o.given("min_epochs", "reduction_factor", "n_startup_trials"))


def _optuna_asha(epochs: int, o: PrunerOptions) -> RulePruner:
    return RulePruner(_asha("maximize", o))


def _optuna_hyperband(epochs: int, o: PrunerOptions) -> optuna.pruners.HyperbandPruner:
    """Optuna's multi-bracket Hyperband with `RungRule`'s defaults (m = 1, r = 3). `n_startup_trials` has no
    counterpart (Optuna's `bootstrap_count` prunes, rather than spares, trials while few reached a rung)."""
    rung = RungRule("maximize", **o.given("min_epochs", "reduction_factor"))
    if epochs < rung.min_epochs:
        raise ConfigError(f"hyperband pruning needs epochs >= min_epochs, got epochs={epochs}, "
                          f"min_epochs={rung.min_epochs}")
    return optuna.pruners.HyperbandPruner(min_resource=rung.min_epochs, max_resource=epochs,
                                          reduction_factor=rung.reduction_factor)


def _pareto(direction: str, o: PrunerOptions) -> ParetoRule:
    return ParetoRule(direction, **o.given("kinds", "min_epochs", "reduction_factor", "n_startup_trials",
                                           "n_warmup_epochs", "noise_margin"), noise=o.noise)


def _multi_metric(direction: str, o: PrunerOptions) -> MultiMetricRule:
    return MultiMetricRule(direction, **o.given("kinds", "n_startup_trials", "n_warmup_epochs"))


def _several_only(name: str) -> str:
    return (f"--pruner {name} judges several objectives at once: a single-objective study uses median, percentile,"
            " asha, hyperband or none")


for _rule in (
    PruningRule("pareto", _pareto, _several_only("pareto"), REACHED, rungs=(3, 3), judges_progress=True,
                auto_first_rung=True),
    PruningRule("median", _median, _optuna_percentile(optuna.pruners.MedianPruner, False), FINISHED),
    PruningRule("percentile", _percentile, _optuna_percentile(optuna.pruners.PercentilePruner, True), FINISHED),
    PruningRule("asha", _asha, _optuna_asha, REACHED, rungs=(1, 3)),
    PruningRule("hyperband", "--pruner hyperband is Optuna's multi-bracket HyperbandPruner, for one objective: with"
                " several use asha (one bracket of successive halving, what hyperband meant there before) or pareto",
                _optuna_hyperband),
    PruningRule("multi-metric", _multi_metric, _several_only("multi-metric"), REACHED, judges_progress=True),
    PruningRule("none", lambda direction, o: None, lambda epochs, o: optuna.pruners.NopPruner()),
):
    register_pruner(_rule)

def judges_progress(judge: Any) -> bool:
    """Whether a built judge reads `Progress` (its rule's row says so); False for None."""
    return judge is not None and pruning_rule(judge.rule).judges_progress


def rule_rungs(name: Any) -> tuple[int, int] | None:
    """The default rungs of a stored study's rule; None for a rule without rungs or not registered here."""
    rule = RULES.get(name) if isinstance(name, str) else None
    return None if rule is None else rule.rungs
