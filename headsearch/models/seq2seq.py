"""Encoder-decoder Transformer (Vaswani et al. 2017, arXiv:1706.03762) with per-layer encoder heads.

Defaults follow the repository of Deep Head (Cruz et al.; docs/design.md §4.2): d_model 512, 6+6
layers, d_ff 2048, dropout 0.1, pre-LN, ReLU, sinusoidal positions, embeddings scaled by
sqrt(d_model), Xavier init; with masks that really mask: that repository filled them with `-1**9`,
which is -1, so padding leaked everywhere (docs/design.md §4.3).

Greedy decoding runs one new position at a time against a key/value cache (`decode_step`); the full
recomputation of the prefix at every step stays available as the reference (`use_cache=False`).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from headsearch.config import ArchConfig
from headsearch.models.attention import KVCache
from headsearch.models.checks import check_seq2seq_arch
from headsearch.models.transformer import Decoder, Encoder

# Decoding stops once every sentence has ended. On a GPU, reading that flag waits for the device, so
# it is read every few tokens there (a few wasted steps at most); on the CPU it costs nothing.
STOP_CHECK_EVERY = 4


def sinusoidal_positions(max_len: int, d_model: int) -> Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...)  -> (max_len, d_model)."""
    pos = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model)
    pe[:, 0::2] = torch.sin(pos * inv_freq)
    pe[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
    return pe


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

    def _embed(self, table: nn.Embedding, ids: Tensor, start: int = 0) -> Tensor:
        """Embeddings of `ids` (B, T) at positions start .. start + T - 1 -> (B, T, D)."""
        end = start + ids.shape[1]
        if end > self.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the model's max_len {self.max_len}")
        x = table(ids) * math.sqrt(self.cfg.d_model) + self.positions[start:end]  # (B, T, D)
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

    def decode_step(self, ys: Tensor, memory: Tensor, src_mask: Tensor, cache: list[tuple[KVCache, KVCache]]) -> Tensor:
        """Next-token logits (B, V) after `ys` (B, t + 1), running only position t through the decoder.

        `cache` (from `self.decoder.empty_cache`) holds positions 0 .. t - 1 of `ys` and gains position t.
        """
        t = ys.shape[1] - 1
        x = self._embed(self.tgt_embed, ys[:, t:], start=t)  # (B, 1, D)
        # Row t of `decode`'s mask: every earlier position is visible (causal), except PAD ones.
        self_mask = self.padding_mask(ys)  # (B, 1, 1, t + 1)
        h, _, _ = self.decoder(x, memory, self_mask, src_mask, cache=cache)
        return self.generator(h)[:, -1]  # (B, V)

    @torch.no_grad()
    def greedy_decode(self, src: Tensor, sos_id: int, eos_id: int, max_new_tokens: int | None = None,
                      use_cache: bool = True, check_every: int | None = None) -> Tensor:
        """Batched greedy decoding: (B, S) -> (B, <= max_new_tokens) ids after SOS, PAD after each EOS.

        With `use_cache` (the default) each step runs only the new position through the decoder, against
        the keys and values of the earlier ones (`decode_step`): O(T) decoder work instead of O(T^2). It
        gives the same tokens as `use_cache=False`, which recomputes the whole prefix at every step (the
        reference; tests/test_kv_cache.py compares them for every skip and fusion). `check_every`: how
        many tokens between reads of "has every sentence ended?" (default: 1 on the CPU, STOP_CHECK_EVERY
        elsewhere); the output is cut back to where the last sentence ended either way.
        """
        limit = min(max_new_tokens or self.max_len - 1, self.max_len - 1)
        memory, src_mask, _ = self.encode(src)
        if not use_cache:
            return self._greedy_uncached(memory, src_mask, sos_id, eos_id, limit)
        b, device = src.shape[0], src.device
        ys = torch.full((b, limit + 1), self.pad_id, dtype=torch.long, device=device)  # SOS, then the output
        ys[:, 0] = sos_id
        done = torch.zeros(b, dtype=torch.bool, device=device)
        lengths = torch.zeros(b, dtype=torch.long, device=device)  # tokens of each output, EOS included
        cache = self.decoder.empty_cache(limit)
        check_every = check_every or (1 if device.type == "cpu" else STOP_CHECK_EVERY)
        for t in range(limit):
            nxt = self.decode_step(ys[:, : t + 1], memory, src_mask, cache).argmax(dim=-1)  # (B,)
            nxt = nxt.masked_fill(done, self.pad_id)
            ys[:, t + 1] = nxt
            lengths.masked_fill_(~done, t + 1)
            done |= nxt == eos_id
            if (t + 1) % check_every == 0 and bool(done.all()):
                break
        # The step at which the last sentence ended (or the limit): the width the reference returns.
        width = int(lengths.max()) if b else 1
        return ys[:, 1 : width + 1]

    def _greedy_uncached(self, memory: Tensor, src_mask: Tensor, sos_id: int, eos_id: int, limit: int) -> Tensor:
        """The reference: each step is the argmax of a full decoder pass over the prefix."""
        b, device = memory.shape[0], memory.device
        ys = torch.full((b, 1), sos_id, dtype=torch.long, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        for _ in range(limit):
            logits, _, _ = self.decode(ys, memory, src_mask)
            nxt = logits[:, -1].argmax(dim=-1)  # (B,)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            ys = torch.cat([ys, nxt[:, None]], dim=1)
            done |= nxt == eos_id
            if bool(done.all()):
                break
        return ys[:, 1:]
