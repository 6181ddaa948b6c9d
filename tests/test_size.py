"""The size guard's arithmetic (headsearch.models.size): the parameter count it gives before a model
exists is exactly what the built model holds, the guard turns an absurd architecture into one line
with the estimate, before anything is created, and the FLOPs of a training step are counted by hand
and against torch's FLOP counter."""
from __future__ import annotations

import pytest
import torch

from headsearch.config import ArchConfig
from headsearch.models import Seq2Seq, ViT
from headsearch.models.size import (
    FLOAT_BYTES,
    KEY_ENERGY_FLOPS,
    PAIRWISE_ENERGY_FLOPS,
    Footprint,
    seq2seq_footprint,
    seq2seq_step_flops,
    vit_footprint,
    vit_step_flops,
)

# make test-oldest runs this module on the floor: torch's FLOP counter.
pytestmark = pytest.mark.floor

VIT_ARCHS = {
    "HAM's reference ViT": dict(),
    "halving heads, output skip": dict(enc_heads=[8, 4, 2, 1], skip="output"),
    "HAM A, scores skip": dict(fusion="hadamard", skip="scores"),
    "HAM B, key scores, fixed head width, 8x8 patches": dict(fusion="add", soft_score="key", soft_dim=5, head_dim=16, patch_size=8),
    "two layers, wider MLP": dict(d_model=64, enc_layers=2, enc_heads=[2, 4], d_ff=100, skip="output", fusion="add"),
    "value residual, halving heads": dict(enc_heads=[8, 4, 2, 1], skip="value"),
    "U-net skips, 5 layers": dict(enc_layers=5, enc_heads=4, skip="unet"),
    "DenseFormer, differential attention": dict(enc_heads=[4, 2, 2, 6], skip="dense", fusion="differential"),
}


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("fields", VIT_ARCHS.values(), ids=VIT_ARCHS.keys())
def test_vit_parameter_count_is_exact(fields):
    arch = ArchConfig(**fields)
    assert vit_footprint(arch, batch=1).params == n_params(ViT(arch))


SEQ2SEQ_ARCHS = {
    "output skip, HAM A": dict(d_model=32, enc_layers=2, dec_layers=2, dec_heads=[2, 4], d_ff=64, skip="output", fusion="hadamard"),
    "scores skip, HAM B": dict(d_model=48, enc_layers=3, enc_heads=[6, 3, 1], dec_layers=1, dec_heads=2, d_ff=96,
                               skip="scores", fusion="add", soft_score="key"),
    "value skip, differential": dict(d_model=32, enc_layers=2, enc_heads=[2, 4], dec_layers=3, dec_heads=[4, 2, 2], d_ff=64,
                                     skip="value", fusion="differential"),
    "U-net skips, HAM B": dict(d_model=48, enc_layers=3, enc_heads=[6, 3, 1], dec_layers=2, dec_heads=2, d_ff=96,
                               skip="unet", fusion="add"),
    "DenseFormer": dict(d_model=32, enc_layers=2, dec_layers=3, dec_heads=[2, 4, 8], d_ff=64, skip="dense"),
}


@pytest.mark.parametrize("fields", SEQ2SEQ_ARCHS.values(), ids=SEQ2SEQ_ARCHS.keys())
def test_seq2seq_parameter_count_is_exact(fields):
    arch = ArchConfig(**fields)
    assert seq2seq_footprint(arch, batch=1, src_vocab=100, tgt_vocab=120, max_len=16).params == n_params(Seq2Seq(arch, 100, 120, 16, 0))


def test_activations_by_hand_for_one_layer():
    # One layer, d=8, 2 heads of 4 (width 8), d_ff 16, 4x4 patches of a 32-pixel image: 65 tokens.
    arch = ArchConfig(d_model=8, enc_layers=1, enc_heads=2, d_ff=16, patch_size=4)
    t = 65
    per_layer = t * (4 * 8 + 4 * 8 + 2 * 16) + 2 * 2 * t * t  # tokens x (norms, q/k/v + context, MLP) + scores and probabilities
    embedded = t * 8
    fp = vit_footprint(arch, batch=3)
    assert fp.activation_bytes == 3 * (per_layer + embedded) * FLOAT_BYTES
    assert fp.training_bytes == fp.params * 16 + fp.activation_bytes


