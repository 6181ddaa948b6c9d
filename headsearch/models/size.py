"""How big a model is before it exists: its exact parameter count and an estimate of the memory one
training step needs, from the `ArchConfig` alone (no tensor is allocated, so an absurd config costs
nothing to check).

The parameter count follows the modules in attention.py, transformer.py, vit.py and seq2seq.py term for
term (tests/test_size.py compares it with `sum(p.numel())` of built models). The memory estimate counts
fp32 weights, gradients and Adam's two moments (16 bytes a parameter) plus the activations autograd keeps
for one batch: per layer and token, the normalised inputs, q/k/v, the context, the MLP's hidden
layer and residuals, and per head and query-key pair the scores and probabilities. It leaves out the
allocator's slack, workspace and the soft branch's chunked temporaries, so it is a lower bound: a
config above the device's memory cannot run, one below it may still not.

The FLOPs estimate (`step_flops`) counts the floating-point operations of one training step, forward
and backward, taken as 3 x forward (backward multiplies by the weights for the inputs' gradients and by
the inputs for the weights'). The forward pass counts every matrix product at 2·m·k·n (the linear
layers, the patch embedding, each head's scores and weighted sum, the soft branch's projections and
weighted sum) and the soft branch's additive energy w^T tanh(W1 k + W2 q), whose adds and tanh run over
(Tq, Tk, d_a) per head as often as its product does (4 operations an element; 3 an element of (Tk, d_a)
for key scores). Other elementwise work is left out (biases, LayerNorms, activations, softmaxes,
residual adds, dropout, the fusion's product or sum, the scores skip): a small part of the arithmetic,
bound by memory bandwidth more than by it. A search reads the estimate to judge how much of a GPU one
trial fills; tests/test_size.py checks the forward count against torch's FLOP counter.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Sequence

from headsearch.config import ArchConfig
from headsearch.models.variants import fusion_of, skip_of

FLOAT_BYTES = 4
OPTIMIZER_BYTES_PER_PARAM = 4 * FLOAT_BYTES  # weight, gradient, Adam's first and second moments


@dataclass(frozen=True)
class Footprint:
    """A model's parameter count, the activations one training batch keeps for backward (bytes), and the
    floating-point operations of one training step on that batch (None: not estimated)."""

    params: int
    activation_bytes: int
    step_flops: int | None = None
    # The activations kept by the CUDA graphs of every batch shape a run captures, each in a private memory
    # pool (translation: one per bucket length and the partial batch); None: one shape, `activation_bytes`.
    captured_activation_bytes: int | None = None

    @property
    def training_bytes(self) -> int:
        return self.params * OPTIMIZER_BYTES_PER_PARAM + self.activation_bytes

    @property
    def captured_training_bytes(self) -> int:
        """`training_bytes` when each captured shape keeps its own graph pool (CUDA graphs, pools not shared)."""
        return self.params * OPTIMIZER_BYTES_PER_PARAM + max(self.activation_bytes, self.captured_activation_bytes or 0)

    def describe(self) -> str:
        return (f"about {gib(self.training_bytes)} to train ({self.params:,} parameters:"
                f" {gib(self.params * OPTIMIZER_BYTES_PER_PARAM)} with gradients and Adam's moments;"
                f" activations of one batch {gib(self.activation_bytes)})")


def gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:,.2f} GiB" if n_bytes >= 2**27 else f"{n_bytes / 2**20:,.1f} MiB"


# -- parameters ------------------------------------------------------------------------------

def _linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


def _layernorm(d: int) -> int:
    return 2 * d


def attention_params(arch: ArchConfig, heads: int, index: int, cross: bool = False) -> int:
    """`Attention` as `make_attention` builds it: q/k/v and output projections, the output skip's
    LayerNorm and the value residual's lambda (every layer but a stack's first), the soft branch's W1, W2
    (pairwise scores) and w, differential attention's four lambda vectors (d_k / 2 each) and RMSNorm weight."""
    d, width = arch.d_model, heads * arch.head_width(heads)
    n = _linear(d, width) + _linear(d, 2 * width) if cross else _linear(d, 3 * width)
    n += _linear(width, d)
    skip, fusion = skip_of(arch.skip), fusion_of(arch.fusion)
    if skip.carries_output and index > 0:
        n += _layernorm(width)
    if skip.carries_values and index > 0:
        n += 1
    if fusion.soft is not None:
        soft = arch.soft_dim or arch.head_width(heads)
        n += heads * arch.head_width(heads) * soft * (2 if arch.soft_score == "pairwise" else 1) + heads * soft
    if fusion.differential:
        n += 3 * arch.head_width(heads)
    return n


