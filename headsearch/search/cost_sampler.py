"""A sampler that knows what each architecture costs before it trains it.

The `time` objective of a trial is, up to noise, its architecture's epoch seconds measured alone times the
epochs to its best one, and the epoch seconds can be measured in a few steps before any training, as
hardware-aware NAS measures or predicts latency first (HAT: Wang et al. 2020; HW-NAS-Bench: Li et al. 2021).
Only the quality metric has to be learnt by training. `CostAwareSampler` proposes, among the architectures
of a listed space that no trial holds or runs, the one of highest expected hypervolume improvement (EHVI;
Emmerich et al. 2006) where the cost coordinate is known and the quality coordinate is predicted by a
Bayesian linear regression over the architecture's features (heads per layer, skip, fusion, log cost;
Bishop 2006), chosen on the simulator over a Gaussian process (Rasmussen & Williams 2006), `MODELS`. With one coordinate known, the 2-D EHVI is a 1-D integral over the quality axis (`ehvi`).
The first proposal is the cheapest architecture (on the true front whatever its quality), the second one at a
random place along the cost axis. Trials that run on other workers count at their predicted quality (the
kriging believer, Ginsbourger et al. 2010), so workers propose different architectures.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import optuna
from optuna.trial import FixedTrial

from headsearch.config import FUSIONS, SKIPS
from headsearch.search.hypervolume import front_indices
from headsearch.search.record import config_key, holds_architecture

COST_AWARE = "cost"  # the sampler's name, as a study records it
INITIAL_QUANTILES = (0.0,)  # the first proposals, as quantiles of the cost ranking: the cheapest (on the front)
REFERENCE_MARGIN = 0.1  # the hypervolume's reference lies 10% beyond the worst, on scaled axes (as `simulate.score`)


@dataclass(frozen=True)
class Candidate:
    """An architecture of the space: the parameters that give it, its features and its measured epoch seconds."""

    key: str
    params: dict[str, Any]
    features: tuple[float, ...]
    cost: float


def arch_features(cfg) -> tuple[float, ...]:
    """log2 heads per encoder and decoder layer, skip and fusion one-hot: what the quality is predicted from."""
    a = cfg.arch
    heads = [math.log2(h) for h in list(a.enc_heads) + list(a.dec_heads or [])]
    return tuple(heads + [float(a.skip == s) for s in SKIPS] + [float(a.fusion == f) for f in FUSIONS])


# -- the quality model ----------------------------------------------------------------------------

def _kernel(a: np.ndarray, b: np.ndarray, length: float) -> np.ndarray:
    d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
    return np.exp(-0.5 * d2 / length**2)


def gp_predict(x: np.ndarray, y: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard deviation of y at xs by GP regression (squared-exponential kernel, constant mean),
    its length scale and noise chosen by the marginal likelihood over a small grid."""
    mean, scale = float(y.mean()), float(y.std()) or 1.0
    z = (y - mean) / scale
    best = None
    dim = max(1, x.shape[1])
    for length in (0.5, 1.0, 2.0, 4.0):
        for noise in (0.01, 0.1, 0.3):
            k = _kernel(x, x, length * math.sqrt(dim)) + noise * np.eye(len(x))
            try:
                chol = np.linalg.cholesky(k)
            except np.linalg.LinAlgError:
                continue
            alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, z))
            evidence = -0.5 * z @ alpha - np.log(np.diag(chol)).sum()
            if best is None or evidence > best[0]:
                best = (evidence, length * math.sqrt(dim), chol, alpha)
    _, length, chol, alpha = best
    ks = _kernel(xs, x, length)
    mu = ks @ alpha
    v = np.linalg.solve(chol, ks.T)
    var = np.clip(1.0 - (v**2).sum(0), 1e-9, None)
    return mean + scale * mu, scale * np.sqrt(var)


