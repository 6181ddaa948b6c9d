"""Encoder-decoder Transformer (Vaswani et al. 2017, arXiv:1706.03762) with per-layer encoder heads.

Defaults follow the repository of Deep Head (Cruz et al.; docs/design.md §4.2): d_model 512, 6+6
layers, d_ff 2048, dropout 0.1, pre-LN, ReLU, sinusoidal positions, embeddings scaled by
sqrt(d_model), Xavier init; with masks that really mask: that repository filled them with `-1**9`,
which is -1, so padding leaked everywhere (docs/design.md §4.3).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from headsearch.config import ArchConfig
from headsearch.errors import ConfigError
from headsearch.models.transformer import Decoder, Encoder


def sinusoidal_positions(max_len: int, d_model: int) -> Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...)  -> (max_len, d_model)."""
    pos = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model)
    pe[:, 0::2] = torch.sin(pos * inv_freq)
    pe[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
    return pe


def check_seq2seq_arch(cfg: ArchConfig) -> None:
    """What the encoder-decoder needs of an architecture (tasks call it before any data loads)."""
    if cfg.dec_layers < 1:
        raise ConfigError("arch.dec_layers = 0: the translation model needs a decoder, set dec_layers (and dec_heads), e.g. 6 and 8")


class Seq2Seq(nn.Module):
    def __init__(self, cfg: ArchConfig, src_vocab: int, tgt_vocab: int, max_len: int, pad_id: int):
        super().__init__()
        check_seq2seq_arch(cfg)
        self.cfg, self.pad_id, self.max_len = cfg, pad_id, max_len
        self.src_embed = nn.Embedding(src_vocab, cfg.d_model)
        self.tgt_embed = nn.Embedding(tgt_vocab, cfg.d_model)
        self.register_buffer("positions", sinusoidal_positions(max_len, cfg.d_model), persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.generator = nn.Linear(cfg.d_model, tgt_vocab)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def _embed(self, table: nn.Embedding, ids: Tensor) -> Tensor:
        if ids.shape[1] > self.max_len:
            raise ValueError(f"sequence of {ids.shape[1]} tokens exceeds the model's max_len {self.max_len}")
        x = table(ids) * math.sqrt(self.cfg.d_model) + self.positions[: ids.shape[1]]  # (B, T, D)
        return self.drop(x)

    def padding_mask(self, ids: Tensor) -> Tensor:
        return (ids != self.pad_id)[:, None, None, :]  # (B, 1, 1, T): True where a real token is

    def encode(self, src: Tensor, need_weights: bool = False):
        src_mask = self.padding_mask(src)
        memory, weights = self.encoder(self._embed(self.src_embed, src), src_mask, need_weights)
        return memory, src_mask, weights

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor, need_weights: bool = False):
        t = tgt_in.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=tgt_in.device).tril()  # (T, T)
        self_mask = causal & self.padding_mask(tgt_in)  # (B, 1, T, T)
        x, self_w, cross_w = self.decoder(self._embed(self.tgt_embed, tgt_in), memory, self_mask, src_mask, need_weights)
        return self.generator(x), self_w, cross_w  # logits (B, T, V)

    def forward(self, src: Tensor, tgt_in: Tensor, need_weights: bool = False):
        """src: (B, S) ids, tgt_in: (B, T) ids starting with SOS -> logits (B, T, V) [, weights dict]."""
        memory, src_mask, enc_w = self.encode(src, need_weights)
        logits, self_w, cross_w = self.decode(tgt_in, memory, src_mask, need_weights)
        if need_weights:
            return logits, {"encoder": enc_w, "decoder_self": self_w, "decoder_cross": cross_w}
        return logits

    @torch.no_grad()
    def greedy_decode(self, src: Tensor, sos_id: int, eos_id: int, max_new_tokens: int | None = None) -> Tensor:
        """Batched greedy decoding: (B, S) -> (B, <= max_new_tokens) ids after SOS, PAD after each EOS."""
        limit = min(max_new_tokens or self.max_len - 1, self.max_len - 1)
        memory, src_mask, _ = self.encode(src)
        ys = torch.full((src.shape[0], 1), sos_id, dtype=torch.long, device=src.device)
        done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        for _ in range(limit):
            logits, _, _ = self.decode(ys, memory, src_mask)
            nxt = logits[:, -1].argmax(dim=-1)  # (B,)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            ys = torch.cat([ys, nxt[:, None]], dim=1)
            done |= nxt == eos_id
            if bool(done.all()):
                break
        return ys[:, 1:]