def test_footprint_describes_itself_in_readable_units():
    text = Footprint(params=1_000_000, activation_bytes=3 * 2**30).describe()
    assert "1,000,000 parameters" in text and "15.3 MiB" in text and "3.00 GiB" in text


def test_an_absurd_architecture_is_refused_with_the_estimate_before_anything_exists(cli, tmp_path, cifar_dir, write_yaml):
    config = write_yaml(tmp_path / "big.yaml", {"d_model": 1_000_000, "enc_heads": 4})
    out = tmp_path / "run"
    result = cli(["train", "--task", "vit-cifar10", "--config", config, "--data-dir", cifar_dir, "--out", out, "--device", "cpu"])
    line = cli.error_line(result, "this architecture needs about", "parameters", "GiB", "but cpu has", "lower d_model")
    assert "16,001,699,000,778 parameters" in line  # the exact count for this config (test above: exact)
    assert not out.exists()


def test_a_search_rejects_a_sampled_architecture_too_big_for_the_device(tmp_path, cifar_dir, write_yaml):
    """The base config fits, so the search starts; a sampled d_model that cannot fit is rejected (never
    trained) with the guard's message, like any invalid combination."""
    import optuna

    from headsearch.errors import ConfigError
    from headsearch.search.runner import Search, SearchSettings
    from headsearch.training.runtime import resolve_device

    space = write_yaml(tmp_path / "space.yaml", {"schedule": {"heads": [4]}, "ranges": {"d_model": [48, 4_000_000]}})
    search = Search(SearchSettings(task="vit-cifar10", space=str(space), preset="tiny", data_dir=str(cifar_dir),
                                   device="cpu", run_root=str(tmp_path / "runs")))
    trial = optuna.trial.FixedTrial({"d_model": 4_000_000, "schedule": "uniform", "heads": 4, "skip": "none", "fusion": "none"})
    with pytest.raises(ConfigError, match="this architecture needs about"):
        search.archs.sample_config(trial, resolve_device("cpu"))
    small = optuna.trial.FixedTrial({"d_model": 48, "schedule": "uniform", "heads": 4, "skip": "none", "fusion": "none"})
    assert search.archs.sample_config(small, resolve_device("cpu")).arch.d_model == 48


# -- FLOPs of a training step ---------------------------------------------------------------------------

# One layer, d=8, 2 heads of 4, d_ff 16: a 4x4 image of 3 channels in 2x2 patches is 4 patches + CLS = 5 tokens.
TINY = dict(d_model=8, enc_layers=1, enc_heads=2, d_ff=16, patch_size=2)


def tiny_vit_flops(**fields) -> int:
    return vit_step_flops(ArchConfig(**{**TINY, **fields}), batch=2, image_size=4, in_chans=3, num_classes=10)


def test_vit_step_flops_by_hand():
    t = 5
    patch_embedding = 2 * 4 * (3 * 2 * 2) * 8  # 4 patches x (3 channels x 2x2 pixels) -> 8
    qkv = 2 * t * 8 * (3 * 8)
    scores = 2 * (2 * t * 4 * t)  # 2 heads: (t x 4) @ (4 x t)
    weighted_sum = 2 * (2 * t * t * 4)  # 2 heads: (t x t) @ (t x 4)
    out_proj = 2 * t * 8 * 8
    mlp = 2 * t * 8 * 16 + 2 * t * 16 * 8
    head = 2 * 1 * 8 * 10  # the class token alone
    forward = patch_embedding + qkv + scores + weighted_sum + out_proj + mlp + head
    assert forward == 6848
    assert tiny_vit_flops() == 3 * 2 * forward  # forward + backward, batch of 2

    # The soft branch, d_a = d_k = 4, per head: W1 k, W2 q, energy over (query, key, a), alpha v.
    pairwise = 2 * (2 * t * 4 * 4 + 2 * t * 4 * 4 + PAIRWISE_ENERGY_FLOPS * t * t * 4 + 2 * t * t * 4)
    assert pairwise == 2 * (160 + 160 + 400 + 200)
    assert tiny_vit_flops(fusion="hadamard") == 3 * 2 * (forward + pairwise)
    key_only = 2 * (2 * t * 4 * 4 + KEY_ENERGY_FLOPS * t * 4 + 2 * t * t * 4)  # no W2 q; energy over (key, a)
    assert tiny_vit_flops(fusion="add", soft_score="key") == 3 * 2 * (forward + key_only)
    assert tiny_vit_flops(skip="scores") == tiny_vit_flops(skip="output") == tiny_vit_flops()  # elementwise: not counted
    assert tiny_vit_flops(skip="value") == tiny_vit_flops(skip="unet") == tiny_vit_flops()
    assert tiny_vit_flops(skip="dense") == tiny_vit_flops() + 3 * 2 * (2 * 2 * t * 8)  # one average of 2 (1 layer)

    # Differential attention: per head two maps over halves of width 2 (as many products as one map of width 4),
    # then each map's weighted sum of v (width 4): one weighted sum more.
    half_maps = 2 * (2 * (2 * t * 2 * t))
    assert half_maps == scores
    assert tiny_vit_flops(fusion="differential") == 3 * 2 * (forward + weighted_sum)


