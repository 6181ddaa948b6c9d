"""Where the heads look: ViT CLS-token attention over the patch grid, attention rollout, and
translation cross-attention; for fusion models the soft-attention weights beside the self-attention
weights (seed 001, Fig. 4)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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


@torch.no_grad()
def vit_maps(model, bound, samples: int = 4, split: str = "test") -> VitMaps:
    model.eval()
    images = getattr(bound, split)
    x, y = images.x[:samples], images.y[:samples]  # uint8 (N, 3, 32, 32), (N,)
    logits, weights = model(bound.augment.normalize(x), need_weights=True)
    grid = int(round((weights[0].self_attn.shape[-1] - 1) ** 0.5))
    to_grid = lambda w: w[:, :, 0, 1:].reshape(w.shape[0], w.shape[1], grid, grid).float().cpu().numpy()  # noqa: E731
    rollout = attention_rollout([w.self_attn.cpu() for w in weights])[:, 0, 1:].reshape(-1, grid, grid).numpy()
    names = bound.label_names
    return VitMaps(
        images=x.permute(0, 2, 3, 1).cpu().numpy(),
        labels=[names[i] for i in y.tolist()],
        predictions=[names[i] for i in logits.argmax(-1).tolist()],
        cls_attention=[to_grid(w.self_attn) for w in weights],
        soft_attention=[to_grid(w.soft) if w.soft is not None else None for w in weights],
        rollout=rollout,
    )


@dataclass
class CrossAttentionMap:
    source_tokens: list[str]
    output_tokens: list[str]
    layers: list[np.ndarray]  # per decoder layer (H, T_out, T_src)


@torch.no_grad()
def translation_maps(model, bound, samples: int = 3, split: str = "test") -> list[CrossAttentionMap]:
    """Cross-attention while the model produces its own (greedy) translation of a few sentences."""
    td = bound.td
    model.eval()
    out = []
    data = bound.eval_sets[split]
    for src_ids in data["src"][:samples]:
        src = torch.tensor([src_ids + [td.EOS_ID]], device=bound.device)
        hyp = model.greedy_decode(src, td.SOS_ID, td.EOS_ID, max_new_tokens=min(bound.max_len - 1, 2 * src.shape[1] + 10))[0]
        hyp = [t for t in hyp.tolist() if t != td.PAD_ID]
        tgt_in = torch.tensor([[td.SOS_ID] + hyp[:-1] if hyp and hyp[-1] == td.EOS_ID else [td.SOS_ID] + hyp], device=bound.device)
        _, weights = model(src, tgt_in, need_weights=True)
        out_tokens = [bound.tgt_tok.id_to_token(i) or "[UNK]" for i in (hyp if hyp else [td.EOS_ID])][: tgt_in.shape[1]]
        out.append(CrossAttentionMap(
            source_tokens=[bound.src_tok.id_to_token(i) or "[UNK]" for i in src[0].tolist()],
            output_tokens=out_tokens,
            layers=[w.self_attn[0].float().cpu().numpy() for w in weights["decoder_cross"]],
        ))
    return out
