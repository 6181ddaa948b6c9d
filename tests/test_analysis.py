"""Head diversity, importance, ablation and pruning curves on hand-built cases with known answers."""
import math
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from headsearch.analysis.diversity import METRICS, analysis_batches, head_diversity, module_masks
from headsearch.analysis.importance import (
    ablation,
    head_importance,
    pruning_curve,
    pruning_steps,
)
from headsearch.config import ArchConfig
from headsearch.models import Attention, Seq2Seq
from headsearch.models.transformer import attention_layers
from headsearch.tasks.translation import BoundTranslation

# make test-oldest runs this module on the floor: torch and NumPy numerics of the head metrics.
pytestmark = pytest.mark.floor

torch.set_grad_enabled(True)
PAD = 1


class OneAttention(nn.Module):
    """A bare self-attention layer as a model (module name "attn", no masks)."""

    def __init__(self, attn: Attention):
        super().__init__()
        self.attn = attn

    def forward(self, x, need_weights=False):
        return self.attn(x, need_weights=need_weights).out


def _bare(d_model, heads, seed=0) -> OneAttention:
    torch.manual_seed(seed)
    return OneAttention(Attention(d_model, heads, d_model // heads)).eval()


def _batch(x):
    return {"inputs": (x,), "masks": {}}


def _sum_sq_loss(model, batch):
    out = model(*batch["inputs"])
    return out.square().sum(), out.shape[0] * out.shape[1]


def _capture_context(model, x):
    """Each module's hook_context output for one forward (explicit-softmax path, as the analysis runs)."""
    seen = {}
    handles = [attn.hook_context.register_forward_hook(lambda m, a, o, n=name: seen.__setitem__(n, o.detach()))
               for name, attn in attention_layers(model)]
    try:
        with torch.no_grad():
            model(x, need_weights=True)
    finally:
        for h in handles:
            h.remove()
    return seen


# -- tiny seq2seq with padding ---------------------------------------------------------------------


def _seq2seq(seed=0) -> Seq2Seq:
    torch.manual_seed(seed)
    cfg = ArchConfig(d_model=16, enc_layers=2, enc_heads=(2, 4), dec_layers=1, dec_heads=2, d_ff=32, activation="relu")
    return Seq2Seq(cfg, src_vocab=20, tgt_vocab=20, max_len=24, pad_id=PAD).eval()


SRC_LENGTHS, TGT_LENGTHS = (5, 2, 8, 3, 6, 1, 7, 4), (3, 7, 1, 5, 2, 6, 4, 7)


def _pairs(n, seed=1):
    """n pairs of random tokens (never PAD/SOS/EOS) with varied lengths, so padding differs by row."""
    g = torch.Generator().manual_seed(seed)
    src = [torch.randint(4, 20, (SRC_LENGTHS[i % 8],), generator=g).tolist() for i in range(n)]
    tgt = [torch.randint(4, 20, (TGT_LENGTHS[(i + seed) % 8],), generator=g).tolist() for i in range(n)]
    return src, tgt


def _s2s_batch(src, tgt, extra_pad=0):
    """Padded (src, tgt_in = SOS + t, tgt_out = t + EOS) with `extra_pad` more PAD columns than needed."""
    s_len = max(map(len, src)) + extra_pad
    t_len = max(map(len, tgt)) + 1 + extra_pad
    s = torch.full((len(src), s_len), PAD)
    ti = torch.full((len(src), t_len), PAD)
    to = torch.full((len(src), t_len), PAD)
    for r, (a, b) in enumerate(zip(src, tgt)):
        s[r, : len(a)] = torch.tensor(a)
        ti[r, 0], ti[r, 1 : len(b) + 1] = 2, torch.tensor(b)
        to[r, : len(b)], to[r, len(b)] = torch.tensor(b), 3
    return {"inputs": (s, ti), "masks": {"src": s != PAD, "tgt": ti != PAD}, "targets": to}


# The translation task's summed loss (as head importance calls it) on hand-made batches with PAD = 1.
translation_loss = partial(BoundTranslation.summed_loss, SimpleNamespace(td=SimpleNamespace(PAD_ID=PAD)))


def _assert_same_diversity(a, b, rtol=1e-5, atol=1e-7):
    assert [x.name for x in a] == [y.name for y in b]
    for x, y in zip(a, b):
        assert x.n_positions == y.n_positions and x.n_keys == y.n_keys
        for key in METRICS:
            np.testing.assert_allclose(getattr(x, key), getattr(y, key), rtol=rtol, atol=atol, err_msg=f"{x.name} {key}")


# -- diversity: known answers ----------------------------------------------------------------------


def test_identical_heads_are_maximally_similar():
    model = _bare(12, 3)
    attn = model.attn
    with torch.no_grad():  # every head a copy of head 0, in q, k and v
        for part in range(3):
            base = part * 12
            for h in (1, 2):
                attn.qkv_proj.weight[base + 4 * h : base + 4 * h + 4] = attn.qkv_proj.weight[base : base + 4]
                attn.qkv_proj.bias[base + 4 * h : base + 4 * h + 4] = attn.qkv_proj.bias[base : base + 4]
    x = torch.randn(2, 5, 12)
    (layer,) = head_diversity(model, [_batch(x)])
    off = ~np.eye(3, dtype=bool)
    np.testing.assert_allclose(layer.output_dissimilarity[off], -1.0, atol=1e-12)
    np.testing.assert_allclose(layer.context_nonorthogonality_normalized[off], 1.0, atol=1e-12)
    assert np.all(np.diag(layer.output_dissimilarity) == 0) and np.all(np.diag(layer.context_nonorthogonality) == 0)
    # raw non-orthogonality of a pair equals a head's own ||C^T C||_F / N, computed here independently
    c0 = _capture_context(model, x)["attn"][:, 0].reshape(-1, 4).double()
    n = c0.shape[0]
    self_value = float(torch.linalg.matrix_norm(c0.T @ c0)) / n
    assert layer.n_positions == n == 10
    np.testing.assert_allclose(layer.context_nonorthogonality[off], self_value, rtol=1e-10)
    scalars = layer.scalars()
    assert scalars["output_dissimilarity"] == pytest.approx(-1.0, abs=1e-12)
    assert scalars["context_nonorthogonality_normalized"] == pytest.approx(1.0, abs=1e-12)


def test_disjoint_query_subspaces_are_orthogonal():
    model = _bare(8, 2)
    w = model.attn.qkv_proj.weight
    with torch.no_grad():
        w[0:4, 4:8] = 0  # head 0's queries read x[0:4] only
        w[4:8, 0:4] = 0  # head 1's queries read x[4:8] only
        model.attn.qkv_proj.bias[0:8] = 0
    x = torch.randn(3, 6, 8)
    x[:, 0::2, 4:8] = 0  # even tokens live in dims 0:4, odd tokens in 4:8: disjoint supports
    x[:, 1::2, 0:4] = 0
    (layer,) = head_diversity(model, [_batch(x)])
    assert layer.query_orthogonality[0, 1] == 0.0 and layer.query_orthogonality[1, 0] == 0.0
    (dense,) = head_diversity(model, [_batch(torch.randn(3, 6, 8))])  # the same heads on dense inputs overlap
    assert dense.query_orthogonality[0, 1] > 0


def test_uniform_attention_has_zero_diversity_and_log_t_entropy():
    model = _bare(8, 2)
    with torch.no_grad():
        model.attn.qkv_proj.weight[0:16] = 0  # W_q = W_k = 0: all scores equal
        model.attn.qkv_proj.bias[0:16] = 0
    x = torch.randn(2, 7, 8)
    (layer,) = head_diversity(model, [_batch(x)])
    np.testing.assert_allclose(layer.attention_diversity, 0.0, atol=1e-15)
    imp = head_importance(model, [_batch(x)], _sum_sq_loss)
    np.testing.assert_allclose(imp.entropy[0], math.log(7), rtol=1e-6)  # float32 probabilities 1/7


def test_uniform_attention_entropy_counts_only_valid_keys_and_queries():
    model = _seq2seq()
    attn = model.encoder.blocks[0].attn
    with torch.no_grad():
        attn.qkv_proj.weight[: 2 * attn.attn_dim] = 0
        attn.qkv_proj.bias[: 2 * attn.attn_dim] = 0
    src, tgt = _pairs(5)
    batch = _s2s_batch(src, tgt, extra_pad=2)
    imp = head_importance(model, [batch], translation_loss)
    lengths = np.array([len(s) for s in src])
    expected = (lengths * np.log(lengths)).sum() / lengths.sum()  # mean over valid queries of log(T_valid)
    assert imp.names[0] == "encoder.blocks.0.attn"
    np.testing.assert_allclose(imp.entropy[0], expected, rtol=1e-6)
    (layer, *_) = head_diversity(model, [batch])
    np.testing.assert_allclose(layer.attention_diversity, 0.0, atol=1e-12)


def test_zeroed_head_has_zero_importance_and_no_ablation_effect():
    model = _bare(8, 2)
    with torch.no_grad():
        model.attn.out_proj.weight[:, 4:8] = 0  # head 1 never reaches the output
    x = torch.randn(3, 5, 8)
    imp = head_importance(model, [_batch(x), _batch(torch.randn(2, 5, 8))], _sum_sq_loss)
    assert imp.raw[0][1] == 0.0 and imp.raw[0][0] > 0
    np.testing.assert_allclose(imp.importance[0], [1.0, 0.0])
    assert model.attn.head_mask is None
    evaluate = lambda: {"score": float(model(x).square().mean())}  # noqa: E731
    result = ablation(model, evaluate, "score")
    assert result["names"] == ["attn"]
    assert result["per_head"][0][1] == result["baseline"]
    assert result["per_head"][0][0] != result["baseline"]
    assert model.attn.head_mask is None


# -- validity and batching -------------------------------------------------------------------------


def test_padding_changes_no_metric():
    model = _seq2seq()
    src, tgt = _pairs(6)
    tight, padded = _s2s_batch(src, tgt), _s2s_batch(src, tgt, extra_pad=3)
    assert padded["inputs"][0].shape[1] == tight["inputs"][0].shape[1] + 3
    _assert_same_diversity(head_diversity(model, [tight]), head_diversity(model, [padded]))
    loss = translation_loss
    a, b = head_importance(model, [tight], loss), head_importance(model, [padded], loss)
    assert a.n_tokens == b.n_tokens == sum(len(t) + 1 for t in tgt)
    for key in ("raw", "importance", "entropy"):
        for x, y in zip(getattr(a, key), getattr(b, key)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7, err_msg=key)


def test_diversity_does_not_depend_on_batching():
    model = _seq2seq()
    src, tgt = _pairs(8, seed=3)
    whole = head_diversity(model, [_s2s_batch(src, tgt)])
    halves = head_diversity(model, [_s2s_batch(src[:4], tgt[:4]), _s2s_batch(src[4:], tgt[4:])])
    _assert_same_diversity(whole, halves)


def test_matches_a_direct_reference_implementation():
    """Every metric recomputed with numpy loops from the model's own weights and hook tensors."""
    model = _seq2seq(seed=5)
    src, tgt = _pairs(4, seed=7)
    batch = _s2s_batch(src, tgt, extra_pad=1)
    got = {layer.name: layer for layer in head_diversity(model, [batch])}

    layers = attention_layers(model)
    store = {name: {} for name, _ in layers}
    handles = []
    for name, attn in layers:
        for point in ("q", "context", "head_out"):
            handles.append(getattr(attn, "hook_" + point).register_forward_hook(
                lambda m, a, o, n=name, p=point: store[n].__setitem__(p, o.detach().double().numpy())))
    with torch.no_grad():
        _, weights = model(*batch["inputs"], need_weights=True)
    for h in handles:
        h.remove()
    probs = {f"encoder.blocks.{i}.attn": w.self_attn for i, w in enumerate(weights["encoder"])}
    probs.update({f"decoder.blocks.{i}.self_attn": w.self_attn for i, w in enumerate(weights["decoder_self"])})
    probs.update({f"decoder.blocks.{i}.cross_attn": w.self_attn for i, w in enumerate(weights["decoder_cross"])})
    src_ok, tgt_ok = batch["masks"]["src"].numpy(), batch["masks"]["tgt"].numpy()

    for name, attn in layers:
        qv = src_ok if name.startswith("encoder") else tgt_ok
        kv = tgt_ok if "self_attn" in name else src_ok
        rec, a = store[name], probs[name].double().numpy()
        H = attn.n_heads
        rows = lambda t, i: np.stack([t[b, i, s] for b in range(t.shape[0]) for s in range(t.shape[2]) if qv[b, s]])  # noqa: E731
        ortho, nonortho, outdis = np.zeros((H, H)), np.zeros((H, H)), np.zeros((H, H))
        for i in range(H):
            for j in range(H):
                if i == j:
                    continue
                qi, qj = rows(rec["q"], i), rows(rec["q"], j)
                ci, cj = rows(rec["context"], i), rows(rec["context"], j)
                oi, oj = rows(rec["head_out"], i), rows(rec["head_out"], j)
                n = len(qi)
                ortho[i, j] = np.abs(qi.T @ qj).sum() / n
                nonortho[i, j] = np.linalg.norm(ci.T @ cj) / n
                cos = (oi * oj).sum(1) / (np.linalg.norm(oi, axis=1) * np.linalg.norm(oj, axis=1))
                outdis[i, j] = -cos.mean()
        attvar = np.zeros(H)
        for i in range(H):
            values = [np.var(a[b, i, qv[b], k]) for b in range(a.shape[0]) for k in range(a.shape[3]) if kv[b, k]]
            attvar[i] = np.mean(values)
        layer = got[name]
        np.testing.assert_allclose(layer.query_orthogonality, ortho, rtol=1e-9, err_msg=name)
        np.testing.assert_allclose(layer.context_nonorthogonality, nonortho, rtol=1e-9, err_msg=name)
        np.testing.assert_allclose(layer.output_dissimilarity, outdis, rtol=1e-9, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(layer.attention_diversity, attvar, rtol=1e-9, err_msg=name)
        norm = layer.context_nonorthogonality_normalized
        assert np.all((norm >= 0) & (norm <= 1))
        assert layer.n_positions == int(qv.sum())


def test_mask_routing_by_module_name():
    m = {"src": "S", "tgt": "T"}
    assert module_masks("encoder.blocks.3.attn", m) == ("S", "S")
    assert module_masks("decoder.blocks.0.self_attn", m) == ("T", "T")
    assert module_masks("decoder.blocks.0.cross_attn", m) == ("T", "S")
    assert module_masks("encoder.blocks.0.attn", {}) == (None, None)
    assert module_masks("attn", {"attn": ("q", "k")}) == ("q", "k")
    with pytest.raises(ValueError, match="no mask rule"):
        module_masks("body.attn", m)


def test_single_head_layer_has_nan_pairwise_scalars():
    (layer,) = head_diversity(_bare(8, 1), [_batch(torch.randn(2, 4, 8))])
    s = layer.scalars()
    assert all(math.isnan(s[k]) for k in METRICS[:4])
    assert math.isfinite(s["attention_diversity"])


def test_hooks_and_masks_are_removed_after_an_error():
    model = _bare(8, 2)
    model.train()

    def failing(model, batch):
        model(*batch["inputs"])
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        head_importance(model, [_batch(torch.randn(1, 3, 8))], failing)
    attn = model.attn
    assert attn.head_mask is None and model.training
    for m in (attn, attn.hook_q, attn.hook_context, attn.hook_head_out):
        assert not m._forward_hooks and not m._forward_pre_hooks


# -- pruning ---------------------------------------------------------------------------------------


def test_pruning_steps_round_half_up_and_end_at_all_heads():
    assert pruning_steps(10, 0.1) == list(range(11))
    assert pruning_steps(7, 0.1) == [0, 1, 1, 2, 3, 4, 4, 5, 6, 6, 7]
    assert pruning_steps(4, 0.3) == [0, 1, 2, 4, 4]  # k = 0..ceil(1/0.3), clipped to all heads
    with pytest.raises(ValueError):
        pruning_steps(4, 0.0)


def test_pruning_curve_masks_least_important_heads_first():
    model = _seq2seq()
    src, tgt = _pairs(6)
    batch = _s2s_batch(src, tgt)
    loss = translation_loss
    imp = head_importance(model, [batch], loss)
    total = imp.total_heads
    assert total == 2 + 4 + 2 + 2
    masked_counts = []

    def evaluate():
        masks = [attn.head_mask for _, attn in attention_layers(model)]
        masked_counts.append(sum(int((m == 0).sum()) for m in masks if m is not None))
        with torch.no_grad():
            value, n = loss(model, batch)
        return {"loss": float(value) / n}

    baseline = evaluate()["loss"]
    curve = pruning_curve(model, imp, evaluate, "loss")
    assert len(curve) == 11
    assert curve[0] == {"fraction": 0.0, "heads_pruned": 0, "loss": baseline, "pruned": []}
    pruned = [p["heads_pruned"] for p in curve]
    assert pruned == sorted(pruned) and pruned[-1] == total
    assert masked_counts[1:] == pruned  # each evaluation saw exactly that many heads masked
    assert [tuple(x) for x in curve[-1]["pruned"]] == imp.order()
    least = min(((li, h) for li, v in enumerate(imp.importance) for h in range(len(v))), key=lambda t: imp.importance[t[0]][t[1]])
    assert tuple(curve[1]["pruned"][0]) == least
    assert curve[-1]["loss"] != baseline
    assert all(attn.head_mask is None for _, attn in attention_layers(model))


# -- the real task ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_tiny_vit_run_end_to_end(cifar_dir):
    from headsearch.tasks import DataSource, apply_overrides, get_task, resolve_config

    task = get_task("vit-cifar10")
    cfg = apply_overrides(task, resolve_config(task, preset="tiny"), {"data": {"train_limit": 500, "val_size": 200, "test_limit": 200}})
    bound = task.setup(cfg, DataSource(data_dir=cifar_dir), torch.device("cpu"))
    torch.manual_seed(0)
    model = bound.build_model()
    batches = analysis_batches(bound, "val", samples=48, batch_size=32)
    assert [len(b["targets"]) for b in batches] == [32, 16]
    heads = cfg.arch.enc_heads

    layers = head_diversity(model, batches)
    assert [layer.name for layer in layers] == [f"encoder.blocks.{i}.attn" for i in range(len(heads))]
    for layer, h in zip(layers, heads):
        assert layer.n_positions == 48 * 65
        for key in METRICS[:4]:
            m = getattr(layer, key)
            assert m.shape == (h, h) and np.all(np.isfinite(m))
        assert layer.attention_diversity.shape == (h,) and np.all(np.isfinite(layer.attention_diversity))
        assert all(math.isfinite(v) for v in layer.scalars().values())

    imp = head_importance(model, batches, bound.summed_loss)
    assert imp.n_tokens == 48
    for vec, raw, ent, h in zip(imp.importance, imp.raw, imp.entropy, heads):
        assert vec.shape == raw.shape == ent.shape == (h,)
        assert np.all(np.isfinite(raw)) and np.linalg.norm(vec) == pytest.approx(1.0)
        assert np.all((ent > 0) & (ent <= math.log(65) + 1e-9))

    small = bound.with_eval_limit(64)
    curve = pruning_curve(model, imp, lambda: small.evaluate(model, "val"), "accuracy")
    assert len(curve) == 11 and curve[-1]["heads_pruned"] == sum(heads)
    model.eval()
    with torch.no_grad():
        assert curve[0]["accuracy"] == small.evaluate(model, "val")["accuracy"]
    assert all(0.0 <= p["accuracy"] <= 1.0 for p in curve)


def test_real_tiny_translation_adapter_masks_and_losses(spa_file, tmp_path, monkeypatch):
    from headsearch.tasks import DataSource, apply_overrides, get_task, resolve_config

    monkeypatch.setenv("HEADSEARCH_CACHE", str(tmp_path))
    task = get_task("translation-en-es")
    cfg = apply_overrides(task, resolve_config(task, preset="tiny"), {
        "arch": {"d_model": 32, "enc_layers": 1, "enc_heads": 2, "dec_layers": 1, "dec_heads": 2, "d_ff": 64},
        "data": {"train_limit": 200, "val_size": 40, "test_size": 20, "max_len": 16, "vocab_size": 300},
    })
    bound = task.setup(cfg, DataSource(data_file=spa_file), torch.device("cpu"))
    torch.manual_seed(0)
    model = bound.build_model()
    batches = analysis_batches(bound, "val", samples=24, batch_size=8)
    assert sum(len(b["targets"]) for b in batches) == 24
    for b in batches:
        src, tgt_in = b["inputs"]
        assert torch.equal(b["masks"]["src"], src != PAD) and torch.equal(b["masks"]["tgt"], tgt_in != PAD)
        assert torch.equal(b["targets"] != PAD, tgt_in != PAD)  # tgt_out is tgt_in shifted: same valid positions

    layers = head_diversity(model, batches)
    assert [x.name for x in layers] == ["encoder.blocks.0.attn", "decoder.blocks.0.self_attn", "decoder.blocks.0.cross_attn"]
    n_src = sum(int(b["masks"]["src"].sum()) for b in batches)
    n_tgt = sum(int(b["masks"]["tgt"].sum()) for b in batches)
    assert [x.n_positions for x in layers] == [n_src, n_tgt, n_tgt]
    assert [x.n_keys for x in layers] == [n_src, n_tgt, n_src]
    for layer in layers:
        assert all(math.isfinite(v) for v in layer.scalars().values())

    imp = head_importance(model, batches, bound.summed_loss)
    assert imp.n_tokens == n_tgt
    assert all(np.all(np.isfinite(v)) and v.shape == (2,) for v in imp.raw + imp.entropy)
    small = bound.with_eval_limit(6)
    result = ablation(model, lambda: small.evaluate(model, "val"), "loss")
    assert len(result["per_head"]) == 3 and all(len(row) == 2 for row in result["per_head"])
    assert all(attn.head_mask is None for _, attn in attention_layers(model))
