"""Skips across the residual stream: connections between a stack's blocks rather than its attention layers.

A stack (`transformer.Encoder`, `transformer.Decoder`) built with such a skip (`variants.Skip.stream`)
threads its blocks through one of these modules:

    memory = stream.start(x)                      # x: the stack's input (B, T, D)
    for i, block in enumerate(blocks):
        x = block(stream.before(i, x, memory))
        x = stream.after(i, x, memory)

Everything is per position, so incremental decoding (a key/value cache, one new position a call) computes
exactly the rows of a full pass. Both start as the plain stack: a U-net skip's weights are learned from
one (modded-nanogpt's start), a DenseFormer's averages from the identity (the paper's).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


class UNetStream(nn.Module):
    """U-net skips across the stack: block i's output, times a learned weight w_i, is added to the input of block
    L-1-i for every i < L-1-i (docs/design.md §2.4). The long skips of U-ViT (Bao et al. 2023, "All are Worth
    Words: A ViT Backbone for Diffusion Models") and of the modded-nanogpt speed records (Jordan et al. 2024).

        in_{L-1-i} = out_{L-2-i} + w_i · out_i        (i = 0 .. floor(L/2) - 1)
    """

    def __init__(self, layers: int):
        super().__init__()
        self.layers = layers
        self.weights = nn.Parameter(torch.ones(layers // 2))  # w_i, one per pair of blocks

    def start(self, x: Tensor) -> list[Tensor]:
        return []  # the first half's outputs, in order

    def before(self, i: int, x: Tensor, memory: list[Tensor]) -> Tensor:
        sender = self.layers - 1 - i
        if sender < i:  # block i receives block `sender`'s output
            return x + self.weights[sender] * memory[sender]  # (B, T, D)
        return x

    def after(self, i: int, x: Tensor, memory: list[Tensor]) -> Tensor:
        if i < self.layers - 1 - i:
            memory.append(x)
        return x


class DenseStream(nn.Module):
    """Depth-weighted averages (DenseFormer; Pagliardini et al. 2024, "DenseFormer: Enhancing Information Flow in
    Transformers via Depth Weighted Averaging", arXiv:2402.02622; docs/design.md §2.5): after block i, the
    stream becomes a learned average of the stack's input X_0 and every block output so far,

        Y_i = sum_{j=0}^{i+1} alpha_{i,j} X_j        (X_{j+1} = block_j(Y_{j-1}), Y_{-1} = X_0)

    with alpha_{i,i+1} = 1 and the rest 0 at the start: the plain stack.
    """

    def __init__(self, layers: int):
        super().__init__()
        self.alphas = nn.ParameterList(nn.Parameter(_last_one_hot(i + 2)) for i in range(layers))

    def start(self, x: Tensor) -> list[Tensor]:
        return [x]  # X_0, then each block's output

    def before(self, i: int, x: Tensor, memory: list[Tensor]) -> Tensor:
        return x

    def after(self, i: int, x: Tensor, memory: list[Tensor]) -> Tensor:
        memory.append(x)
        alpha = self.alphas[i]  # (i + 2,)
        return torch.einsum("j,j...->...", alpha.to(x.dtype), torch.stack(memory))  # (B, T, D)


def _last_one_hot(n: int) -> Tensor:
    """(0, ..., 0, 1) of length n: the average that keeps only the newest block's output."""
    alpha = torch.zeros(n)
    alpha[-1] = 1.0
    return alpha
