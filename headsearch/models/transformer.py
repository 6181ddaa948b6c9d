"""Pre-LN transformer blocks and stacks built from an `ArchConfig`, shared by the ViT and the seq2seq model.

A stack threads the skip state from each attention layer to the next; a decoder has two chains,
one through its self-attention layers and one through its cross-attention layers. A skip across the
residual stream (U-net, DenseFormer: `streams.py`) threads the blocks' outputs instead. A decoder can also
run one new position at a time against a key/value cache (`Decoder.empty_cache`), for greedy decoding.
"""
from __future__ import annotations

from typing import NamedTuple

from torch import Tensor, nn

from headsearch.config import ArchConfig
from headsearch.models.attention import Attention, AttentionOutput, KVCache
from headsearch.models.variants import skip_of


def make_attention(cfg: ArchConfig, heads: int, index: int, cross: bool = False) -> Attention:
    return Attention(
        cfg.d_model,
        heads,
        cfg.head_width(heads),
        cross=cross,
        skip=cfg.skip,
        skip_in=index > 0,
        skip_mean=cfg.skip_mean,
        layer_index=index,
        fusion=cfg.fusion,
        soft_dim=cfg.soft_dim,
        soft_score=cfg.soft_score,
        attn_dropout=cfg.attn_dropout,
    )


def make_stream(cfg: ArchConfig, layers: int) -> nn.Module | None:
    """The module a stack threads its blocks' outputs through (models/streams.py), or None without such a skip."""
    stream = skip_of(cfg.skip).stream
    return stream.build(layers) if stream is not None and layers else None


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.act = nn.GELU() if cfg.activation == "gelu" else nn.ReLU()
        self.drop = nn.Dropout(cfg.dropout)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.drop(self.act(self.fc1(x))))


class EncoderBlock(nn.Module):
    def __init__(self, cfg: ArchConfig, heads: int, index: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = make_attention(cfg, heads, index)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, mask: Tensor | None, skip: Tensor | None, need_weights: bool) -> tuple[Tensor, AttentionOutput]:
        a = self.attn(self.norm1(x), mask=mask, skip_state=skip, need_weights=need_weights)
        x = x + self.drop(a.out)
        x = x + self.drop(self.mlp(self.norm2(x)))
        return x, a


class DecoderBlock(nn.Module):
    def __init__(self, cfg: ArchConfig, heads: int, index: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.self_attn = make_attention(cfg, heads, index)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.cross_attn = make_attention(cfg, heads, index, cross=True)
        self.norm3 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        self_mask: Tensor | None,
        cross_mask: Tensor | None,
        skips: tuple[Tensor | None, Tensor | None],
        need_weights: bool,
        cache: tuple[KVCache, KVCache] | None = None,
    ) -> tuple[Tensor, AttentionOutput, AttentionOutput]:
        self_cache, cross_cache = cache if cache is not None else (None, None)
        s = self.self_attn(self.norm1(x), mask=self_mask, skip_state=skips[0], need_weights=need_weights, cache=self_cache)
        x = x + self.drop(s.out)
        c = self.cross_attn(self.norm2(x), memory, mask=cross_mask, skip_state=skips[1], need_weights=need_weights,
                            cache=cross_cache)
        x = x + self.drop(c.out)
        x = x + self.drop(self.mlp(self.norm3(x)))
        return x, s, c


class LayerWeights(NamedTuple):
    """Attention probabilities of one layer, (B, H, Tq, Tk) each; soft is None without fusion."""

    self_attn: Tensor
    soft: Tensor | None


class Encoder(nn.Module):
    """A stack of encoder blocks with per-layer heads, then a final LayerNorm (needed with pre-LN)."""

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(cfg, h, i) for i, h in enumerate(cfg.enc_heads))
        self.stream = make_stream(cfg, len(self.blocks))
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: Tensor, mask: Tensor | None = None, need_weights: bool = False) -> tuple[Tensor, list[LayerWeights]]:
        skip, weights = None, []
        memory = self.stream.start(x) if self.stream is not None else None
        for i, block in enumerate(self.blocks):
            if self.stream is not None:
                x = self.stream.before(i, x, memory)
            x, a = block(x, mask, skip, need_weights)
            if self.stream is not None:
                x = self.stream.after(i, x, memory)
            skip = a.skip_state
            if need_weights:
                weights.append(LayerWeights(a.weights, a.soft_weights))
        return self.norm(x), weights


class Decoder(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.blocks = nn.ModuleList(DecoderBlock(cfg, h, i) for i, h in enumerate(cfg.dec_heads))
        self.stream = make_stream(cfg, len(self.blocks))
        self.norm = nn.LayerNorm(cfg.d_model)

    def empty_cache(self, steps: int) -> list[tuple[KVCache, KVCache]]:
        """A (self-attention, cross-attention) cache per block, for decoding up to `steps` positions."""
        return [(KVCache(steps), KVCache()) for _ in self.blocks]

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        self_mask: Tensor | None,
        cross_mask: Tensor | None,
        need_weights: bool = False,
        cache: list[tuple[KVCache, KVCache]] | None = None,
    ) -> tuple[Tensor, list[LayerWeights], list[LayerWeights]]:
        """x: (B, T, D) target embeddings; memory: (B, S, D). With `cache` (from `empty_cache`), x holds the
        new positions only and the self-attention mask covers every cached position: (B, 1, T, T_cached)."""
        skips: tuple[Tensor | None, Tensor | None] = (None, None)
        self_w, cross_w = [], []
        stream = self.stream.start(x) if self.stream is not None else None
        for i, block in enumerate(self.blocks):
            if self.stream is not None:
                x = self.stream.before(i, x, stream)
            x, s, c = block(x, memory, self_mask, cross_mask, skips, need_weights, cache[i] if cache is not None else None)
            if self.stream is not None:
                x = self.stream.after(i, x, stream)
            skips = (s.skip_state, c.skip_state)
            if need_weights:
                self_w.append(LayerWeights(s.weights, s.soft_weights))
                cross_w.append(LayerWeights(c.weights, c.soft_weights))
        return self.norm(x), self_w, cross_w


def attention_layers(model: nn.Module) -> list[tuple[str, Attention]]:
    """Every attention module of a model, by qualified name, in forward order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Attention)]
