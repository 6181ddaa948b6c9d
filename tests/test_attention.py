"""The attention module against hand-written references, and the fused path against the explicit one."""
import math

import pytest
import torch
import torch.nn.functional as F

from headsearch import config
from headsearch.config import ArchConfig
from headsearch.errors import ConfigError
from headsearch.models import Attention, Seq2Seq, ViT, map_score_heads, variants
from headsearch.models.transformer import Encoder

# make test-oldest runs this module on the floor: torch's attention kernels (SDPA).
pytestmark = pytest.mark.floor

torch.set_grad_enabled(True)


def _attn(d_model=8, heads=2, **kw) -> Attention:
    torch.manual_seed(0)
    return Attention(d_model, heads, d_model // heads, **kw).eval()


def _padding_mask(lengths, t):
    return (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, T)


@pytest.mark.parametrize("fusion", list(variants.FUSIONS))
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_sdpa_path_equals_explicit_path(fusion, cross, masked):
    attn = _attn(16, 4, fusion=fusion, cross=cross)
    x, ctx = torch.randn(3, 5, 16), torch.randn(3, 7, 16)
    mask = _padding_mask([7, 4, 1], 7) if masked else None
    if not cross and masked:
        mask = _padding_mask([5, 3, 2], 5)
    context = ctx if cross else None
    fast = attn(x, context, mask=mask)  # SDPA: nothing needs scores
    assert fast.weights is None
    explicit = attn(x, context, mask=mask, need_weights=True)
    torch.testing.assert_close(fast.out, explicit.out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("skip", [s for s, v in variants.SKIPS.items() if not v.carries_scores])
def test_skip_mean_without_a_scores_skip_changes_nothing_when_weights_are_asked_for(skip):
    """`skip_mean` divides a scores skip's running sum by the layer's depth. With no scores skip there is no sum:
    asking for the weights (attention maps, the head analysis) used to divide the logits anyway, so a layer's
    output differed from training's (0.10 at layer 2)."""
    attn = _attn(16, 4, skip=skip, skip_mean=True, layer_index=2)
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(attn(x).out, attn(x, need_weights=True).out, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_attention_matches_hand_written_reference():
    """B=1, T=3, d_model=4, 2 heads of width 2, computed element by element."""
    attn = _attn(4, 2)
    x = torch.randn(1, 3, 4)
    out = attn(x).out[0]

    W, b = attn.qkv_proj.weight, attn.qkv_proj.bias
    rows = [[sum(W[o, i] * x[0, t, i] for i in range(4)) + b[o] for o in range(12)] for t in range(3)]
    q = [[r[0:4] for r in rows], [r[4:8] for r in rows], [r[8:12] for r in rows]]  # q/k/v, token, feature
    merged = [[0.0] * 4 for _ in range(3)]
    for h in range(2):
        cols = range(2 * h, 2 * h + 2)
        for i in range(3):
            s = [sum(q[0][i][c] * q[1][j][c] for c in cols) / math.sqrt(2) for j in range(3)]
            z = sum(math.exp(float(v)) for v in s)
            a = [math.exp(float(v)) / z for v in s]
            for c in cols:
                merged[i][c] = sum(a[j] * q[2][j][c] for j in range(3))
    Wo, bo = attn.out_proj.weight, attn.out_proj.bias
    expected = torch.tensor([[float(sum(Wo[o, c] * merged[i][c] for c in range(4)) + bo[o]) for o in range(4)] for i in range(3)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("score", ["pairwise", "key"])
@torch.no_grad()
def test_soft_attention_matches_bahdanau_reference(score):
    attn = _attn(4, 2, fusion="add", soft_dim=3, soft_score=score)
    soft = attn.soft
    q, k, v = torch.randn(1, 2, 3, 2), torch.randn(1, 2, 4, 2), torch.randn(1, 2, 4, 2)
    mask = torch.tensor([True, True, True, False])[None, None, None, :]
    out, alpha = soft(q, k, v, mask)
    for h in range(2):
        for i in range(3):
            e = []
            for j in range(4):
                pre = k[0, h, j] @ soft.w_key[h]
                if score == "pairwise":
                    pre = pre + q[0, h, i] @ soft.w_query[h]
                e.append(float(torch.tanh(pre) @ soft.w_energy[h]) if j < 3 else -math.inf)
            a = torch.tensor(e).softmax(0)
            torch.testing.assert_close(alpha[0, h, i], a, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(out[0, h, i], a @ v[0, h], atol=1e-6, rtol=1e-5)
    assert alpha[..., 3].abs().max() == 0  # masked key gets exactly no weight


@pytest.mark.parametrize("budget", [1, 50, 10**6])  # one query per chunk, a few, all at once
def test_chunked_additive_energy_matches_the_direct_formula_and_its_gradients(budget):
    from headsearch.models.attention import AdditiveEnergy, additive_energy

    torch.manual_seed(0)
    qq = torch.randn(2, 3, 5, 4, dtype=torch.double, requires_grad=True)
    kk = torch.randn(2, 3, 7, 4, dtype=torch.double, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.double, requires_grad=True)
    direct = torch.einsum("bhqka,ha->bhqk", torch.tanh(qq[:, :, :, None] + kk[:, :, None]), w)
    torch.testing.assert_close(additive_energy(qq, kk, w, budget), direct)
    chunk = max(1, budget // (2 * 3 * 7 * 4))
    assert torch.autograd.gradcheck(lambda a, b, c: AdditiveEnergy.apply(a, b, c, chunk), (qq, kk, w))


@pytest.mark.parametrize("fusion,op", [("hadamard", torch.mul), ("add", torch.add)])
def test_fusion_combines_self_and_soft_heads_before_w_o(fusion, op):
    attn = _attn(8, 2, fusion=fusion)
    seen = {}
    attn.hook_context.register_forward_hook(lambda m, i, o: seen.setdefault("sa", o))
    attn.hook_head_out.register_forward_hook(lambda m, i, o: seen.setdefault("heads", o))
    x = torch.randn(2, 5, 8)
    attn(x)
    q, k, v, _, _ = attn._project(x, None)
    soft, _ = attn.soft(q, k, v, None)
    torch.testing.assert_close(seen["heads"], op(seen["sa"], soft))


def test_the_models_tables_hold_exactly_the_names_the_config_accepts():
    """config.py (no torch) and models/variants.py (the cores' tables) each list the names: a name added to one
    only would be refused by ArchConfig, or accepted by it and refused by the cores."""
    assert set(variants.FUSIONS) == set(config.FUSIONS)
    assert set(variants.SKIPS) == set(config.SKIPS)
    assert all(name == skip.name for name, skip in variants.SKIPS.items())
    for s in variants.SKIPS.values():  # one thing at most: scores, outputs, values, or the stream between blocks
        assert s.carries_scores + s.carries_output + s.carries_values + (s.stream is not None) <= 1, s
    assert all(not (f.soft is not None and f.differential) for f in variants.FUSIONS.values())
    assert all(name == f.name for name, f in variants.FUSIONS.items())


@pytest.mark.parametrize("kw,names", [(dict(fusion="concat"), variants.FUSIONS), (dict(skip="ladder"), variants.SKIPS)],
                         ids=["fusion", "skip"])
def test_an_unknown_fusion_or_skip_is_refused_at_construction_in_one_line(kw, names):
    (kind, name), = kw.items()
    with pytest.raises(ConfigError) as e:
        Attention(8, 2, 4, **kw)
    message = str(e.value)
    assert "\n" not in message and f"{kind} = {name!r} is not known" in message
    assert ", ".join(names) in message


def test_map_score_heads_averages_when_decreasing_and_repeats_when_increasing():
    s = torch.randn(2, 64, 5, 5)
    down = map_score_heads(s, 32)
    assert down.shape == (2, 32, 5, 5)
    torch.testing.assert_close(down[:, 7], (s[:, 14] + s[:, 15]) / 2)
    eight = map_score_heads(s, 8)
    torch.testing.assert_close(eight[:, 1], s[:, 8:16].mean(dim=1))
    s2 = torch.randn(2, 2, 5, 5)
    up = map_score_heads(s2, 4)
    assert up.shape == (2, 4, 5, 5)
    for j in range(4):
        torch.testing.assert_close(up[:, j], s2[:, j // 2])
    assert map_score_heads(s2, 2) is s2


def test_scores_skip_adds_previous_scores_before_softmax():
    """RealFormer: layer 2's logits = its own scaled q k^T + mapped layer-1 scores (running sum)."""
    cfg = ArchConfig(d_model=8, enc_layers=2, enc_heads=[4, 2], d_ff=16, skip="scores")
    torch.manual_seed(0)
    enc = Encoder(cfg).eval()
    x = torch.randn(2, 5, 8)
    _, weights = enc(x, need_weights=True)
    b1, b2 = enc.blocks
    h = x + b1.attn(b1.norm1(x)).out
    h = h + b1.mlp(b1.norm2(h))
    q1, k1, *_ = b1.attn._project(b1.norm1(x), None)
    s1 = q1 @ k1.transpose(-2, -1) / math.sqrt(2)
    q2, k2, *_ = b2.attn._project(b2.norm1(h), None)
    s2 = q2 @ k2.transpose(-2, -1) / math.sqrt(4) + map_score_heads(s1, 2)
    torch.testing.assert_close(weights[1].self_attn, s2.softmax(-1), atol=1e-5, rtol=1e-5)


def test_output_skip_adds_and_normalises_merged_heads():
    cfg = ArchConfig(d_model=8, enc_layers=2, enc_heads=[4, 2], d_ff=16, skip="output")
    torch.manual_seed(0)
    enc = Encoder(cfg).eval()
    captured = []
    for blk in enc.blocks:
        blk.attn.out_proj.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    raw = []
    for blk in enc.blocks:
        blk.attn.hook_head_out.register_forward_hook(lambda m, i, o: raw.append(o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)))
    enc(torch.randn(2, 5, 8))
    assert enc.blocks[0].attn.skip_norm is None  # the first layer only emits
    torch.testing.assert_close(captured[0], raw[0])
    torch.testing.assert_close(captured[1], enc.blocks[1].attn.skip_norm(raw[1] + captured[0]))


def test_scores_skip_running_mean_divides_by_depth():
    cfg = ArchConfig(d_model=8, enc_layers=3, enc_heads=2, d_ff=16, skip="scores", skip_mean=True)
    enc = Encoder(cfg)
    assert [b.attn.score_divisor for b in enc.blocks] == [1.0, 2.0, 3.0]


def _all_params_get_gradient(model, loss):
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not missing, f"no gradient reaches {missing}"


PAIRS = [(s, f) for s in variants.SKIPS for f in variants.FUSIONS]  # every skip with every fusion


@pytest.mark.parametrize("skip,fusion", PAIRS)
def test_each_skip_and_fusion_changes_vit_output_and_trains_every_parameter(skip, fusion):
    base_cfg = ArchConfig(d_model=16, enc_layers=3, enc_heads=[4, 2, 1], d_ff=32)
    torch.manual_seed(0)
    base = ViT(base_cfg).eval()
    torch.manual_seed(0)
    model = ViT(ArchConfig.from_dict({"skip": skip, "fusion": fusion}, base=base_cfg)).eval()
    model.load_state_dict(base.state_dict(), strict=False)  # shared weights equal: differences come from the mode
    with torch.no_grad():  # at init (std 0.02) attention is nearly uniform: sharpen it so the modes matter
        for m in (base, model):
            for blk in m.encoder.blocks:
                blk.attn.qkv_proj.weight.mul_(30)
        if model.encoder.stream is not None:  # a DenseFormer starts as the plain stack: move it off the identity
            for w in model.encoder.stream.parameters():
                w.add_(0.1)
    images = torch.randn(4, 3, 32, 32)
    if (skip, fusion) != ("none", "none"):
        assert not torch.allclose(model(images), base(images), atol=1e-4)
    model.train()
    _all_params_get_gradient(model, model(images).logsumexp(-1).sum())


@pytest.mark.parametrize("skip,fusion", PAIRS)
def test_each_skip_and_fusion_trains_every_seq2seq_parameter(skip, fusion):
    cfg = ArchConfig(d_model=16, enc_layers=3, enc_heads=[8, 4, 2], dec_layers=2, dec_heads=4, d_ff=32,
                     skip=skip, fusion=fusion, activation="relu")
    torch.manual_seed(0)
    model = Seq2Seq(cfg, 30, 40, 16, pad_id=1)
    src = torch.randint(4, 30, (3, 6))
    src[1, 4:] = 1
    logits = model(src, torch.randint(4, 40, (3, 5)))
    _all_params_get_gradient(model, logits.logsumexp(-1).sum())


@pytest.mark.parametrize("skip", ["none", "output", "scores"])
@pytest.mark.parametrize("fusion", ["none", "add"])
def test_padding_changes_nothing(skip, fusion):
    """More padding, or a different PAD embedding, leaves every real position's logits unchanged."""
    cfg = ArchConfig(d_model=16, enc_layers=2, enc_heads=[4, 2], dec_layers=2, dec_heads=2, d_ff=32,
                     skip=skip, fusion=fusion)
    torch.manual_seed(0)
    model = Seq2Seq(cfg, 30, 40, 32, pad_id=1).eval()
    src = torch.tensor([[5, 6, 7, 8, 1, 1], [9, 10, 1, 1, 1, 1]])
    tgt = torch.tensor([[2, 11, 12, 13, 1], [2, 14, 15, 1, 1]])
    ref = model(src, tgt)
    longer = model(F.pad(src, (0, 5), value=1), F.pad(tgt, (0, 3), value=1))[:, :5]
    real = tgt != 1
    torch.testing.assert_close(longer[real], ref[real], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        model.src_embed.weight[1] += 10.0
        model.tgt_embed.weight[1] -= 10.0
    torch.testing.assert_close(model(src, tgt)[real], ref[real], atol=1e-5, rtol=1e-5)


def test_decoder_is_causal():
    cfg = ArchConfig(d_model=16, enc_layers=1, enc_heads=2, dec_layers=2, dec_heads=2, d_ff=32, skip="scores", fusion="add")
    torch.manual_seed(0)
    model = Seq2Seq(cfg, 30, 40, 32, pad_id=1).eval()
    src = torch.randint(4, 30, (2, 6))
    tgt = torch.randint(4, 40, (2, 6))
    changed = tgt.clone()
    changed[:, 4:] = 7
    torch.testing.assert_close(model(src, tgt)[:, :4], model(src, changed)[:, :4], atol=1e-5, rtol=1e-5)


def test_masked_keys_get_zero_weight():
    attn = _attn(8, 2, fusion="hadamard")
    mask = _padding_mask([3, 5], 5)
    res = attn(torch.randn(2, 5, 8), mask=mask, need_weights=True)
    assert res.weights[0, :, :, 3:].abs().max() == 0
    assert res.soft_weights[0, :, :, 3:].abs().max() == 0
    torch.testing.assert_close(res.weights.sum(-1), torch.ones(2, 2, 5))


def test_head_mask_removes_exactly_that_heads_contribution():
    attn = _attn(8, 4)
    x = torch.randn(2, 5, 8)
    seen = []
    attn.hook_head_out.register_forward_hook(lambda m, i, o: seen.append(o))
    attn.head_mask = torch.ones(4)
    full = attn(x).out
    attn.head_mask = None
    torch.testing.assert_close(attn(x).out, full)
    xi = torch.tensor([1.0, 0.0, 1.0, 1.0], requires_grad=True)
    attn.head_mask = xi
    masked = attn(x).out
    heads = seen[0].clone()
    heads[:, 1] = 0
    expected = attn.out_proj(heads.transpose(1, 2).reshape(2, 5, 8))
    torch.testing.assert_close(masked, expected)
    masked.sum().backward()
    assert xi.grad is not None and xi.grad.shape == (4,)


def test_batched_greedy_decoding_equals_one_sentence_at_a_time():
    cfg = ArchConfig(d_model=16, enc_layers=2, enc_heads=[4, 2], dec_layers=2, dec_heads=2, d_ff=32)
    torch.manual_seed(0)
    model = Seq2Seq(cfg, 30, 40, 20, pad_id=1).eval()
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 1, 1], [11, 3, 1, 1, 1]])
    batched = model.greedy_decode(src, sos_id=2, eos_id=3, max_new_tokens=8)
    for i, length in enumerate([5, 3, 2]):
        single = model.greedy_decode(src[i : i + 1, :length], sos_id=2, eos_id=3, max_new_tokens=8)[0]
        n = single.shape[0]
        assert batched[i, :n].tolist() == single.tolist()
        assert (batched[i, n:] == 1).all()  # PAD after that sentence finished
    # Each step (decoded with the key/value cache) is the argmax of a full forward pass on the prefix.
    ys = torch.tensor([[2]])
    for _ in range(4):
        nxt = model(src[:1], ys)[:, -1].argmax(-1, keepdim=True)
        ys = torch.cat([ys, nxt], 1)
    assert batched[0, :4].tolist() == ys[0, 1:].tolist()
