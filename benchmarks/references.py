"""Reference models built from PyTorch's own transformer layers, with headsearch's sizes.

They are what the throughput benchmark compares against: the same patch embedding, tokens, widths,
depth, activation, dropout and pre-LN placement as headsearch's ViT and Seq2Seq, but attention and
blocks from `nn.TransformerEncoderLayer` / `nn.Transformer`. `tests/test_benchmarks.py` checks that
each has exactly as many parameters as the headsearch model it stands in for.
"""
from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor, nn

from headsearch.config import ArchConfig
from headsearch.models.seq2seq import sinusoidal_positions


def _encoder_layers(cfg: ArchConfig, heads: tuple[int, ...]) -> nn.ModuleList:
    # One nn.TransformerEncoderLayer per layer, so a per-layer head schedule has a reference too.
    return nn.ModuleList(
        nn.TransformerEncoderLayer(cfg.d_model, h, cfg.d_ff, cfg.dropout, activation=cfg.activation,
                                   batch_first=True, norm_first=True)
        for h in heads
    )


class ReferenceViT(nn.Module):
    """The ViT of headsearch.models.ViT with PyTorch's encoder layers (classic attention only)."""

    def __init__(self, cfg: ArchConfig, image_size: int = 32, in_chans: int = 3, num_classes: int = 10):
        super().__init__()
        n_patches = (image_size // cfg.patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_chans, cfg.d_model, cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        self.pos_embed = nn.Parameter(torch.zeros(1, n_patches + 1, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = _encoder_layers(cfg, cfg.enc_heads)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, N, D)
        x = self.drop(torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)[:, 0])  # (B, classes)


class ReferenceSeq2Seq(nn.Module):
    """headsearch.models.Seq2Seq with `nn.Transformer` (uniform heads, classic attention)."""

    def __init__(self, cfg: ArchConfig, src_vocab: int, tgt_vocab: int, max_len: int, pad_id: int):
        super().__init__()
        if len(set(cfg.enc_heads)) != 1 or len(set(cfg.dec_heads)) != 1 or cfg.enc_heads[0] != cfg.dec_heads[0]:
            raise ValueError("nn.Transformer has one head count: the reference needs uniform, equal enc/dec heads")
        self.d_model, self.pad_id = cfg.d_model, pad_id
        self.src_embed = nn.Embedding(src_vocab, cfg.d_model)
        self.tgt_embed = nn.Embedding(tgt_vocab, cfg.d_model)
        self.register_buffer("positions", sinusoidal_positions(max_len, cfg.d_model), persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        with warnings.catch_warnings():  # "nested tensors are off with norm_first": known, and irrelevant to training
            warnings.simplefilter("ignore", UserWarning)
            self.transformer = nn.Transformer(
                cfg.d_model, cfg.enc_heads[0], cfg.enc_layers, cfg.dec_layers, cfg.d_ff, cfg.dropout,
                activation=cfg.activation, batch_first=True, norm_first=True,
            )
        self.generator = nn.Linear(cfg.d_model, tgt_vocab)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def _embed(self, table: nn.Embedding, ids: Tensor) -> Tensor:
        return self.drop(table(ids) * math.sqrt(self.d_model) + self.positions[: ids.shape[1]])

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        src_pad, tgt_pad = src == self.pad_id, tgt_in == self.pad_id  # True where padding (PyTorch's convention)
        t = tgt_in.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=src.device).triu(1)  # True above the diagonal: masked
        x = self.transformer(
            self._embed(self.src_embed, src), self._embed(self.tgt_embed, tgt_in),
            tgt_mask=causal, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad, tgt_is_causal=True,
        )
        return self.generator(x)  # (B, T, V)
