"""One multi-head attention module for every variant headsearch explores.

- per-layer head count h with d_k = d_model / h (Deep Head, Cruz et al., eq. 1) or a fixed head width;
- a skip connection from the previous attention layer of the same stack (docs/design.md §2):
  "output" (Deep Head: merged head outputs added and layer-normalised) or
  "scores" (RealFormer, He et al. 2020, arXiv:2012.11747: pre-softmax scores added as a residual);
  or "value" (ResFormer, Zhou et al. 2024, arXiv:2410.17897: each layer's values mixed with the stack's
  first layer's); skips across the residual stream (U-net, DenseFormer) live in the stacks (streams.py);
- fusion of each head's self-attention with an additive soft-attention branch (HAM A/B,
  Martínez-Marín et al.; docs/design.md §3), or differential attention (DIFF Transformer, Ye et al. 2024,
  arXiv:2410.05258: each head the difference of two softmax maps; docs/design.md §3.1);
- a head mask multiplying each head's output (Michel et al. 2019, "Are Sixteen Heads Really Better
  than One?", arXiv:1905.10650), settable from outside so importance is a gradient w.r.t. it;
- optional attention probabilities for analysis;
- a key/value cache for incremental (token by token) decoding: see `KVCache`.

The fused `F.scaled_dot_product_attention` kernel is used whenever nothing needs the explicit scores
(no "scores" skip, no weights asked for); `tests/test_attention.py` checks both paths agree.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from headsearch.errors import ConfigError
from headsearch.models.variants import fusion_of, skip_of

VALUE_MIX_INIT = 0.5  # the value residual's lambda at the start: an equal mix, ResFormer's fixed choice
DIFF_LAMBDA_STD = 0.1  # the DIFF Transformer's lambda vectors start as N(0, 0.1^2) (its reference code)
DIFF_NORM_EPS = 1e-5


def differential_lambda_init(layer_index: int) -> float:
    """lambda_init = 0.8 - 0.6 exp(-0.3 l) for the l-th layer of a stack (0-based, as in Ye et al.'s code)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


class AttentionOutput(NamedTuple):
    out: Tensor  # (B, Tq, d_model)
    skip_state: Tensor | None  # what the next layer's skip receives (scores, merged heads or values), else None
    weights: Tensor | None  # (B, H, Tq, Tk) self-attention probabilities, when asked for
    soft_weights: Tensor | None  # (B, H, Tq, Tk) soft-attention probabilities, when asked for and fused


def map_score_heads(scores: Tensor, n_heads: int) -> Tensor:
    """Map skip scores from h_prev to `n_heads` heads (docs/design.md §2.2).

    Decreasing: head j receives the mean of the h_prev / h consecutive heads j*g .. j*g+g-1.
    Increasing: head j receives head j // g (each previous head repeated g times).
    """
    b, h_prev, tq, tk = scores.shape  # (B, H_prev, Tq, Tk)
    if h_prev == n_heads:
        return scores
    if h_prev > n_heads:
        return scores.view(b, n_heads, h_prev // n_heads, tq, tk).mean(dim=2)
    return scores.repeat_interleave(n_heads // h_prev, dim=1)


class KVCache:
    """What one attention layer keeps between the steps of incremental decoding (nanoGPT-style).

    Self-attention appends the new position's keys and values at each step, so only the new query runs
    through the layer; cross-attention stores the encoder memory's keys and values at the first step and
    reuses them. `soft` holds the soft branch's projected keys W1 k_j (`SoftAttention.project_keys`) the
    same way, when the layer has one. Buffers are allocated on the first `extend`, for `capacity`
    positions (or as many as that first call brings), in the dtype and on the device of the keys.
    """

    def __init__(self, capacity: int = 0):
        self.capacity, self.length = capacity, 0
        self.k = self.v = self.soft = None  # (B, H, capacity, d_k), and (B, H, capacity, A) for soft

    def extend(self, k: Tensor, v: Tensor, soft: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Append n positions ((B, H, n, d_k) each, soft (B, H, n, A)); return every position cached so far."""
        start, end = self.length, self.length + k.shape[2]
        if self.k is None:
            size = max(self.capacity, end)
            self.k, self.v = (t.new_empty(*t.shape[:2], size, t.shape[3]) for t in (k, v))
            self.soft = soft.new_empty(*soft.shape[:2], size, soft.shape[3]) if soft is not None else None
        if end > self.k.shape[2]:
            raise ValueError(f"the cache holds {self.k.shape[2]} positions; position {end - 1} does not fit")
        self.k[:, :, start:end], self.v[:, :, start:end] = k, v
        if soft is not None:
            self.soft[:, :, start:end] = soft
        self.length = end
        return self.cached()

    def cached(self) -> tuple[Tensor, Tensor, Tensor | None]:
        n = self.length
        return self.k[:, :, :n], self.v[:, :, :n], self.soft[:, :, :n] if self.soft is not None else None  # (B, H, n, .)


class AdditiveEnergy(torch.autograd.Function):
    """e[b,h,i,j] = sum_a w[h,a] * tanh(qq[b,h,i,a] + kk[b,h,j,a]), computed over chunks of queries.

    Materialising the whole (B, H, Tq, Tk, A) tanh tensor (about 100 MB per layer for the reference ViT
    at batch 128, and several of them in backward) makes allocation, not arithmetic, the cost on a CPU.
    Chunks of `chunk` queries keep the temporaries cache-sized; backward recomputes the tanh instead
    of storing it. `tests/test_attention.py` checks it against the direct formula and with gradcheck.
    """

    @staticmethod
    def forward(ctx, qq: Tensor, kk: Tensor, w: Tensor, chunk: int) -> Tensor:
        b, h, tq, a = qq.shape
        out = qq.new_empty(b, h, tq, kk.shape[2])  # (B, H, Tq, Tk)
        w_col = w.view(1, h, 1, a, 1)
        for s in range(0, tq, chunk):
            hidden = torch.tanh(qq[:, :, s : s + chunk, None, :] + kk[:, :, None, :, :])  # (B, H, c, Tk, A)
            out[:, :, s : s + chunk] = (hidden @ w_col).squeeze(-1)
        ctx.save_for_backward(qq, kk, w)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        qq, kk, w = ctx.saved_tensors
        b, h, tq, a = qq.shape
        d_qq, d_kk, d_w = torch.empty_like(qq), torch.zeros_like(kk), torch.zeros_like(w)
        w_row = w.view(1, h, 1, 1, a)
        for s in range(0, tq, ctx.chunk):
            g = grad[:, :, s : s + ctx.chunk]  # (B, H, c, Tk)
            hidden = torch.tanh(qq[:, :, s : s + ctx.chunk, None, :] + kk[:, :, None, :, :])  # (B, H, c, Tk, A)
            d_w += torch.einsum("bhqka,bhqk->ha", hidden, g)
            # d pre-activation = g * w * (1 - tanh^2), built in place in the recomputed buffer
            d_pre = hidden.square_().neg_().add_(1).mul_(g.unsqueeze(-1)).mul_(w_row)
            d_qq[:, :, s : s + ctx.chunk] = d_pre.sum(dim=3)
            d_kk += d_pre.sum(dim=2)
        return d_qq, d_kk, d_w, None


def additive_energy(qq: Tensor, kk: Tensor, w: Tensor, budget: int | None = None) -> Tensor:
    """(B, H, Tq, A), (B, H, Tk, A), (H, A) -> (B, H, Tq, Tk); see AdditiveEnergy."""
    b, h, _, a = qq.shape
    if budget is None:  # elements per temporary: cache-sized on a CPU, large on a GPU (fewer launches)
        budget = 2**25 if qq.is_cuda else 2**20
    chunk = max(1, budget // max(1, b * h * kk.shape[2] * a))
    dtype = torch.promote_types(qq.dtype, kk.dtype)
    return AdditiveEnergy.apply(qq.to(dtype), kk.to(dtype), w.to(dtype), chunk)


class SoftAttention(nn.Module):
    """Additive ("soft", Bahdanau et al. 2015, arXiv:1409.0473) attention inside each head.

    e_ij = w^T tanh(W1 k_j + W2 q_i), alpha_ij = softmax_j(e_ij + mask), out_i = sum_j alpha_ij v_j,
    with W1, W2: d_k -> d_a and w: d_a -> 1, no biases, separate weights per head (docs/design.md §3).
    `score="key"` drops the W2 q_i term (each key scored alone): cheaper, and still masked per query,
    so it stays causal in a decoder.
    """

    def __init__(self, n_heads: int, head_dim: int, soft_dim: int, score: str = "pairwise"):
        super().__init__()
        self.score = score
        self.w_key = nn.Parameter(torch.empty(n_heads, head_dim, soft_dim))  # W1 per head
        self.w_query = nn.Parameter(torch.empty(n_heads, head_dim, soft_dim)) if score == "pairwise" else None  # W2
        self.w_energy = nn.Parameter(torch.empty(n_heads, soft_dim))  # w per head
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Same scale as nn.Linear's default: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        for p in (self.w_key, self.w_query, self.w_energy):  # fan_in: d_k for W1 and W2, d_a for w
            if p is not None:
                bound = 1 / math.sqrt(p.shape[1])
                nn.init.uniform_(p, -bound, bound)

    def project_keys(self, k: Tensor) -> Tensor:
        """W1 k_j for every key: (B, H, Tk, d_k) -> (B, H, Tk, A). A decoding cache keeps these."""
        return torch.einsum("bhtd,hda->bhta", k, self.w_key)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, keys: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """`keys`: `project_keys(k)` when already known (a decoding cache), else computed here."""
        keys = self.project_keys(k) if keys is None else keys  # (B, H, Tk, A)
        if self.w_query is not None:
            queries = torch.einsum("bhtd,hda->bhta", q, self.w_query)  # (B, H, Tq, A)
            energy = additive_energy(queries, keys, self.w_energy)  # (B, H, Tq, Tk)
        else:
            energy = torch.einsum("bhka,ha->bhk", torch.tanh(keys), self.w_energy)  # (B, H, Tk)
            energy = energy.unsqueeze(2).expand(-1, -1, q.shape[2], -1)  # (B, H, Tq, Tk)
        if mask is not None:
            energy = energy.masked_fill(~mask, float("-inf"))
        alpha = energy.softmax(dim=-1)  # (B, H, Tq, Tk)
        return alpha @ v, alpha  # (B, H, Tq, d_k)


class Projected(NamedTuple):
    """What `Attention._project` computes of its inputs."""

    q: Tensor  # (B, H, Tq, d_k)
    k: Tensor  # (B, H, Tk, d_k): with a cache, every position cached so far
    v: Tensor  # (B, H, Tk, d_k): the same positions; mixed with the first layer's (value residual)
    soft_keys: Tensor | None  # (B, H, Tk, A) the soft branch's projected keys, when a cache holds them
    fresh_values: Tensor | None  # (B, n, H·d_k) the values this call projected, before any mixing (None: cached)


class Attention(nn.Module):
    """Multi-head (self- or cross-) attention with a per-layer head count, skip input and fusion.

    `skip` is the kind of skip this layer's stack uses and `fusion` how each head meets its soft branch:
    names looked up in models/variants.py, so an unknown one fails here. `skip_in` says whether this
    layer receives a skip (False for the first layer of a stack, which only emits). `layer_index` is the
    position in the stack, used by the running-mean variant of the scores skip.

    Incremental decoding passes a `KVCache` and only the new position as `x` (B, 1, d_model): every
    per-position quantity (projections, merged heads, the output skip) is the same for that row as in a
    full pass, and the scores skip it receives and emits is that row's (B, H, 1, Tk) over all cached keys.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        *,
        cross: bool = False,
        skip: str = "none",
        skip_in: bool = False,
        skip_mean: bool = False,
        layer_index: int = 0,
        fusion: str = "none",
        soft_dim: int | None = None,
        soft_score: str = "pairwise",
        attn_dropout: float = 0.0,
    ):
        super().__init__()
        self.n_heads, self.head_dim, self.attn_dim = n_heads, head_dim, n_heads * head_dim
        self.scale = head_dim**-0.5
        self.skip, self.fusion = skip_of(skip), fusion_of(fusion)  # the records, not the names, decide below
        self.cross, self.skip_in = cross, skip_in and self.skip.carries
        # The running mean divides a scores skip's running sum; without a scores skip there is no sum, and the
        # fused path (which never divides) and the explicit one (weights asked for) must still agree.
        self.score_divisor = float(layer_index + 1) if skip_mean and self.skip.carries_scores else 1.0
        self.attn_dropout = attn_dropout
        if cross:
            self.q_proj = nn.Linear(d_model, self.attn_dim)
            self.kv_proj = nn.Linear(d_model, 2 * self.attn_dim)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * self.attn_dim)  # one matmul for q, k and v
        self.out_proj = nn.Linear(self.attn_dim, d_model)  # W_o
        self.skip_norm = nn.LayerNorm(self.attn_dim) if self.skip_in and self.skip.carries_output else None
        self.soft = SoftAttention(n_heads, head_dim, soft_dim or head_dim, soft_score) if self.fusion.soft is not None else None
        # Value residual: v <- lambda v + (1 - lambda) v_1, lambda learned (one per layer that receives v_1)
        self.value_mix = nn.Parameter(torch.tensor(VALUE_MIX_INIT)) if self.skip_in and self.skip.carries_values else None
        if self.fusion.differential:
            if head_dim % 2:
                raise ConfigError(f"differential attention splits each head's queries and keys in two halves:"
                                  f" a head width of {head_dim} is odd (use an even width or another fusion)")
            self.lambda_init = differential_lambda_init(layer_index)
            self.lambda_q = nn.Parameter(torch.empty(2, head_dim // 2).normal_(0, DIFF_LAMBDA_STD))  # lambda_q1, lambda_q2
            self.lambda_k = nn.Parameter(torch.empty(2, head_dim // 2).normal_(0, DIFF_LAMBDA_STD))  # lambda_k1, lambda_k2
            self.diff_norm = nn.RMSNorm(head_dim, eps=DIFF_NORM_EPS)  # each head normalised alone
        # Set from outside (analysis): a (H,) tensor multiplying each head's output (Michel et al.'s ξ);
        # may require grad. With a skip, what the layer passes on still carries earlier layers' signal.
        self.head_mask: Tensor | None = None
        # Identity hook points: forward hooks here see per-head tensors without changing the model.
        self.hook_q = nn.Identity()  # (B, H, Tq, d_k)
        self.hook_context = nn.Identity()  # (B, H, Tq, d_k) self-attention output A V, before fusion
        self.hook_head_out = nn.Identity()  # (B, H, Tq, d_k) each head's output (fused, masked)

    def needs_explicit_scores(self, need_weights: bool) -> bool:
        return need_weights or self.skip.carries_scores

    def _project(self, x: Tensor, context: Tensor | None, cache: KVCache | None = None,
                 first_values: Tensor | None = None) -> Projected:
        """q, k, v split into heads, and the soft branch's projected keys when a cache holds them (None: the
        soft branch projects k itself). `first_values` (B, n, H·d_k): the stack's first layer's values for
        the positions this call projects, which a value-residual layer mixes into its own before caching.

        With a cache, k and v span every position cached so far: self-attention appends this call's
        positions; cross-attention projects the memory at the first step only.
        """
        b = x.shape[0]
        heads = lambda t: t.view(b, t.shape[1], self.n_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        if self.cross:
            q = heads(self.q_proj(x))
            if cache is not None and cache.length:  # the memory's keys and values, from the first step
                return Projected(q, *cache.cached(), None)
            k, v = self.kv_proj(context).chunk(2, dim=-1)
        else:
            q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
            q = heads(q)
        fresh = v  # (B, n, H·d_k)
        if self.value_mix is not None:
            if first_values is None:
                raise ValueError("a value-residual layer needs the stack's first layer's values (skip_state)")
            v = self.value_mix * v + (1 - self.value_mix) * first_values  # ResFormer: mixed per position
        k, v = heads(k), heads(v)
        if cache is None:
            return Projected(q, k, v, None, fresh)
        soft_keys = self.soft.project_keys(k) if self.soft is not None else None
        return Projected(q, *cache.extend(k, v, soft_keys), fresh)

    def differential_lambda(self) -> Tensor:
        """lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init (Ye et al. 2024, eq. 2)."""
        dots = (self.lambda_q * self.lambda_k).sum(dim=-1)  # (2,)
        return torch.exp(dots[0]) - torch.exp(dots[1]) + self.lambda_init

    def _differential(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, explicit: bool,
                      received: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """DIFF Transformer heads (Ye et al. 2024): [softmax(q1 k1^T / sqrt(d)) - lambda softmax(q2 k2^T / sqrt(d))] v
        over the two halves (width d = d_k / 2) of each head's queries and keys, each head RMS-normalised and
        scaled by 1 - lambda_init. With the scores skip, each map's pre-softmax scores get the previous layer's
        of the same map (`received`: (B, 2 H_prev, Tq, Tk), the first map's heads then the second's), and both
        are emitted the same way. Returns the heads (B, H, Tq, d_k), the map (B, H, Tq, Tk) when `explicit`,
        and the emitted scores with a scores skip."""
        lam = self.differential_lambda().to(q.dtype)
        (q1, q2), (k1, k2) = q.chunk(2, dim=-1), k.chunk(2, dim=-1)  # (B, H, T, d_k / 2) each
        weights = emitted = None
        if explicit:
            maps, scores = [], []
            previous = received.chunk(2, dim=1) if received is not None else (None, None)  # (B, H_prev, Tq, Tk) each
            for qi, ki, before in ((q1, k1, previous[0]), (q2, k2, previous[1])):
                s = (qi @ ki.transpose(-2, -1)) * qi.shape[-1] ** -0.5  # (B, H, Tq, Tk)
                if before is not None:
                    s = s + map_score_heads(before, self.n_heads)  # RealFormer residual, map by map
                scores.append(s)
                logits = s / self.score_divisor
                if mask is not None:
                    logits = logits.masked_fill(~mask, float("-inf"))
                maps.append(logits.softmax(dim=-1))
            weights = maps[0] - lam * maps[1]  # (B, H, Tq, Tk): rows sum to 1 - lambda
            emitted = torch.cat(scores, dim=1) if self.skip.carries_scores else None  # (B, 2H, Tq, Tk)
            heads = F.dropout(weights, self.attn_dropout, self.training) @ v
        else:  # the same map applied to v, as two fused kernels (each with its own dropout draw in training)
            dropout = self.attn_dropout if self.training else 0.0
            heads = (F.scaled_dot_product_attention(q1, k1, v, attn_mask=mask, dropout_p=dropout)
                     - lam * F.scaled_dot_product_attention(q2, k2, v, attn_mask=mask, dropout_p=dropout))
        return self.diff_norm(heads) * (1 - self.lambda_init), weights, emitted  # heads (B, H, Tq, d_k)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        mask: Tensor | None = None,
        skip_state: Tensor | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
    ) -> AttentionOutput:
        """x: (B, Tq, d_model); context: (B, Tk, d_model) for cross-attention; mask: bool, broadcastable
        to (B, H, Tq, Tk), True where attention is allowed; skip_state: the previous layer's emission;
        cache: this layer's decoding cache (x then holds the new positions only)."""
        b, tq, _ = x.shape
        first_values = skip_state if self.skip.carries_values and self.skip_in else None
        q, k, v, soft_keys, fresh_values = self._project(x, context, cache, first_values)
        q = self.hook_q(q)
        weights = emitted_scores = None

        if self.fusion.differential:
            received = skip_state if self.skip.carries_scores and self.skip_in else None
            heads, weights, emitted_scores = self._differential(q, k, v, mask, self.needs_explicit_scores(need_weights),
                                                                received)
        elif self.needs_explicit_scores(need_weights):
            scores = (q @ k.transpose(-2, -1)) * self.scale  # (B, H, Tq, Tk)
            if self.skip.carries_scores and self.skip_in and skip_state is not None:
                scores = scores + map_score_heads(skip_state, self.n_heads)  # RealFormer residual
            emitted_scores = scores  # pre-mask running sum: the mask is not carried forward
            logits = scores / self.score_divisor
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf"))
            weights = logits.softmax(dim=-1)  # (B, H, Tq, Tk)
            p = F.dropout(weights, self.attn_dropout, self.training)
            heads = p @ v  # (B, H, Tq, d_k)
        else:
            dropout = self.attn_dropout if self.training else 0.0
            heads = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)  # (B, H, Tq, d_k)
        heads = self.hook_context(heads)

        soft_weights = None
        if self.soft is not None:
            soft, soft_weights = self.soft(q, k, v, mask, soft_keys)  # (B, H, Tq, d_k)
            heads = self.fusion.soft(heads, soft)  # HAM A / HAM B: (B, H, Tq, d_k)
        if self.head_mask is not None:
            heads = heads * self.head_mask.view(1, -1, 1, 1).to(heads.dtype)
        heads = self.hook_head_out(heads)

        merged = heads.transpose(1, 2).reshape(b, tq, self.attn_dim)  # concat_h: (B, Tq, H * d_k)
        if self.skip.carries_output:
            if self.skip_norm is not None and skip_state is not None:
                merged = self.skip_norm(merged + skip_state)  # Deep Head: add and normalise
            emitted = merged
        elif self.skip.carries_values:  # the first layer's own values, passed on unchanged by the others
            emitted = skip_state if self.skip_in else fresh_values
        else:
            emitted = emitted_scores
        return AttentionOutput(
            self.out_proj(merged),
            emitted if self.skip.carries else None,
            weights if need_weights else None,
            soft_weights if need_weights else None,
        )
