"""Vision Transformer (Dosovitskiy et al. 2021, arXiv:2010.11929) for small images.

Defaults follow the ViT of Martínez-Marín et al. (HAM; docs/design.md §4.1): 32x32 CIFAR-10 in 4x4
patches (64 tokens + CLS), embed 48, 4 pre-LN layers, MLP 192, GELU, truncated-normal init with
std 0.02, classification from the CLS token.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from headsearch.config import ArchConfig
from headsearch.models.checks import check_vit_arch
from headsearch.models.transformer import Encoder, LayerWeights


class ViT(nn.Module):
    def __init__(self, cfg: ArchConfig, image_size: int = 32, in_chans: int = 3, num_classes: int = 10):
        super().__init__()
        check_vit_arch(cfg, image_size)
        self.cfg = cfg
        n_patches = (image_size // cfg.patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_chans, cfg.d_model, cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        self.pos_embed = nn.Parameter(torch.zeros(1, n_patches + 1, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)
        self.encoder = Encoder(cfg)
        self.head = nn.Linear(cfg.d_model, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, images: Tensor, need_weights: bool = False) -> Tensor | tuple[Tensor, list[LayerWeights]]:
        """images: (B, C, H, W) normalised floats -> logits (B, classes) [, per-layer attention weights]."""
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, N, D)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (B, 1, D)
        x = self.drop(torch.cat([cls, x], dim=1) + self.pos_embed)  # (B, N + 1, D)
        x, weights = self.encoder(x, need_weights=need_weights)
        logits = self.head(x[:, 0])  # (B, classes)
        return (logits, weights) if need_weights else logits
