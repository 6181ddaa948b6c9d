"""Models: one attention module with options (attention.py), blocks and stacks (transformer.py),
and the two models built from an ArchConfig: the ViT and the encoder-decoder Transformer."""
import importlib

# Imported when first named (PEP 562): the models import torch, and importing one of this package's torch-free
# modules (`checks`, `size`, `variants`) must not load it (a light worker, headsearch.search.light).
_HOMES = {"Attention": "attention", "AttentionOutput": "attention", "SoftAttention": "attention",
          "map_score_heads": "attention", "Seq2Seq": "seq2seq", "attention_layers": "transformer", "ViT": "vit"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = ["Attention", "AttentionOutput", "SoftAttention", "map_score_heads", "Seq2Seq", "ViT", "attention_layers"]
