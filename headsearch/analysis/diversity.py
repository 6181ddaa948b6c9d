"""Head diversity metrics (the "X-Raying Multi-head Attention" article, after Li et al.
2018 and Lee et al. 2019; docs/design.md §5).

One pass of a model in eval mode over a fixed set of evaluation batches, observed through forward
hooks on the `Attention` modules' identity hook points (`hook_q`, `hook_context`, `hook_head_out`)
and on the modules themselves (their attention probabilities). The model is not modified.

Per attention module, with N the number of valid query positions seen (all batches together):

- query orthogonality      ortho[i, j]   = sum_{a,b} |(Q_i^T Q_j)[a, b]| / N
- context non-orthogonality nonortho[i, j] = ||C_i^T C_j||_F / N,  C_i = A_i V_i (the head's
  self-attention output before any fusion or head mask)
- its normalised form      ||C_i^T C_j||_F / sqrt(||C_i^T C_i||_F ||C_j^T C_j||_F)  in [0, 1]
- output dissimilarity     outdis[i, j]  = -mean_{valid b,t} cos(O_i[b, t], O_j[b, t]),  O = hook_head_out
- attention diversity      attvar[i]     = mean_{valid (b, key k)} Var_{valid q}(A_i[b, q, k])

Q_i, C_i, O_i are (N, d_k): head i's vectors at the valid query positions of every batch. The Gram
matrices Q^T Q and C^T C are summed over batches (in float64) before the absolute value / norm is
taken, so the metrics are those of the whole set, whatever the batching; dividing by N makes them
independent of how many samples were used (the article's definition sums over the batch). Attention
diversity is computed per (sample, key) and then averaged, so it too does not depend on batching.

Validity: padded positions are excluded as queries from every metric and as keys from attention
diversity (their probabilities are 0 anyway when the model masks them). Which mask applies where is
decided by the module's qualified name (`module_masks`). Note the decoder self-attention is causal:
A[b, q, k] = 0 for q < k counts as a real value of the variance over queries (it is the model's
attention there), as in the X-Raying article.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch
from torch import Tensor, nn

from headsearch.models.transformer import attention_layers

METRICS = (
    "query_orthogonality",
    "context_nonorthogonality",
    "context_nonorthogonality_normalized",
    "output_dissimilarity",
    "attention_diversity",
)


@dataclass
class LayerDiversity:
    """Diversity of the heads of one attention module (see the module docstring for the formulas).

    All (H, H) matrices have a zero diagonal. `n_positions` is N, the number of valid query
    positions the metrics were computed over; `n_keys` the number of valid (sample, key) pairs.
    A module that saw no valid position has NaN everywhere.

    The normalised non-orthogonality is at most 1: ||C_i^T C_j||_F^2 = <C_i C_i^T, C_j C_j^T>_F
    <= ||C_i C_i^T||_F ||C_j C_j^T||_F = ||C_i^T C_i||_F ||C_j^T C_j||_F (Cauchy-Schwarz on the PSD
    Gram matrices, whose Frobenius norms equal those of C^T C), with equality for identical heads.
    A pair where one head's context is identically zero gets 0 (no overlap), not NaN.
    """

    name: str
    heads: int
    query_orthogonality: np.ndarray  # (H, H)
    context_nonorthogonality: np.ndarray  # (H, H)
    context_nonorthogonality_normalized: np.ndarray  # (H, H)
    output_dissimilarity: np.ndarray  # (H, H)
    attention_diversity: np.ndarray  # (H,)
    n_positions: int = 0
    n_keys: int = 0

    def scalars(self) -> dict[str, float]:
        """Layer scalars: the mean over i != j of each matrix, the mean over heads of attention diversity.

        With a single head there is no pair, so the four pairwise scalars are NaN.
        """
        h = self.heads
        pairwise = {key: getattr(self, key) for key in METRICS[:4]}
        out = {key: float("nan") if h < 2 else float((m.sum() - np.trace(m)) / (h * (h - 1)))
               for key, m in pairwise.items()}
        out["attention_diversity"] = float(np.mean(self.attention_diversity))
        return out


# -- which padding mask applies to which module -------------------------------------------------


def module_masks(name: str, masks: Mapping[str, Any] | None) -> tuple[Tensor | None, Tensor | None]:
    """(query validity (B, Tq), key validity (B, Tk)) for the attention module `name`; None = all valid.

    `masks` is a batch's {"src": (B, S) bool, "tgt": (B, T) bool} (translation) or {} (ViT):
    modules named "encoder.*" use src for queries and keys; "*cross_attn*" tgt queries and src keys;
    "*self_attn*" or "decoder.*" tgt for both. An entry under the module's own name, a pair
    (query mask, key mask), overrides these rules (for models named otherwise). With masks given
    but no rule matching the name, a ValueError is raised rather than guessing.
    """
    if not masks:
        return None, None
    if name in masks:
        q, k = masks[name]
        return q, k
    if name.startswith("encoder."):
        return masks.get("src"), masks.get("src")
    if "cross_attn" in name:
        return masks.get("tgt"), masks.get("src")
    if "self_attn" in name or name.startswith("decoder."):
        return masks.get("tgt"), masks.get("tgt")
    raise ValueError(
        f"no mask rule for attention module {name!r} (masks given: {sorted(masks)}): name it encoder.*/"
        f"decoder.*self_attn/cross_attn, or pass masks[{name!r}] = (query_mask, key_mask)"
    )


def _valid(mask: Tensor | None, b: int, t: int, device: torch.device, what: str, name: str) -> Tensor:
    """A (B, T) bool validity mask, all True when none is given; checks the shape."""
    if mask is None:
        return torch.ones(b, t, dtype=torch.bool, device=device)
    mask = mask.to(device=device, dtype=torch.bool)
    if tuple(mask.shape) != (b, t):
        raise ValueError(f"{name}: {what} mask has shape {tuple(mask.shape)}, the module saw (B, T) = ({b}, {t})")
    return mask


# -- observing attention modules ----------------------------------------------------------------


class AttentionTap:
    """Forward hooks on every `Attention` of a model; `on_call(name, record)` after each module call.

    `record` holds the module's "q", "context", "head_out" (B, H, Tq, d_k) and "weights"
    (B, H, Tq, Tk) tensors, detached, plus "query_mask"/"key_mask" (B, T) bool (all True when the
    current batch has no masks). A forward pre-hook makes each module compute its probabilities
    (need_weights=True: the explicit softmax path, not the fused kernel), so any model built from
    `Attention` works whatever its own forward passes. Use as a context manager: the hooks are
    removed on exit, also after an error. Set `masks` to the current batch's masks before each call.
    """

    def __init__(self, model: nn.Module, on_call: Callable[[str, dict[str, Any]], None]):
        self.layers = attention_layers(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no headsearch Attention module to analyse")
        self.on_call = on_call
        self.masks: Mapping[str, Any] | None = None
        self._handles: list[Any] = []
        self._records: dict[str, dict[str, Tensor]] = {}

    def __enter__(self) -> "AttentionTap":
        try:
            for name, attn in self.layers:
                self._records[name] = {}
                self._handles.append(attn.register_forward_pre_hook(_force_weights, with_kwargs=True))
                for point in ("q", "context", "head_out"):
                    self._handles.append(getattr(attn, "hook_" + point).register_forward_hook(self._store(name, point)))
                self._handles.append(attn.register_forward_hook(self._finish(name)))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._records.clear()

    def _store(self, name: str, point: str):
        def hook(module, args, output):
            self._records[name][point] = output.detach()

        return hook

    def _finish(self, name: str):
        def hook(module, args, output):
            rec = self._records[name]
            rec["weights"] = output.weights.detach()
            b, _, tq, tk = rec["weights"].shape
            qm, km = module_masks(name, self.masks)
            device = rec["weights"].device
            rec["query_mask"] = _valid(qm, b, tq, device, "query", name)
            rec["key_mask"] = _valid(km, b, tk, device, "key", name)
            try:
                self.on_call(name, rec)
            finally:
                self._records[name] = {}

        return hook


def _force_weights(module, args, kwargs):
    """Forward pre-hook: call Attention.forward(x, context, mask, skip_state, need_weights=True)."""
    if len(args) >= 5:
        args = args[:4] + (True,) + tuple(args[5:])
    else:
        kwargs = {**kwargs, "need_weights": True}
    return args, kwargs


@contextlib.contextmanager
def head_masks(model: nn.Module) -> Iterator[list[tuple[str, nn.Module]]]:
    """The model's attention modules, in eval mode, for setting `head_mask`s: on exit (also after an
    error) every module gets its own mask back and the model its training flag."""
    layers = attention_layers(model)
    saved = [attn.head_mask for _, attn in layers]
    was_training = model.training
    try:
        model.eval()
        yield layers
    finally:
        for (_, attn), mask in zip(layers, saved):
            attn.head_mask = mask
        model.train(was_training)


# -- per-call statistics ------------------------------------------------------------------------


def entropy_sums(weights: Tensor, query_mask: Tensor) -> tuple[Tensor, int]:
    """(sum over valid queries of -sum_k A log A per head (H,) float64, number of valid queries)."""
    a = weights.double()  # (B, H, Tq, Tk)
    ent = -torch.special.xlogy(a, a).sum(-1)  # (B, H, Tq); masked keys have A = 0 and add 0
    qm = query_mask.to(a.dtype)[:, None, :]  # (B, 1, Tq)
    return (ent * qm).sum((0, 2)), int(query_mask.sum())


@dataclass
class _LayerStats:
    """Exact running sums for one module (float64)."""

    heads: int
    head_dim: int
    gram_q: Tensor | None = None  # (H d_k, H d_k): sum of Q^T Q over valid positions
    gram_c: Tensor | None = None  # (H d_k, H d_k): sum of C^T C
    cos_sum: Tensor | None = None  # (H, H): sum of cos(O_i, O_j)
    var_sum: Tensor | None = None  # (H,): sum over valid (b, k) of Var_q A
    n_positions: int = 0
    n_keys: int = 0

    def add(self, rec: dict[str, Tensor]) -> None:
        qm, km = rec["query_mask"], rec["key_mask"]
        h, d = self.heads, self.head_dim

        def rows(t: Tensor) -> Tensor:  # (B, H, Tq, d_k) -> (N, H, d_k) at valid queries, float64
            return t.transpose(1, 2)[qm].double()

        q, c, o = rows(rec["q"]), rows(rec["context"]), rows(rec["head_out"])
        n = q.shape[0]
        if self.gram_q is None:
            dev = q.device
            self.gram_q = torch.zeros(h * d, h * d, dtype=torch.float64, device=dev)
            self.gram_c = torch.zeros_like(self.gram_q)
            self.cos_sum = torch.zeros(h, h, dtype=torch.float64, device=dev)
            self.var_sum = torch.zeros(h, dtype=torch.float64, device=dev)
        q, c = q.reshape(n, h * d), c.reshape(n, h * d)
        self.gram_q += q.T @ q
        self.gram_c += c.T @ c
        unit = o / o.norm(dim=-1, keepdim=True).clamp_min(1e-300)  # a zero vector stays zero: cos 0
        self.cos_sum += torch.einsum("nhd,ngd->hg", unit, unit)
        self.n_positions += n

        # Attention diversity: per sample b and valid key k, the variance over valid queries.
        weights = rec["weights"]  # (B, H, Tq, Tk)
        n_q = qm.sum(1).double()  # (B,)
        has_q = n_q > 0
        valid_bk = km & has_q[:, None]  # (B, Tk)
        qmf = qm.double()[:, :, None]  # (B, Tq, 1)
        denom = n_q.clamp_min(1)[:, None]  # (B, 1)
        for head in range(h):  # one head at a time keeps the float64 temporaries small
            a = weights[:, head].double()  # (B, Tq, Tk)
            mean = (a * qmf).sum(1) / denom  # (B, Tk)
            var = ((a - mean[:, None, :]).square() * qmf).sum(1) / denom  # (B, Tk), population variance
            self.var_sum[head] += var[valid_bk].sum()
        self.n_keys += int(valid_bk.sum())

    def result(self, name: str) -> LayerDiversity:
        h, d = self.heads, self.head_dim
        nan_hh, nan_h = np.full((h, h), np.nan), np.full(h, np.nan)
        if not self.n_positions:
            return LayerDiversity(name, h, nan_hh, nan_hh.copy(), nan_hh.copy(), nan_hh.copy(), nan_h, 0, self.n_keys)
        n = float(self.n_positions)
        blocks = lambda g: g.view(h, d, h, d).permute(0, 2, 1, 3)  # noqa: E731  (H, H, d_k, d_k): Q_i^T Q_j
        ortho = blocks(self.gram_q).abs().sum((-2, -1)) / n
        cross = torch.linalg.matrix_norm(blocks(self.gram_c))  # (H, H) Frobenius norms of C_i^T C_j
        self_norm = cross.diagonal()
        denom = (self_norm[:, None] * self_norm[None, :]).sqrt()
        normalized = torch.where(denom > 0, cross / torch.where(denom > 0, denom, 1.0), torch.zeros_like(cross))
        outdis = -self.cos_sum / n
        attvar = self.var_sum / self.n_keys if self.n_keys else torch.full((h,), float("nan"), dtype=torch.float64)

        def offdiag(m: Tensor) -> np.ndarray:
            m = m.cpu().numpy().copy()
            np.fill_diagonal(m, 0.0)
            return m

        return LayerDiversity(
            name=name,
            heads=h,
            query_orthogonality=offdiag(ortho),
            context_nonorthogonality=offdiag(cross / n),
            context_nonorthogonality_normalized=offdiag(normalized.clamp(max=1.0)),
            output_dissimilarity=offdiag(outdis),
            attention_diversity=attvar.cpu().numpy(),
            n_positions=self.n_positions,
            n_keys=self.n_keys,
        )


# -- the pass -----------------------------------------------------------------------------------


def run_batches(model: nn.Module, batches: Iterable[Mapping[str, Any]], tap: AttentionTap) -> int:
    """Call model(*batch["inputs"]) for each batch with the tap's masks set; returns the batch count."""
    count = 0
    for count, batch in enumerate(batches, 1):
        if not isinstance(batch, Mapping) or "inputs" not in batch:
            raise TypeError("each batch must be a dict with 'inputs' (a tuple of model inputs) and optional 'masks'")
        tap.masks = batch.get("masks") or {}
        model(*batch["inputs"])
    return count


