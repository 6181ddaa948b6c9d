"""The designs of issue 52 against hand-written float64 references of their formulas (docs/design.md §2.3-2.5,
§3.1): the value residual (ResFormer), U-net skips, depth-weighted averages (DenseFormer) and differential
attention (DIFF Transformer); and the configs each refuses, in one line."""
import json
import math

import pytest
import torch

from headsearch.config import ArchConfig
from headsearch.errors import ConfigError
from headsearch.models import Attention
from headsearch.models.attention import differential_lambda_init
from headsearch.models.transformer import Encoder

pytestmark = pytest.mark.floor  # torch's SDPA and RMSNorm

torch.set_grad_enabled(True)
D = torch.float64


def _encoder(**arch) -> Encoder:
    torch.manual_seed(0)
    enc = Encoder(ArchConfig(d_model=8, d_ff=16, **arch)).to(D).eval()
    with torch.no_grad():  # move every learned mix off its start, so the reference checks the formula, not the start
        for name, p in enc.named_parameters():
            if "stream" in name or "value_mix" in name:
                p.copy_(torch.randn_like(p))
    return enc


def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    e = [math.exp(v - top) for v in row]
    return [v / sum(e) for v in e]


def _attention_by_hand(q, k, v, heads: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_k)) v per head, element by element: q (T, D), k, v (T, D) -> (T, D)."""
    t, d = q.shape
    d_k = d // heads
    out = torch.zeros(t, d, dtype=D)
    for h in range(heads):
        cols = range(h * d_k, (h + 1) * d_k)
        for i in range(t):
            a = _softmax([sum(float(q[i, c] * k[j, c]) for c in cols) / math.sqrt(d_k) for j in range(t)])
            for c in cols:
                out[i, c] = sum(a[j] * float(v[j, c]) for j in range(t))
    return out


@torch.no_grad()
def test_value_residual_mixes_every_layers_values_with_the_first_layers():
    """v_n <- lambda_n v_n + (1 - lambda_n) v_1 per position, before the heads split (so 4 -> 2 heads works)."""
    enc = _encoder(enc_layers=3, enc_heads=[4, 2, 2], skip="value")
    x = torch.randn(1, 5, 8, dtype=D)
    seen = []
    for blk in enc.blocks:
        blk.attn.out_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0][0]))
    enc(x)
    h, first = x[0], None
    for i, blk in enumerate(enc.blocks):
        n = blk.norm1(h)
        q, k, v = (n @ blk.attn.qkv_proj.weight.T + blk.attn.qkv_proj.bias).chunk(3, dim=-1)
        if i == 0:
            first = v
            assert blk.attn.value_mix is None  # the first layer only emits
        else:
            lam = float(blk.attn.value_mix)
            v = lam * v + (1 - lam) * first
        merged = _attention_by_hand(q, k, v, blk.attn.n_heads)
        torch.testing.assert_close(seen[i], merged, rtol=1e-12, atol=1e-12)
        h = h + blk.attn.out_proj(merged)
        h = h + blk.mlp(blk.norm2(h))


def _blocks_by_hand(enc: Encoder, x: torch.Tensor, before, after) -> torch.Tensor:
    """The stack run block by block with the stream's arithmetic written out by `before` and `after`."""
    outs = [x]
    for i, blk in enumerate(enc.blocks):
        h = before(i, outs)
        h, _ = blk(h, None, None, False)
        outs.append(after(i, h, outs))
    return enc.norm(outs[-1])


@torch.no_grad()
@pytest.mark.parametrize("layers", [1, 4, 5])
def test_unet_skips_add_block_i_to_the_input_of_block_l_minus_1_minus_i(layers):
    enc = _encoder(enc_layers=layers, enc_heads=2, skip="unet")
    w = enc.stream.weights.tolist()
    assert len(w) == layers // 2
    x = torch.randn(2, 6, 8, dtype=D)

    def before(j, outs):  # outs[0] is the input, outs[i + 1] block i's output
        i = layers - 1 - j
        return outs[-1] + w[i] * outs[i + 1] if i < j else outs[-1]

    expected = _blocks_by_hand(enc, x, before, lambda i, h, outs: h)
    torch.testing.assert_close(enc(x)[0], expected, rtol=1e-12, atol=1e-12)


