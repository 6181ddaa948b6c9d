"""The attention variants, by name: one table of fusions and one of skips, read by both attention cores.

`attention.Attention` (one model), the stacks of `transformer.py` and `cohort.StackedViT` (K models batched
into one product) look an `ArchConfig`'s `fusion` and `skip` up here once, when they are built, and from
then on ask the record what to do instead of comparing names. A name missing from a table fails at
construction with the names it knows, instead of computing silently as some other variant. A row the
cohort's batched core does not implement says so (`stacks`), and such a trial trains alone.

`config.FUSIONS` and `config.SKIPS` list the same names for validation: config.py is the core layer and
must not import torch, so the names live twice, and tests/test_attention.py checks the two lists agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch import Tensor, nn

from headsearch.errors import ConfigError

Fuse = Callable[["Tensor", "Tensor"], "Tensor"]


def hadamard(heads: Tensor, soft: Tensor) -> Tensor:
    """HAM A (Martínez-Marín et al.; docs/design.md §3): O = SA ⊙ SoftA, inside each head."""
    return heads * soft  # (B, H, Tq, d_k) self-attention SA and soft attention SoftA -> (B, H, Tq, d_k)


def add(heads: Tensor, soft: Tensor) -> Tensor:
    """HAM B (Martínez-Marín et al.; docs/design.md §3): O = SA + SoftA, inside each head."""
    return heads + soft  # (B, H, Tq, d_k) each -> (B, H, Tq, d_k)


@dataclass(frozen=True)
class Fusion:
    """How each head's self-attention is composed (docs/design.md §3, §3.1): alone, fused with a soft branch
    (HAM), or as the difference of two softmax maps (DIFF Transformer). At most one of `soft` and
    `differential`; neither is the classic attention O = SA, with no parameters of its own."""

    name: str
    # fuse(heads, soft), applied before the head mask, the concatenation and W_o; None: no soft branch
    soft: Fuse | None = None
    # each head's map softmax(q1 k1^T) - lambda softmax(q2 k2^T) over the halves of its queries and keys
    differential: bool = False
    stacks: bool = True  # whether the cohort's batched core (models/cohort.py) implements it


FUSIONS: dict[str, Fusion] = {
    "none": Fusion("none"),
    "hadamard": Fusion("hadamard", soft=hadamard),  # HAM A
    "add": Fusion("add", soft=add),  # HAM B
    "differential": Fusion("differential", differential=True, stacks=False),  # Ye et al. 2024
}


@dataclass(frozen=True)
class Stream:
    """A skip across the residual stream: the module a stack threads its blocks through (models/streams.py,
    imported only when a model is built: looking names up here must not import torch, as a light worker does)
    and its size for models/size.py: parameters for L blocks, forward FLOPs for (L, tokens, width)."""

    module: str  # its class in models/streams.py
    parameter_count: Callable[[int], int]
    forward_flops: Callable[[int, int, int], int]

    def build(self, layers: int) -> "nn.Module":
        from headsearch.models import streams

        return getattr(streams, self.module)(layers)


# U-net: a weight per pair of blocks; the scaled adds are elementwise, left out of the FLOPs as residual adds are
UNET = Stream("UNetStream", lambda layers: layers // 2, lambda layers, tokens, width: 0)


def _dense_weights(layers: int) -> int:
    """DenseFormer's weights: block i averages i + 2 tensors, so the sum of (i + 2) over i = 0 .. L-1."""
    return layers * (layers + 3) // 2


# DenseFormer: each weight scales one (T, D) tensor in its block's (1, i + 2) @ (i + 2, T·D) product: 2 T D FLOPs
DENSE = Stream("DenseStream", _dense_weights, lambda layers, tokens, width: 2 * _dense_weights(layers) * tokens * width)


@dataclass(frozen=True)
class Skip:
    """What a skip carries from one attention layer to the next of its stack (docs/design.md §2), or how it
    connects the stack's blocks across the residual stream.

    At most one of the `carries_*` is true, and none with a `stream`. A layer whose skip carries something
    emits it; every layer but a stack's first also receives the previous layer's (`carries_values`: the
    stack's first layer's values, passed on unchanged). `skip_mean` (a running mean instead of a running
    sum) applies to the scores a skip carries. `stream.build(layers)` builds the module a stack threads its
    blocks' outputs through (`streams.py`).
    """

    name: str
    carries_scores: bool = False  # pre-softmax scores (B, H, Tq, Tk), added to the next layer's (RealFormer, He et al. 2020)
    carries_output: bool = False  # merged head outputs (B, T, H·d_k), added and layer-normalised (Deep Head, Cruz et al.)
    carries_values: bool = False  # the first layer's values (B, Tk, H·d_k), mixed into each later layer's (ResFormer)
    stream: Stream | None = None  # block outputs mixed across the stack (U-net, DenseFormer)
    stacks: bool = True  # whether the cohort's batched core (models/cohort.py) implements it

    @property
    def carries(self) -> bool:
        """Whether there is a skip between attention layers: something to emit and, after a stack's first
        layer, to receive."""
        return self.carries_scores or self.carries_output or self.carries_values


SKIPS: dict[str, Skip] = {
    "none": Skip("none"),
    "output": Skip("output", carries_output=True),
    "scores": Skip("scores", carries_scores=True),
    "value": Skip("value", carries_values=True, stacks=False),  # value residual learning, Zhou et al. 2024
    "unet": Skip("unet", stream=UNET, stacks=False),  # layer i's output to layer L-1-i's input
    "dense": Skip("dense", stream=DENSE, stacks=False),  # depth-weighted averages, Pagliardini et al. 2024
}


def fusion_of(name: str) -> Fusion:
    """The fusion named `name`; a ConfigError, one line, for a name not in FUSIONS."""
    return _look_up("fusion", name, FUSIONS)


def skip_of(name: str) -> Skip:
    """The skip named `name`; a ConfigError, one line, for a name not in SKIPS."""
    return _look_up("skip", name, SKIPS)


def _look_up(kind: str, name: str, table: dict):
    if name not in table:
        raise ConfigError(f"{kind} = {name!r} is not known to the attention cores (headsearch/models/variants.py):"
                          f" use one of {', '.join(table)}")
    return table[name]