def test_seq2seq_step_flops_by_hand():
    # One encoder and one decoder layer, d=8, 2 heads of 4, d_ff 16, batch 2: 4 source tokens, 3 target tokens, 10 words.
    arch = ArchConfig(d_model=8, enc_layers=1, enc_heads=2, dec_layers=1, dec_heads=2, d_ff=16)
    s, t = 4, 3

    def attention(tq, tk):
        return 2 * tq * 8 * 8 + 2 * tk * 8 * 16 + 2 * (2 * tq * 4 * tk) * 2 + 2 * tq * 8 * 8  # q; k, v; 2 heads x (scores, sum); W_o

    def mlp(tokens):
        return 2 * (2 * tokens * 8 * 16)

    encoder = attention(s, s) + mlp(s)
    decoder = attention(t, t) + attention(t, s) + mlp(t)  # self-attention, cross-attention to the source
    generator = 2 * t * 8 * 10
    assert (attention(s, s), attention(t, t), attention(t, s)) == (2560, 1824, 2176)
    assert (encoder, decoder, generator) == (2560 + 2048, 1824 + 2176 + 1536, 480)
    assert seq2seq_step_flops(arch, batch=2, src_len=s, tgt_len=t, tgt_vocab=10) == 3 * 2 * (encoder + decoder + generator)
    assert seq2seq_footprint(arch, batch=2, src_vocab=50, tgt_vocab=10, max_len=4).step_flops == \
        seq2seq_step_flops(arch, batch=2, src_len=4, tgt_len=4, tgt_vocab=10)  # max_len bounds both sides


def test_the_footprint_carries_the_step_flops():
    arch = ArchConfig(**TINY)
    assert vit_footprint(arch, batch=2, image_size=4, in_chans=3, num_classes=10).step_flops == tiny_vit_flops()
    assert Footprint(params=1, activation_bytes=1).step_flops is None  # not estimated


def test_split_heads_cost_the_same_whatever_their_number():
    """With d_k = d_model / h, every matmul of classic attention has the same size for any h."""
    counts = {h: vit_step_flops(ArchConfig(enc_heads=h), batch=8) for h in (1, 2, 3, 4, 6, 8, 12, 48)}
    assert len(set(counts.values())) == 1, counts
    assert vit_step_flops(ArchConfig(enc_heads=[8, 4, 2, 1]), batch=8) == counts[4]


@pytest.mark.parametrize("soft_score, energy_per_head", [("pairwise", lambda t, d_a: PAIRWISE_ENERGY_FLOPS * t * t * d_a),
                                                         ("key", lambda t, d_a: KEY_ENERGY_FLOPS * t * d_a)])
def test_the_soft_branch_grows_with_heads(soft_score, energy_per_head):
    """HAM: each head scores with its own additive energy of width d_a, so with a fixed d_a every head adds
    one energy's worth; the soft branch's projections (h heads of d_model/h x d_a) stay the same."""
    t, d_a, layers, batch = 65, 16, 4, 8
    flops = {h: vit_step_flops(ArchConfig(fusion="hadamard", soft_score=soft_score, soft_dim=d_a, enc_heads=h), batch=batch)
             for h in (1, 2, 4, 8, 16)}
    for h in (2, 4, 8, 16):
        assert flops[h] - flops[1] == 3 * batch * layers * (h - 1) * energy_per_head(t, d_a)