def head_diversity(model: nn.Module, batches: Iterable[Mapping[str, Any]]) -> list[LayerDiversity]:
    """Diversity metrics of every attention module of `model`, in forward order.

    `batches`: dicts {"inputs": tuple of model inputs, "masks": {...}} (see `analysis_batches`).
    The model runs in eval mode under torch.no_grad(); its training flag is restored afterwards.
    """
    with head_masks(model) as layers, torch.no_grad():
        stats = {name: _LayerStats(attn.n_heads, attn.head_dim) for name, attn in layers}
        with AttentionTap(model, lambda name, rec: stats[name].add(rec)) as tap:
            if run_batches(model, batches, tap) == 0:
                raise ValueError("head_diversity needs at least one batch")
    return [stats[name].result(name) for name, _ in layers]


# -- the batches every measurement uses ---------------------------------------------------------


def analysis_batches(bound: Any, split: str = "val", samples: int | None = 256, batch_size: int = 64) -> list[dict]:
    """The first `samples` items of a bound task's `split` as analysis batches (deterministic, unshuffled):
    dicts {"inputs": tuple of model inputs, "masks": {...}, "targets": ...} made by the task
    (`BoundTask.analysis_batches`). `samples=None` takes the whole split."""
    if split not in ("val", "test"):
        raise ValueError(f"split = {split!r}: use 'val' or 'test'")
    if samples is not None and samples < 1:
        raise ValueError(f"samples = {samples} must be at least 1")
    if batch_size < 1:
        raise ValueError(f"batch_size = {batch_size} must be at least 1")
    return bound.analysis_batches(split, samples, batch_size)


def diversity_summary(layers: list[LayerDiversity]) -> dict[str, float]:
    """Model-level scalars: the mean over layers of each layer scalar (NaN layers skipped)."""
    scalars = [layer.scalars() for layer in layers]
    values = {key: [s[key] for s in scalars if not math.isnan(s[key])] for key in METRICS}
    return {key: float(np.mean(v)) if v else float("nan") for key, v in values.items()}
