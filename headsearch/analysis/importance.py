"""Head importance, single-head ablation and pruning curves (docs/design.md §6).

After Michel, Levy and Neubig 2019, "Are Sixteen Heads Really Better than One?" (NeurIPS,
arXiv:1905.10650): every head's output is multiplied by a gate xi (the `Attention.head_mask`,
all ones), and a head's importance is the expected sensitivity of the loss to its gate,

    I[l, h] = sum over batches |dL_batch / d xi[l, h]| / N_tokens,

L_batch the loss summed over the batch's tokens (so the absolute value is taken per batch: the
scores depend on the batch size, as in the paper's estimator). Each layer's vector is then divided
by its L2 norm (+1e-20), the paper's per-layer normalisation, which makes layers comparable for a
global pruning order. Also computed in the same pass: each head's attention entropy.

Caveat from the model: the mask multiplies a head's output *before* the "output" skip (add and
LayerNorm with the previous layer's merged heads) and after the "scores" skip emits its scores, so
with skip != "none" a masked head is silenced in its own layer's output only, not removed from what
the skip carries onward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
from torch import Tensor, nn

from headsearch.analysis.diversity import AttentionTap, entropy_sums, head_masks
from headsearch.models.transformer import attention_layers

LossFn = Callable[[nn.Module, Any], "tuple[Tensor, int | Tensor]"]


@dataclass
class HeadImportance:
    """Per attention module (forward order): normalised importance, raw importance, attention entropy.

    entropy[l][h]: mean over the valid queries seen of -sum_k A log A (nats), A head h's attention
    probabilities; log(T_valid) for uniform attention over T_valid keys, 0 for one-hot attention.
    NaN when the batches carried no positions for the module.
    """

    names: list[str]
    importance: list[np.ndarray]  # (H,) per module, each divided by its L2 norm (+1e-20)
    raw: list[np.ndarray]  # (H,) per module: sum over batches of |dL/dxi| / N_tokens
    entropy: list[np.ndarray]  # (H,) per module, nats
    n_tokens: int = 0

    @property
    def total_heads(self) -> int:
        return sum(len(v) for v in self.importance)

    def order(self) -> list[tuple[int, int]]:
        """Every (module index, head) from least to most important (normalised), ties in forward order."""
        flat = [(float(v), li, h) for li, vec in enumerate(self.importance) for h, v in enumerate(vec)]
        return [(li, h) for _, li, h in sorted(flat, key=lambda t: t[0])]  # stable: ties keep forward order


def _param_device(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def head_importance(model: nn.Module, batches: Iterable[Any], loss_fn: LossFn) -> HeadImportance:
    """Michel et al. (2019) head importance of every attention module, plus attention entropy.

    Sets `attn.head_mask = ones(H, requires_grad=True)` on every module (restored afterwards, also
    after an error), runs the model in eval mode with grad enabled, and for each batch takes the
    gradient of `loss_fn(model, batch) -> (loss summed over tokens, n_tokens)` with respect to the
    masks only (the parameters' .grad are untouched). Batches are dicts as made by
    `analysis_batches` (their "masks" decide which queries count for the entropy); a batch that
    is not such a dict still gets importances, with all positions counted for the entropy.
    The entropy is read through forward hooks, which make every module take its explicit-softmax
    path (the fused kernel agrees to float32 rounding, ~1e-7); the gradients are those of that path.
    """
    if not attention_layers(model):
        raise ValueError(f"{type(model).__name__} has no headsearch Attention module")
    with head_masks(model) as layers:
        names = [name for name, _ in layers]
        index = {name: i for i, name in enumerate(names)}
        grad_sums = [torch.zeros(attn.n_heads, dtype=torch.float64) for _, attn in layers]
        ent_sums = [torch.zeros(attn.n_heads, dtype=torch.float64) for _, attn in layers]
        ent_counts = [0] * len(layers)
        total = 0

        def on_call(name: str, rec: dict[str, Tensor]) -> None:
            s, n = entropy_sums(rec["weights"], rec["query_mask"])
            ent_sums[index[name]] += s.cpu()
            ent_counts[index[name]] += n

        gates = [torch.ones(attn.n_heads, device=_param_device(attn), requires_grad=True) for _, attn in layers]
        for (_, attn), gate in zip(layers, gates):
            attn.head_mask = gate
        seen = 0
        with torch.enable_grad(), AttentionTap(model, on_call) as tap:
            for seen, batch in enumerate(batches, 1):
                tap.masks = (batch.get("masks") or {}) if isinstance(batch, Mapping) else {}
                loss, n = loss_fn(model, batch)
                grads = torch.autograd.grad(loss, gates, allow_unused=True)
                for acc, g in zip(grad_sums, grads):
                    if g is not None:
                        acc += g.detach().abs().double().cpu()
                total += int(n)
        if seen == 0:
            raise ValueError("head_importance needs at least one batch")
        if total <= 0:
            raise ValueError("the batches held no tokens (loss_fn returned n_tokens = 0)")

    raw = [(g / total).numpy() for g in grad_sums]
    importance = [r / (np.linalg.norm(r) + 1e-20) for r in raw]
    entropy = [(s / c).numpy() if c else np.full(len(s), np.nan) for s, c in zip(ent_sums, ent_counts)]
    return HeadImportance(names, importance, raw, entropy, total)


def _evaluate(model: nn.Module, evaluate: Callable[[], Mapping[str, float]], metric: str) -> float:
    with torch.no_grad():
        result = evaluate()
    if metric not in result:
        raise KeyError(f"evaluate() returned no {metric!r}: it has {', '.join(result)}")
    return float(result[metric])


def ablation(model: nn.Module, evaluate: Callable[[], Mapping[str, float]], metric: str) -> dict[str, Any]:
    """The metric with each head masked alone (head_mask 0 at h, 1 elsewhere in its module, no other mask).

    Returns {"metric", "baseline" (no head masked), "names", "per_head": [[value per head] per module]}.
    The model is evaluated in eval mode under torch.no_grad(); masks and mode are restored afterwards.
    """
    with head_masks(model) as layers:
        for _, attn in layers:
            attn.head_mask = None
        baseline = _evaluate(model, evaluate, metric)
        per_head = []
        for _, attn in layers:
            row = []
            for h in range(attn.n_heads):
                gate = torch.ones(attn.n_heads, device=_param_device(attn))
                gate[h] = 0.0
                attn.head_mask = gate
                row.append(_evaluate(model, evaluate, metric))
            attn.head_mask = None
            per_head.append(row)
    return {"metric": metric, "baseline": baseline, "names": [n for n, _ in layers], "per_head": per_head}


def pruning_steps(total: int, step_fraction: float) -> list[int]:
    """Heads masked at each step: round(k * step_fraction * total) (halves up), k = 0, 1, ..., ending at total."""
    if not 0.0 < step_fraction <= 1.0:
        raise ValueError(f"step_fraction = {step_fraction} must be in (0, 1]")
    k_last = math.ceil(1.0 / step_fraction - 1e-9)
    return [min(total, math.floor(k * step_fraction * total + 0.5 + 1e-9)) for k in range(k_last + 1)][:-1] + [total]


def pruning_curve(
    model: nn.Module,
    importance: HeadImportance,
    evaluate: Callable[[], Mapping[str, float]],
    metric: str,
    step_fraction: float = 0.1,
) -> list[dict[str, Any]]:
    """Mask heads globally from least to most important (normalised scores) and evaluate at each step.

    Step k masks the round(k * step_fraction * total) least important heads of the whole model
    (k = 0 .. 1/step_fraction, so 11 points at 10% steps; the last masks every head). The order is
    global, as in Michel et al., so a module may lose all its heads; it then outputs only its
    out_proj bias (with skip "none"), and that is what the curve measures. Point 0 is the unpruned
    model (no mask at all). A step masking as many heads as the previous one reuses its value
    (evaluation is deterministic). Returns [{"fraction", "heads_pruned", metric, "pruned": [[module
    index, head], ...]}, ...]. Masks and mode are restored afterwards.
    """
    layers = attention_layers(model)
    names = [n for n, _ in layers]
    if names != list(importance.names):
        raise ValueError(f"importance was computed for modules {importance.names}, the model has {names}")
    for (name, attn), vec in zip(layers, importance.importance):
        if len(vec) != attn.n_heads:
            raise ValueError(f"{name}: importance has {len(vec)} heads, the module {attn.n_heads}")
    order = importance.order()
    total = len(order)
    curve: list[dict[str, Any]] = []
    with head_masks(model):
        value = None
        previous = -1
        for k, n_pruned in enumerate(pruning_steps(total, step_fraction)):
            pruned = order[:n_pruned]
            gates = [torch.ones(attn.n_heads, device=_param_device(attn)) if n_pruned else None for _, attn in layers]
            for li, h in pruned:
                gates[li][h] = 0.0
            for (_, attn), gate in zip(layers, gates):
                attn.head_mask = gate
            if n_pruned != previous:
                value = _evaluate(model, evaluate, metric)
                previous = n_pruned
            curve.append({
                "fraction": round(min(1.0, k * step_fraction), 10),
                "heads_pruned": n_pruned,
                metric: value,
                "pruned": [[li, h] for li, h in pruned],
            })
    return curve