def forward_flops_counted_by_torch(model, *inputs, explicit_attention: bool = True) -> int:
    """torch's FLOP counter over one forward pass. `explicit_attention` routes every attention core through
    its explicit matmuls (q kᵀ, softmax, A v: the path the scores skip and analysis take), which every
    torch version counts; the fused `scaled_dot_product_attention` kernel is counted by some versions and
    devices only (torch 2.14's counter skips it on the CPU, 2.15's counts it)."""
    from torch.utils.flop_counter import FlopCounterMode

    from headsearch.models.attention import Attention

    original = Attention.needs_explicit_scores
    if explicit_attention:
        Attention.needs_explicit_scores = lambda self, need_weights: True
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(*inputs)
    finally:
        Attention.needs_explicit_scores = original
    return counter.get_total_flops()


def energy_elementwise(arch: ArchConfig, heads: tuple[int, ...], queries: int, keys: int) -> int:
    """The additive energy's adds and tanh that the estimate counts and torch's counter (matmuls only) does not."""
    if arch.fusion == "none":
        return 0
    n = 0
    for h in heads:
        d_a = arch.soft_dim or arch.head_width(h)
        n += h * ((PAIRWISE_ENERGY_FLOPS - 2) * queries * keys * d_a if arch.soft_score == "pairwise"
                  else (KEY_ENERGY_FLOPS - 2) * keys * d_a)
    return n


def attention_products(arch: ArchConfig, heads: tuple[int, ...], batch: int, queries: int, keys: int) -> int:
    """The FLOPs of q kᵀ and A v over a stack's layers, by hand: 2 x (B x H x Tq x d_k x Tk) each."""
    return sum(2 * 2 * batch * h * queries * arch.head_width(h) * keys for h in heads)


@pytest.mark.parametrize("fields", VIT_ARCHS.values(), ids=VIT_ARCHS.keys())
def test_vit_forward_flops_match_torchs_counter(fields):
    arch = ArchConfig(**fields)
    tokens = (32 // arch.patch_size) ** 2 + 1
    counted = forward_flops_counted_by_torch(ViT(arch).eval(), torch.randn(2, 3, 32, 32))
    estimate = vit_step_flops(arch, batch=2) // 3
    assert estimate - 2 * energy_elementwise(arch, arch.enc_heads, tokens, tokens) == counted


@pytest.mark.parametrize("fields", [*SEQ2SEQ_ARCHS.values(), dict(d_model=32, enc_layers=2, dec_layers=2, dec_heads=[2, 4], d_ff=64)],
                         ids=[*SEQ2SEQ_ARCHS.keys(), "classic"])
def test_seq2seq_forward_flops_match_torchs_counter(fields):
    arch, s, t = ArchConfig(**fields), 7, 5
    src, tgt = torch.randint(1, 100, (2, s)), torch.randint(1, 120, (2, t))
    counted = forward_flops_counted_by_torch(Seq2Seq(arch, 100, 120, 16, 0).eval(), src, tgt)
    extra = (energy_elementwise(arch, arch.enc_heads, s, s) + energy_elementwise(arch, arch.dec_heads, t, t)
             + energy_elementwise(arch, arch.dec_heads, t, s))
    assert seq2seq_step_flops(arch, batch=2, src_len=s, tgt_len=t, tgt_vocab=120) // 3 - 2 * extra == counted


def test_the_fused_kernel_is_counted_as_the_explicit_products_or_not_at_all():
    """Whatever this torch's counter does with the fused kernel, the model runs the same products: the fused
    pass counts either the explicit path's FLOPs (the counter knows the kernel) or exactly those minus the
    hand-computed q kᵀ and A v of every layer (it skips the kernel). Anything else is a wrong estimate."""
    arch = ArchConfig(enc_heads=[8, 4, 2, 1])  # no scores skip: every layer takes the fused kernel
    model, images = ViT(arch).eval(), torch.randn(2, 3, 32, 32)
    explicit = forward_flops_counted_by_torch(model, images)
    fused = forward_flops_counted_by_torch(model, images, explicit_attention=False)
    products = attention_products(arch, arch.enc_heads, batch=2, queries=65, keys=65)
    assert products == 4 * 2 * 2 * 2 * 65 * 48 * 65  # every layer: 2 products x (B x d_model x T x T) x 2
    assert fused in (explicit, explicit - products), (fused, explicit, products)
