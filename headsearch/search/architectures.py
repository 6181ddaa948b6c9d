"""The architectures of a search's space on its base config: sampling one, listing them all, finding one.

`SpaceArchitectures` is built on the search's frozen definition, the plan's step mode applied (a plan that
changes it builds the units again), so a sampled config is always what the trial trains.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import optuna
from optuna.trial import FixedTrial

from headsearch.config import RunConfig, is_run_config, load_yaml
from headsearch.errors import ConfigError
from headsearch.search.record import arch_summary, config_key, holds_architecture
from headsearch.search.space import enumerate_params
from headsearch.tasks import apply_overrides
from headsearch.training import check_fits

if TYPE_CHECKING:
    from headsearch.search.definition import SearchDefinition

FEASIBILITY_SAMPLES = 200  # random architectures tried before a space is declared to have no valid one


class SpaceArchitectures:
    """What the space of a search (its `definition`) holds on its base config."""

    def __init__(self, definition: "SearchDefinition"):
        self.definition = definition
        self._listed, self._architectures = False, None  # listed once, on first use

    def sample_config(self, trial, device) -> RunConfig:
        """The trial's config: the space's sample on the base config, checked as `headsearch train` checks
        one (the task's own checks and the size guard). Raises ConfigError for an invalid one."""
        s = self.definition
        cfg = apply_overrides(s.task, s.base, s.space.sample(trial, s.base))
        s.task.check_config(cfg)
        check_fits(s.task, cfg, device)
        return cfg

    def check_feasible(self, device, samples: int = FEASIBILITY_SAMPLES) -> None:
        """Sample the space at random (in memory, no study is touched) until one architecture passes
        `sample_config`; if none of `samples` does, no study should be created: say why, with the
        commonest reason."""
        s = self.definition
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        scratch = optuna.create_study(directions=s.directions, sampler=optuna.samplers.RandomSampler(seed=s.settings.seed))
        reasons: dict[str, int] = {}
        for _ in range(samples):
            try:
                self.sample_config(scratch.ask(), device)
                return
            except ConfigError as e:
                reasons[str(e)] = reasons.get(str(e), 0) + 1
        commonest = max(reasons, key=reasons.get)
        raise ConfigError(f"no architecture of space {s.space.name} is valid for {s.task.name}"
                          f" ({samples} random samples, all rejected), e.g. {commonest}")

    def listing(self) -> "dict[str, dict[str, Any]] | None":
        """Every distinct valid config of the space, as {config key: the first parameters that give it}
        (`config_key`; e.g. halving from 1 head and uniform 1 head are one architecture). None when the
        space cannot be listed (a continuous range) or is a grid (a comparison's: each point is its own)."""
        if self._listed:
            return self._architectures
        self._listed = True
        s = self.definition
        if getattr(s.space, "next_point", None) is None:
            params = enumerate_params(lambda t: s.space.sample(t, s.base))
            if params is not None:
                found: dict[str, dict[str, Any]] = {}
                for p in params:
                    try:
                        cfg = self.sample_config(FixedTrial(p), s.device)
                    except ConfigError:
                        continue
                    found.setdefault(cfg.key(), p)
                self._architectures = found
        return self._architectures

    def params_of(self, config: "Path | dict[str, Any]") -> dict[str, Any]:
        """The space's parameters that give `config` (a YAML path or mapping: architecture fields, or a run
        config whose `arch` is taken) on the base config: what `enqueue` puts first. ConfigError, naming
        the config, when the space cannot be listed or does not hold that architecture."""
        s = self.definition
        name = str(config) if isinstance(config, (str, Path)) else "the config"
        d = load_yaml(Path(config)) if isinstance(config, (str, Path)) else config
        if not isinstance(d, dict):
            raise ConfigError(f"{name}: give architecture fields (as in examples/) or a run config")
        cfg = apply_overrides(s.task, s.base, {"arch": d["arch"] if is_run_config(d) else d})
        archs = self.listing()
        if archs is None:
            raise ConfigError(f"{name}: space {s.space.name} cannot be listed (a continuous range), so an architecture"
                              " cannot be put first; search without --enqueue")
        params = archs.get(cfg.key())
        if params is None:
            base, mine = s.base.arch, cfg.arch
            raise ConfigError(f"{name}: {arch_summary(cfg)} (d_model {mine.d_model}, {mine.enc_layers} layers) is not an"
                              f" architecture of space {s.space.name} on this search's base (d_model {base.d_model},"
                              f" {base.enc_layers} layers); `headsearch spaces` lists what the space holds")
        return params

    def trial_target(self) -> int:
        """The trials the search will train: --trials, or fewer when the space holds fewer architectures."""
        archs, trials = self.listing(), self.definition.settings.trials
        return min(trials, len(archs)) if archs else trials

    def space_line(self) -> str | None:
        """Said with the plan when the space is smaller than --trials; None otherwise."""
        archs, trials = self.listing(), self.definition.settings.trials
        if archs is None or len(archs) >= trials:
            return None
        return (f"space {self.definition.space.name} holds {len(archs)} distinct architectures, fewer than --trials"
                f" {trials}: each is trained once and the search ends")

    def held(self, trials: Sequence) -> set[str]:
        """The config keys of the architectures that trials hold (`holds_architecture`)."""
        return {config_key(t.user_attrs.get("config")) for t in trials if holds_architecture(t)}

    def exhausted(self, trials: Sequence) -> bool:
        """Whether trials hold every architecture of a space that can be listed."""
        archs = self.listing()
        return archs is not None and len(self.held(trials)) >= len(archs)

    def holder(self, trials: Sequence, key: str):
        """The first of `trials` that holds the architecture `key`: finished (complete, pruned, failed for
        good) or running. Training it again would repeat it."""
        return next((t for t in trials if holds_architecture(t) and config_key(t.user_attrs.get("config")) == key), None)

    def untried_point(self, trials: Sequence, seed_index: int) -> dict[str, Any] | None:
        """The parameters of an architecture of the space that no trial holds, drawn at random (seeded by the
        trial index); None when every one is held, or the space cannot be listed."""
        archs = self.listing()
        if archs is None:
            return None
        held = self.held(trials)
        free = [p for k, p in archs.items() if k not in held]
        if not free:
            return None
        return random.Random(self.definition.settings.seed * 100_003 + seed_index).choice(free)
