"""Models: one attention module with options (attention.py), blocks and stacks (transformer.py),
and the two models built from an ArchConfig: the ViT and the encoder-decoder Transformer."""
from headsearch.models.attention import Attention, AttentionOutput, SoftAttention, map_score_heads
from headsearch.models.seq2seq import Seq2Seq
from headsearch.models.transformer import attention_layers
from headsearch.models.vit import ViT

__all__ = ["Attention", "AttentionOutput", "SoftAttention", "map_score_heads", "Seq2Seq", "ViT", "attention_layers"]