def linear_predict(x: np.ndarray, y: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard deviation of y at xs by Bayesian linear regression (Bishop 2006, §3.3) on the
    standardised features, its prior and noise precisions chosen by the evidence over a small grid."""
    mean, scale = float(y.mean()), float(y.std()) or 1.0
    z = (y - mean) / scale
    mu_x, sd_x = x.mean(0), x.std(0)
    sd_x[sd_x == 0] = 1.0
    phi, phis = (x - mu_x) / sd_x, (xs - mu_x) / sd_x
    n, d = phi.shape
    best = None
    for alpha in (0.3, 1.0, 3.0, 10.0):
        for beta in (1.0, 3.0, 10.0):
            a = alpha * np.eye(d) + beta * phi.T @ phi
            cov = np.linalg.inv(a)
            m = beta * cov @ phi.T @ z
            evidence = (d * math.log(alpha) + n * math.log(beta) - beta * ((z - phi @ m) ** 2).sum() - alpha * m @ m
                        - np.linalg.slogdet(a)[1]) / 2
            if best is None or evidence > best[0]:
                best = (evidence, m, cov, beta)
    _, m, cov, beta = best
    var = 1.0 / beta + np.einsum("ij,jk,ik->i", phis, cov, phis)
    return mean + scale * (phis @ m), scale * np.sqrt(var)


MODELS = {"gp": gp_predict, "linear": linear_predict}
MODEL = "linear"


# -- expected hypervolume improvement with the cost known ----------------------------------------------

def _normal_sf(z: np.ndarray) -> np.ndarray:
    return 0.5 * np.vectorize(math.erfc)(z / math.sqrt(2.0))


def ehvi(cost: float, mu: float, sd: float, front: Sequence[tuple[float, float]], reference: tuple[float, float],
         steps: int = 256) -> float:
    """E[hypervolume improvement] of a point of known `cost` (minimised) and quality ~ N(mu, sd) (maximised)
    over `front` [(cost, quality), ...] with `reference` (cost, quality): the integral over quality levels y
    above the best quality at cost <= `cost` of (the cheapest front cost at quality >= y, or the reference's,
    minus `cost`) x P(quality >= y)."""
    ref_cost, ref_quality = reference
    if cost >= ref_cost:
        return 0.0
    floor = max([q for c, q in front if c <= cost] + [ref_quality])
    top = mu + 6 * sd
    if top <= floor:
        return 0.0
    ys = np.linspace(floor, top, steps + 1)
    mid = (ys[:-1] + ys[1:]) / 2
    width = np.array([min([c for c, q in front if q >= y] + [ref_cost]) for y in mid]) - cost
    prob = _normal_sf((mid - mu) / max(sd, 1e-9))
    return float((np.clip(width, 0, None) * prob).sum() * (top - floor) / steps)


def non_dominated(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points (cost minimised, quality maximised) that no other point beats on both."""
    return [points[i] for i in front_indices([(cost, -quality) for cost, quality in points])]


# -- the sampler ----------------------------------------------------------------------------------

class CostAwareSampler(optuna.samplers.BaseSampler):
    """An Optuna sampler over a listed space whose architectures' epoch seconds are known (`candidates`).

    Each new trial gets the parameters of one architecture no trial holds or runs: while fewer than
    `len(INITIAL_QUANTILES)` trials exist, the one at the next cost quantile; then the one of highest EHVI
    (`ehvi`), the quality predicted from the trained trials (a pruned one at its last epoch's value) and the
    running ones believed at their prediction. `quality` and `time` are the objectives' indices; `maximize`
    the quality's direction; `epochs` what a trial trains (its cost coordinate: epoch seconds x epochs)."""

    def __init__(self, candidates: Sequence[Candidate], *, quality: int, time: int, maximize: bool, epochs: int,
                 seed: int = 0):
        self.candidates = {c.key: c for c in candidates}
        self.quality, self.time, self.sign, self.epochs = quality, time, 1.0 if maximize else -1.0, epochs
        self.rng = random.Random(seed)
        self.fallback = optuna.samplers.RandomSampler(seed=seed)
        self._chosen: dict[int, Candidate | None] = {}

    # Optuna's sampler interface: every parameter is sampled independently, from the architecture chosen once.
    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def reseed_rng(self) -> None:
        self.fallback.reseed_rng()

    def sample_independent(self, study, trial, param_name, param_distribution):
        if trial.number not in self._chosen:
            self._chosen[trial.number] = self.choose(study.get_trials(deepcopy=False), trial.number)
        chosen = self._chosen[trial.number]
        if chosen is None or param_name not in chosen.params:
            return self.fallback.sample_independent(study, trial, param_name, param_distribution)
        return chosen.params[param_name]

    # The choice.
    def choose(self, trials: Sequence, number: int) -> Candidate | None:
        observed, pending, held = self._read(trials, number)
        free = [c for key, c in self.candidates.items() if key not in held]
        if not free:
            return None
        if len(observed) + len(pending) < len(INITIAL_QUANTILES):
            return self._by_cost_quantile(free, INITIAL_QUANTILES[len(observed) + len(pending)])
        if len(observed) < 2:
            return self._by_cost_quantile(free, self.rng.random())
        return self._best_ehvi(free, observed, pending)

    def _read(self, trials: Sequence, number: int):
        """(observed [(candidate, cost coordinate, quality)], pending [candidate], held keys): the trials that hold
        their architecture (`record.holds_architecture`), and the waiting ones (a retry) that carry one."""
        observed, pending, held = [], [], set()
        for t in trials:
            waiting = t.state.name == "WAITING" and "config" in t.user_attrs
            if t.number == number or not (holds_architecture(t) or waiting):
                continue
            key = config_key(t.user_attrs["config"])
            held.add(key)
            c = self.candidates.get(key)
            if c is None:
                continue
            if t.state.name in ("RUNNING", "WAITING"):
                pending.append(c)
            elif t.state.name == "COMPLETE":
                observed.append((c, t.values[self.time], self.sign * t.values[self.quality]))
            elif t.state.name == "PRUNED" and t.intermediate_values:  # at its last epoch's value
                observed.append((c, c.cost * self.epochs, self.sign * t.intermediate_values[max(t.intermediate_values)]))
        return observed, pending, held

    def _by_cost_quantile(self, free: list[Candidate], q: float) -> Candidate:
        ranked = sorted(self.candidates.values(), key=lambda c: c.cost)
        target = ranked[round(q * (len(ranked) - 1))].cost
        return min(free, key=lambda c: (abs(math.log(c.cost / target)), self.rng.random()))

    def _best_ehvi(self, free: list[Candidate], observed: list, pending: list[Candidate]) -> Candidate:
        costs = np.array([c.cost for c in self.candidates.values()])
        x_all = {c.key: np.array(c.features + (math.log(c.cost / costs.min()),)) for c in self.candidates.values()}
        x = np.stack([x_all[c.key] for c, _, _ in observed])
        y = np.array([q for _, _, q in observed])
        others = pending + free
        mu, sd = MODELS[MODEL](x, y, np.stack([x_all[c.key] for c in others]))
        lo, hi = float(y.min()), float(y.max())
        span = (hi - lo) or 1.0
        t_max = float(costs.max()) * self.epochs

        def scaled(cost: float, quality: float) -> tuple[float, float]:
            return cost / t_max, (quality - lo) / span

        points = [scaled(t, q) for _, t, q in observed]
        points += [scaled(c.cost * self.epochs, m) for c, m in zip(pending, mu[: len(pending)])]  # believed
        front = non_dominated(points)
        reference = (1.0 + REFERENCE_MARGIN, -REFERENCE_MARGIN)
        scores = [(ehvi(*scaled(c.cost * self.epochs, m), s / span, front, reference), -c.cost, self.rng.random(),
                   c.key) for c, m, s in zip(free, mu[len(pending):], sd[len(pending):])]
        return self.candidates[max(scores)[3]]


# -- a search's sampler -----------------------------------------------------------------------------

def candidates(archs, seconds: dict[str, float]) -> list[Candidate]:
    """The architectures of `archs` (a `SpaceArchitectures`: its `listing`, config key -> parameters) with their
    epoch seconds from `seconds` (by config key), each with its features."""
    device = archs.definition.device
    return [Candidate(key, dict(params), arch_features(archs.sample_config(FixedTrial(params), device)),
                      float(seconds[key])) for key, params in archs.listing().items()]


def cost_aware_sampler(definition, costs: list[Candidate], seed: int) -> CostAwareSampler:
    """The sampler of a search (its `SearchDefinition`) over the architectures' `costs`: quality x time, as
    `headsearch run`'s default objectives (`costs.check_cost_search` refused any other search before)."""
    names = [o.name for o in definition.objectives]
    primary = definition.task.primary
    return CostAwareSampler(costs, quality=names.index(primary.name), time=names.index("time"),
                            maximize=primary.direction == "maximize", epochs=definition.base.train.epochs, seed=seed)