@torch.no_grad()
def test_dense_stream_averages_the_input_and_every_block_output_so_far():
    enc = _encoder(enc_layers=3, enc_heads=[4, 2, 1], skip="dense")
    alphas = [a.tolist() for a in enc.stream.alphas]
    assert [len(a) for a in alphas] == [2, 3, 4]
    x = torch.randn(2, 6, 8, dtype=D)
    raw = [x]  # X_0, then X_{i+1} = block_i(Y_{i-1})

    def after(i, h, outs):
        raw.append(h)
        return sum(alphas[i][j] * raw[j] for j in range(i + 2))

    expected = _blocks_by_hand(enc, x, lambda i, outs: outs[-1], after)
    torch.testing.assert_close(enc(x)[0], expected, rtol=1e-12, atol=1e-12)


def test_both_streams_start_as_the_plain_stack_or_modded_nanogpts_start():
    plain, dense = (Encoder(ArchConfig(d_model=8, d_ff=16, enc_layers=3, skip=s)) for s in ("none", "dense"))
    dense.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(2, 6, 8)
    torch.testing.assert_close(dense(x)[0], plain(x)[0])  # alpha one-hot on the newest output
    unet = Encoder(ArchConfig(d_model=8, d_ff=16, enc_layers=4, skip="unet"))
    assert unet.stream.weights.tolist() == [1.0, 1.0]


@torch.no_grad()
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("layer_index", [0, 2])
def test_differential_attention_matches_the_diff_transformer_formula(masked, layer_index):
    """Per head: [softmax(q1 k1^T / sqrt(d)) - lambda softmax(q2 k2^T / sqrt(d))] v, RMSNorm, x (1 - lambda_init),
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, d = d_k / 2 (Ye et al. 2024)."""
    torch.manual_seed(0)
    attn = Attention(8, 2, 4, fusion="differential", layer_index=layer_index).to(D).eval()
    attn.diff_norm.weight.copy_(torch.randn(4))
    x = torch.randn(1, 5, 8, dtype=D)
    keys = 3 if masked else 5
    mask = (torch.arange(5) < keys)[None, None, None, :] if masked else None
    fast, explicit = attn(x, mask=mask), attn(x, mask=mask, need_weights=True)

    lam_init = 0.8 - 0.6 * math.exp(-0.3 * layer_index)
    assert differential_lambda_init(layer_index) == pytest.approx(lam_init)
    lq, lk = attn.lambda_q.tolist(), attn.lambda_k.tolist()
    lam = (math.exp(sum(a * b for a, b in zip(lq[0], lk[0]))) - math.exp(sum(a * b for a, b in zip(lq[1], lk[1])))
           + lam_init)
    q, k, v = (x[0] @ attn.qkv_proj.weight.T + attn.qkv_proj.bias).chunk(3, dim=-1)
    merged = torch.zeros(5, 8, dtype=D)
    for h in range(2):
        c = 4 * h
        for i in range(5):
            def softmax_map(lo):  # the map over half [lo, lo + 2) of this head's q and k
                return _softmax([sum(float(q[i, c + lo + e] * k[j, c + lo + e]) for e in range(2)) / math.sqrt(2)
                                 for j in range(keys)])
            a1, a2 = softmax_map(0), softmax_map(2)
            row = [a1[j] - lam * a2[j] for j in range(keys)]
            torch.testing.assert_close(explicit.weights[0, h, i, :keys], torch.tensor(row, dtype=D), rtol=1e-12, atol=1e-12)
            out = [sum(row[j] * float(v[j, c + e]) for j in range(keys)) for e in range(4)]
            rms = math.sqrt(sum(o * o for o in out) / 4 + 1e-5)
            for e in range(4):
                merged[i, c + e] = out[e] / rms * float(attn.diff_norm.weight[e]) * (1 - lam_init)
    expected = merged @ attn.out_proj.weight.T + attn.out_proj.bias
    torch.testing.assert_close(fast.out[0], expected, rtol=1e-10, atol=1e-12)  # two SDPA kernels
    torch.testing.assert_close(explicit.out[0], expected, rtol=1e-10, atol=1e-12)
    if masked:
        assert explicit.weights[..., keys:].abs().max() == 0


