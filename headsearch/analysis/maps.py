"""Where the heads look: an image model's class-token attention over the patch grid and its attention
rollout, derived from the `PatchAttention` views a task returns; for fusion models the soft-attention
weights beside the self-attention weights (as the HAM paper's Fig. 4 shows, Martínez-Marín et al.).
Token-to-token views (`TokenAttention`, e.g. translation cross-attention) are drawn as they come."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from headsearch.tasks import PatchAttention


@dataclass
class VitMaps:
    images: np.ndarray  # (N, 32, 32, 3) uint8, as stored
    labels: list[str]
    predictions: list[str]
    cls_attention: list[np.ndarray]  # per layer (N, H, g, g): the CLS query's weights over the patch grid
    soft_attention: list[np.ndarray | None]  # per layer (N, H, g, g) soft-branch weights, None without fusion
    rollout: np.ndarray  # (N, g, g) attention rollout (Abnar & Zuidema 2020) from the CLS token


def attention_rollout(weights: list[torch.Tensor]) -> torch.Tensor:
    """Abnar & Zuidema 2020 ("Quantifying Attention Flow in Transformers", arXiv:2005.00928):
    average the heads, add the identity for the residual path, renormalise rows, multiply over layers.
    weights: per layer (N, H, T, T) -> (N, T, T)."""
    n, _, t, _ = weights[0].shape
    eye = torch.eye(t).expand(n, t, t)
    out = eye.clone()
    for w in weights:
        a = w.float().mean(dim=1) + eye  # (N, T, T)
        a = a / a.sum(dim=-1, keepdim=True)
        out = a @ out
    return out


def patch_maps(view: PatchAttention) -> VitMaps:
    """The class token's (token 0) attention over the grid, per layer and head, and the rollout from it."""
    g = view.grid
    to_grid = lambda w: w[:, :, 0, 1:].reshape(w.shape[0], w.shape[1], g, g).float().numpy()  # noqa: E731
    rollout = attention_rollout(view.weights)[:, 0, 1:].reshape(-1, g, g).numpy()
    return VitMaps(
        images=view.images,
        labels=view.labels,
        predictions=view.predictions,
        cls_attention=[to_grid(w) for w in view.weights],
        soft_attention=[to_grid(w) if w is not None else None for w in view.soft],
        rollout=rollout,
    )
