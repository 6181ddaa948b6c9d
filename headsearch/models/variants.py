"""The attention variants, by name: one table of fusions and one of skips, read by both attention cores.

`attention.Attention` (one model) and `cohort.StackedViT` (K models batched into one product) look an
`ArchConfig`'s `fusion` and `skip` up here once, when they are built, and from then on ask the record
what to do instead of comparing names. A name missing from a table fails at construction with the
names it knows, instead of computing silently as some other variant.

`config.FUSIONS` and `config.SKIPS` list the same names for validation: config.py is the core layer and
must not import torch, so the names live twice, and tests/test_attention.py checks the two lists agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch import Tensor

from headsearch.errors import ConfigError

Fuse = Callable[["Tensor", "Tensor"], "Tensor"]


def hadamard(heads: Tensor, soft: Tensor) -> Tensor:
    """HAM A (Martínez-Marín et al.; docs/design.md §3): O = SA ⊙ SoftA, inside each head."""
    return heads * soft  # (B, H, Tq, d_k) self-attention SA and soft attention SoftA -> (B, H, Tq, d_k)


def add(heads: Tensor, soft: Tensor) -> Tensor:
    """HAM B (Martínez-Marín et al.; docs/design.md §3): O = SA + SoftA, inside each head."""
    return heads + soft  # (B, H, Tq, d_k) each -> (B, H, Tq, d_k)


# fusion name -> fuse(heads, soft), applied before the head mask, the concatenation and W_o; None: no
# soft branch at all (O = SA, the HAM paper's classic ViT), so the model has no soft-branch parameters.
FUSIONS: dict[str, Fuse | None] = {
    "none": None,
    "hadamard": hadamard,  # HAM A
    "add": add,  # HAM B
}


@dataclass(frozen=True)
class Skip:
    """What a skip carries from one attention layer to the next of its stack (docs/design.md §2).

    At most one is true. A layer whose skip carries something emits it; every layer but a stack's first
    also receives the previous layer's. `skip_mean` (a running mean instead of a running sum) applies to
    the scores a skip carries.
    """

    name: str
    carries_scores: bool = False  # pre-softmax scores (B, H, Tq, Tk), added to the next layer's (RealFormer, He et al. 2020)
    carries_output: bool = False  # merged head outputs (B, T, H·d_k), added and layer-normalised (Deep Head, Cruz et al.)

    @property
    def carries(self) -> bool:
        """Whether there is a skip at all: something to emit and, after a stack's first layer, to receive."""
        return self.carries_scores or self.carries_output


SKIPS: dict[str, Skip] = {
    "none": Skip("none"),
    "output": Skip("output", carries_output=True),
    "scores": Skip("scores", carries_scores=True),
}


def fusion_of(name: str) -> Fuse | None:
    """The fuse function named `name` (None for "none"); a ConfigError, one line, for a name not in FUSIONS."""
    return _look_up("fusion", name, FUSIONS)


def skip_of(name: str) -> Skip:
    """The skip named `name`; a ConfigError, one line, for a name not in SKIPS."""
    return _look_up("skip", name, SKIPS)


def _look_up(kind: str, name: str, table: dict):
    if name not in table:
        raise ConfigError(f"{kind} = {name!r} is not known to the attention cores (headsearch/models/variants.py):"
                          f" use one of {', '.join(table)}")
    return table[name]