def stream_params(arch: ArchConfig, layers: int) -> int:
    """A stack's skip across the residual stream (models/streams.py): what its module holds for `layers` blocks."""
    stream = skip_of(arch.skip).stream
    return stream.parameter_count(layers) if stream is not None and layers else 0


def _mlp_params(arch: ArchConfig) -> int:
    return _linear(arch.d_model, arch.d_ff) + _linear(arch.d_ff, arch.d_model)


def layer_groups(heads: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """A stack's layers grouped by what a layer's size depends on: (head count, index, how many), where the
    index is 0 for the stack's first layer and 1 for the others (only the first has no output-skip norm).
    A stack of a million layers is then estimated as fast as one of four: the size guard runs before
    anything else, and must refuse an absurd depth at once."""
    if not heads:
        return
    yield heads[0], 0, 1
    yield from ((h, 1, n) for h, n in Counter(heads[1:]).items())


def encoder_params(arch: ArchConfig) -> int:
    blocks = sum(n * (2 * _layernorm(arch.d_model) + attention_params(arch, h, i) + _mlp_params(arch))
                 for h, i, n in layer_groups(arch.enc_heads))
    return blocks + stream_params(arch, len(arch.enc_heads)) + _layernorm(arch.d_model)


def decoder_params(arch: ArchConfig) -> int:
    blocks = sum(n * (3 * _layernorm(arch.d_model) + attention_params(arch, h, i) + attention_params(arch, h, i, cross=True)
                      + _mlp_params(arch)) for h, i, n in layer_groups(arch.dec_heads))
    return blocks + stream_params(arch, len(arch.dec_heads)) + _layernorm(arch.d_model)


# -- activations -----------------------------------------------------------------------------

def _layer_activations(arch: ArchConfig, heads: int, queries: int, keys: int) -> int:
    """Floats autograd keeps for one sample in one attention + MLP block."""
    d, width = arch.d_model, heads * arch.head_width(heads)
    per_token = 4 * d + 4 * width + 2 * arch.d_ff  # norms and residuals, q/k/v and context, MLP hidden (pre and post activation)
    maps = 2 if fusion_of(arch.fusion).differential else 1  # differential attention: two maps per head
    return queries * per_token + 2 * maps * heads * queries * keys  # scores and probabilities


def stack_activations(arch: ArchConfig, tokens: int, memory_tokens: int = 0) -> int:
    """Floats kept for one sample by the encoder (`tokens` long) or, with `memory_tokens`, the decoder."""
    if not memory_tokens:
        return sum(n * _layer_activations(arch, h, tokens, tokens) for h, _, n in layer_groups(arch.enc_heads))
    return sum(n * (_layer_activations(arch, h, tokens, tokens) + _layer_activations(arch, h, tokens, memory_tokens))
               for h, _, n in layer_groups(arch.dec_heads))


# -- floating-point operations ----------------------------------------------------------------

TRAINING_STEP_FACTOR = 3  # forward + backward ≈ 3 x forward: backward is a product for the inputs and one for the weights
PAIRWISE_ENERGY_FLOPS = 4  # per (query, key, a): q + k, tanh, times w, summed over a
KEY_ENERGY_FLOPS = 3  # per (key, a): tanh, times w, summed over a


def _matmul(m: int, k: int, n: int) -> int:
    """(m, k) @ (k, n): a multiply and an add per term."""
    return 2 * m * k * n


def soft_branch_flops(arch: ArchConfig, heads: int, queries: int, keys: int) -> int:
    """Forward FLOPs of one sample in `SoftAttention`: per head, W1 k_j, W2 q_i (pairwise scores), the
    additive energy w^T tanh(W1 k_j + W2 q_i) and the weighted sum alpha v."""
    d_k = arch.head_width(heads)
    d_a = arch.soft_dim or d_k
    per_head = _matmul(keys, d_k, d_a) + _matmul(queries, keys, d_k)
    if arch.soft_score == "pairwise":
        per_head += _matmul(queries, d_k, d_a) + PAIRWISE_ENERGY_FLOPS * queries * keys * d_a
    else:  # each key scored once, then the same scores serve every query
        per_head += KEY_ENERGY_FLOPS * keys * d_a
    return heads * per_head


def attention_flops(arch: ArchConfig, heads: int, queries: int, keys: int) -> int:
    """Forward FLOPs of one sample in one `Attention` layer (self-attention: `keys` == `queries`): the q, k,
    v and output projections, each head's scores q k^T and weighted sum p v, and the soft branch."""
    d, width = arch.d_model, arch.attn_dim(heads)
    n = _matmul(queries, d, width) + _matmul(keys, d, 2 * width)  # q; k and v
    n += 2 * heads * _matmul(queries, arch.head_width(heads), keys)  # scores, then weighted sum
    n += _matmul(queries, width, d)  # W_o
    fusion = fusion_of(arch.fusion)
    if fusion.soft is not None:
        n += soft_branch_flops(arch, heads, queries, keys)
    if fusion.differential:  # two half-width score maps cost one full one; a second weighted sum
        n += heads * _matmul(queries, keys, arch.head_width(heads))
    return n


def _mlp_flops(arch: ArchConfig, tokens: int) -> int:
    return 2 * _matmul(tokens, arch.d_model, arch.d_ff)


def stream_flops(arch: ArchConfig, layers: int, tokens: int) -> int:
    """Forward FLOPs of one sample in a stack's skip across the residual stream (models/streams.py)."""
    stream = skip_of(arch.skip).stream
    return stream.forward_flops(layers, tokens, arch.d_model) if stream is not None and layers else 0


def stack_flops(arch: ArchConfig, tokens: int, memory_tokens: int = 0) -> int:
    """Forward FLOPs of one sample in the encoder (`tokens` long) or, with `memory_tokens`, the decoder
    (self-attention over its `tokens`, cross-attention to the encoder's `memory_tokens`)."""
    if not memory_tokens:
        return sum(n * (attention_flops(arch, h, tokens, tokens) + _mlp_flops(arch, tokens))
                   for h, _, n in layer_groups(arch.enc_heads)) + stream_flops(arch, len(arch.enc_heads), tokens)
    return sum(n * (attention_flops(arch, h, tokens, tokens) + attention_flops(arch, h, tokens, memory_tokens)
                    + _mlp_flops(arch, tokens)) for h, _, n in layer_groups(arch.dec_heads)) + stream_flops(
        arch, len(arch.dec_heads), tokens)


def vit_step_flops(arch: ArchConfig, batch: int, image_size: int = 32, in_chans: int = 3, num_classes: int = 10) -> int:
    """FLOPs of one training step of `ViT(arch, image_size, in_chans, num_classes)` on `batch` images."""
    patches = (image_size // arch.patch_size) ** 2
    forward = (_matmul(patches, in_chans * arch.patch_size**2, arch.d_model)  # the patch embedding (a strided conv)
               + stack_flops(arch, patches + 1)  # patches and the class token
               + _matmul(1, arch.d_model, num_classes))  # the head reads the class token alone
    return TRAINING_STEP_FACTOR * batch * forward


def seq2seq_step_flops(arch: ArchConfig, batch: int, src_len: int, tgt_len: int, tgt_vocab: int) -> int:
    """FLOPs of one training step of `Seq2Seq(arch, ...)` on `batch` pairs of `src_len` source and `tgt_len`
    target tokens (embedding lookups cost none; the generator projects every target position)."""
    forward = (stack_flops(arch, src_len) + stack_flops(arch, tgt_len, memory_tokens=src_len)
               + _matmul(tgt_len, arch.d_model, tgt_vocab))
    return TRAINING_STEP_FACTOR * batch * forward


# -- the two models --------------------------------------------------------------------------

def vit_footprint(arch: ArchConfig, batch: int, image_size: int = 32, in_chans: int = 3, num_classes: int = 10) -> Footprint:
    """`ViT(arch, image_size, in_chans, num_classes)` trained on batches of `batch` images."""
    tokens = (image_size // arch.patch_size) ** 2 + 1
    params = (in_chans * arch.patch_size**2 * arch.d_model + arch.d_model  # patch embedding (a strided conv)
              + arch.d_model * (tokens + 1)  # class token and positions
              + encoder_params(arch) + _linear(arch.d_model, num_classes))
    floats = batch * (stack_activations(arch, tokens) + tokens * arch.d_model)
    return Footprint(params, floats * FLOAT_BYTES, vit_step_flops(arch, batch, image_size, in_chans, num_classes))


def seq2seq_footprint(arch: ArchConfig, batch: int, src_vocab: int, tgt_vocab: int, max_len: int) -> Footprint:
    """`Seq2Seq(arch, src_vocab, tgt_vocab, max_len, ...)` on batches of `batch` pairs of at most `max_len` tokens."""
    params = ((src_vocab + tgt_vocab) * arch.d_model + encoder_params(arch) + decoder_params(arch)
              + _linear(arch.d_model, tgt_vocab))
    floats = batch * (stack_activations(arch, max_len) + stack_activations(arch, max_len, memory_tokens=max_len)
                      + 2 * max_len * tgt_vocab)  # logits and their softmax
    return Footprint(params, floats * FLOAT_BYTES, seq2seq_step_flops(arch, batch, max_len, max_len, tgt_vocab))