@torch.no_grad()
def test_the_scores_skip_with_differential_attention_carries_each_map_to_the_same_map():
    """RealFormer's residual map by map: layer 2's map m adds layer 1's pre-softmax scores of map m, mapped 4 -> 2 heads
    (the mean of head pairs), and A = softmax(S_1) - lambda softmax(S_2); layer 1 emits [S_1; S_2] (B, 2H, T, T)."""
    enc = _encoder(enc_layers=2, enc_heads=[4, 2], skip="scores", fusion="differential")
    x = torch.randn(1, 5, 8, dtype=D)
    _, weights = enc(x, need_weights=True)
    b1, b2 = enc.blocks
    h = x + b1.attn(b1.norm1(x)).out
    h = h + b1.mlp(b1.norm2(h))

    def scores(attn, n):  # each map's own scaled scores: (2, H, T, T)
        q, k = (n[0] @ attn.qkv_proj.weight.T + attn.qkv_proj.bias).chunk(3, dim=-1)[:2]
        heads, width = attn.n_heads, attn.head_dim
        out = torch.zeros(2, heads, 5, 5, dtype=D)
        for m in range(2):
            for hd in range(heads):
                cols = range(hd * width + m * width // 2, hd * width + (m + 1) * width // 2)
                for i in range(5):
                    for j in range(5):
                        out[m, hd, i, j] = sum(float(q[i, c] * k[j, c]) for c in cols) / math.sqrt(width // 2)
        return out

    s1, s2 = scores(b1.attn, b1.norm1(x)), scores(b2.attn, b2.norm1(h))
    carried = s2 + s1.view(2, 2, 2, 5, 5).mean(dim=2)  # layer 1's 4 heads averaged in pairs onto layer 2's 2
    lam = float(b2.attn.differential_lambda())
    expected = carried[0].softmax(-1) - lam * carried[1].softmax(-1)
    torch.testing.assert_close(weights[1].self_attn[0], expected, rtol=1e-12, atol=1e-12)
    emitted = b1.attn(b1.norm1(x)).skip_state
    assert emitted.shape == (1, 8, 5, 5)
    torch.testing.assert_close(emitted[0], s1.reshape(8, 5, 5), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fields,message", [
    (dict(d_model=48, enc_layers=2, enc_heads=[16, 8], fusion="differential"), "enc_heads[0] = 16 gives heads of odd width 3"),
    (dict(enc_layers=2, enc_heads=[4, 2], head_dim=16, skip="value"), "skip 'value' mixes the first layer's values into every later"),
    (dict(dec_layers=2, dec_heads=[6, 2], d_model=48, head_dim=8, skip="value"), "(dec_heads[0], dec_heads[1])"),
])
def test_each_design_is_refused_in_one_line_where_it_cannot_apply(fields, message):
    with pytest.raises(ConfigError) as e:
        ArchConfig(**fields)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_odd_head_width_is_refused_by_the_attention_module_itself():
    with pytest.raises(ConfigError, match="a head width of 3 is odd"):
        Attention(6, 2, 3, fusion="differential")


@pytest.mark.parametrize("task,schedules", [
    ("vit-cifar10", {(8, 8, 8, 8), (8, 4, 2, 1), (1, 2, 4, 8)}),  # 4 layers of d_model 48
    ("translation-en-es", {(8, 8), (8, 4), (4, 8)}),  # 2 encoder layers: halving stops at 4
])
def test_the_modern_space_crosses_three_schedules_with_every_skip_and_fusion_it_can_train(task, schedules):
    """3 schedules x 6 skips x 2 fusions: every one valid on the tiny presets
    (8 heads on d_model 48 are 6 wide, even, as differential attention needs)."""
    from headsearch.search.runner import Search, SearchSettings

    search = Search(SearchSettings(task=task, space="modern", preset="tiny", device="cpu"))
    archs = [json.loads(k)["arch"] for k in search.archs.listing()]
    assert len(archs) == 3 * 12
    assert len({(a["skip"], a["fusion"]) for a in archs}) == 12
    assert {tuple(a["enc_heads"]) for a in archs} == schedules
