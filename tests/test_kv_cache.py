"""Greedy decoding with a key/value cache gives exactly the tokens of the full recomputation.

`Seq2Seq.greedy_decode` runs only the new position through the decoder at each step, against cached
keys and values (cross-attention: the encoder memory's, computed once). The reference,
`use_cache=False`, recomputes the whole prefix at every step. They must agree token for token (not
"close") for every architecture the model supports: each skip kind (the scores skip carries the new
row's pre-softmax scores, mapped between head counts), each fusion (the soft branch's projected keys
are cached too), both soft scores, the running-mean scores skip, a non-uniform decoder head schedule,
dropout (eval mode) and head masks. The models are trained for a few steps on real Tatoeba pairs
(CC-BY 2.0 FR, tatoeba.org / manythings.org/anki), until their translations are varied and end at
different lengths; the decoded batch is padded.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from headsearch.config import ArchConfig
from headsearch.models import Seq2Seq
from headsearch.models.attention import KVCache
from headsearch.models.transformer import attention_layers
from headsearch.tasks import translation_data as td

N_PAIRS = 32
MAX_LEN = 24
# Non-uniform heads in both stacks; each count divides the next or is divided by it (scores skip).
BASE = dict(d_model=32, enc_layers=2, enc_heads=[2, 4], dec_layers=3, dec_heads=[4, 2, 8], d_ff=64,
            dropout=0.1, attn_dropout=0.1, activation="relu")


@pytest.fixture(scope="module")
def data(spa_file):
    """A padded batch of 32 real pairs of 3 to 10 words each (source (32, 16), target (32, 16))."""
    corpus = td.read_parallel_tsv(spa_file)
    rng = np.random.default_rng(0)
    short = [i for i in rng.permutation(len(corpus))[:4000]
             if 3 <= len(corpus.src[i].split()) <= 10 and len(corpus.tgt[i].split()) <= 10][:N_PAIRS]
    src_text, tgt_text = [corpus.src[i] for i in short], [corpus.tgt[i] for i in short]
    src_tok = td.train_tokenizer(src_text, 1000, min_frequency=1)
    tgt_tok = td.train_tokenizer(tgt_text, 1000, min_frequency=1)
    batcher = td.BucketBatcher(td.encode(src_tok, src_text), td.encode(tgt_tok, tgt_text), N_PAIRS, buckets=(8, 16, 24))
    (batch,) = batcher.batches(shuffle=False)
    return batch, src_tok.get_vocab_size(), tgt_tok.get_vocab_size()


def trained(data, steps: int = 40, dtype=torch.float32, **arch) -> Seq2Seq:
    """A model fitted to the batch for a few steps (with dropout), in eval mode."""
    batch, src_vocab, tgt_vocab = data
    torch.manual_seed(0)
    model = Seq2Seq(ArchConfig(**{**BASE, **arch}), src_vocab, tgt_vocab, MAX_LEN, td.PAD_ID).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = model(batch.src, batch.tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=td.PAD_ID)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def decode_both(model, src, limit: int = MAX_LEN - 1):
    cached = model.greedy_decode(src, td.SOS_ID, td.EOS_ID, max_new_tokens=limit)
    reference = model.greedy_decode(src, td.SOS_ID, td.EOS_ID, max_new_tokens=limit, use_cache=False)
    return cached, reference


def assert_varied(out: torch.Tensor) -> None:
    """Translations that exercise the cache: many different words, ending (EOS) at different steps."""
    ends = [row.index(td.EOS_ID) for row in out.tolist() if td.EOS_ID in row]
    assert len(set(out.flatten().tolist())) > 20, out
    assert len(set(ends)) >= 3 and len(ends) >= N_PAIRS // 2, ends


@pytest.mark.slow
@pytest.mark.parametrize("skip,fusion", list(itertools.product(["none", "output", "scores"], ["none", "hadamard", "add"])))
def test_cached_decoding_gives_exactly_the_reference_tokens(data, skip, fusion, one_thread):
    model = trained(data, skip=skip, fusion=fusion)
    cached, reference = decode_both(model, data[0].src)
    assert_varied(reference)
    assert cached.shape == reference.shape and torch.equal(cached, reference)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [
    dict(skip="scores", fusion="add", soft_score="key"),
    dict(skip="output", fusion="hadamard", soft_score="key", soft_dim=4),
    dict(skip="scores", skip_mean=True, fusion="hadamard"),
], ids=["scores-add-key", "output-hadamard-key-soft_dim", "scores-mean-hadamard"])
def test_cached_decoding_with_key_scores_soft_width_and_running_mean(data, arch, one_thread):
    cached, reference = decode_both(trained(data, **arch), data[0].src)
    assert_varied(reference)
    assert torch.equal(cached, reference)


@pytest.mark.slow
@pytest.mark.parametrize("skip,fusion", [("value", "none"), ("unet", "none"), ("dense", "hadamard"),
                                         ("none", "differential"), ("value", "differential"), ("scores", "differential")])
def test_cached_decoding_with_the_modern_skips_and_differential_attention(data, skip, fusion, one_thread):
    """The value residual mixes only the new position's values into the cache (the cross-attention's memory
    values at the first step); the stream skips and differential attention work per position."""
    cached, reference = decode_both(trained(data, skip=skip, fusion=fusion), data[0].src)
    assert_varied(reference)
    assert torch.equal(cached, reference)


@pytest.mark.slow
def test_cached_decoding_with_head_masks(data, one_thread):
    """Analysis masks heads (Attention.head_mask, Michel et al. 2019): the cache sees the same masks."""
    model = trained(data, skip="scores", fusion="add")
    masks = {"decoder.blocks.0.self_attn": [1.0, 0.0, 1.0, 1.0], "decoder.blocks.1.cross_attn": [0.0, 1.0],
             "decoder.blocks.2.self_attn": [1.0, 0.5, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0], "encoder.blocks.1.attn": [1.0, 1.0, 0.0, 1.0]}
    unmasked, _ = decode_both(model, data[0].src)
    for name, attn in attention_layers(model):
        if name in masks:
            attn.head_mask = torch.tensor(masks[name])
    cached, reference = decode_both(model, data[0].src)
    assert not torch.equal(reference, unmasked)  # the masks change the translations
    assert torch.equal(cached, reference)


@pytest.mark.slow
def test_cached_decoding_in_float64(data):
    model = trained(data, steps=25, dtype=torch.float64, skip="scores", fusion="hadamard")
    cached, reference = decode_both(model, data[0].src)
    assert torch.equal(cached, reference)


def test_each_cached_step_gives_the_full_passs_logits_at_that_position(data, one_thread):
    """decode_step's logits equal the full decoder's at the same position (float tolerance), and the
    caches hold each layer's own head count: (B, H, T, d_k) with H = 4, 2, 8."""
    model = trained(data, steps=10, skip="scores", fusion="add")
    src = data[0].src
    with torch.no_grad():
        memory, src_mask, _ = model.encode(src)
        ys = torch.full((src.shape[0], 1), td.SOS_ID)
        cache = model.decoder.empty_cache(12)
        for t in range(12):
            step_logits = model.decode_step(ys, memory, src_mask, cache)  # (B, V)
            full_logits, _, _ = model.decode(ys, memory, src_mask)  # (B, t + 1, V)
            torch.testing.assert_close(step_logits, full_logits[:, -1], rtol=1e-5, atol=1e-5)
            # Teacher-force a varied prefix with padding in it: the cache must mask PAD keys as decode does.
            nxt = data[0].tgt_out[:, t] if t < data[0].tgt_out.shape[1] else torch.full_like(ys[:, 0], td.PAD_ID)
            ys = torch.cat([ys, nxt[:, None]], dim=1)
    assert (ys == td.PAD_ID).any()
    for (self_cache, cross_cache), heads in zip(cache, [4, 2, 8]):
        assert self_cache.length == 12 and self_cache.k.shape == (src.shape[0], heads, 12, 32 // heads)
        assert cross_cache.length == src.shape[1] and cross_cache.v.shape == (src.shape[0], heads, src.shape[1], 32 // heads)
        assert self_cache.soft.shape == (src.shape[0], heads, 12, 32 // heads)  # soft_dim = d_k


def test_translations_do_not_depend_on_the_padding_or_on_how_often_the_end_is_checked(data, one_thread):
    model = trained(data, skip="output", fusion="none")
    src = data[0].src
    wider = F.pad(src, (0, 8), value=td.PAD_ID)  # the same sources padded to 8 more positions
    reference = model.greedy_decode(src, td.SOS_ID, td.EOS_ID, use_cache=False)
    assert torch.equal(model.greedy_decode(wider, td.SOS_ID, td.EOS_ID), reference)
    # On a GPU the stop flag is read every few tokens; the output is cut back to the same width.
    for limit, every in itertools.product((3, 7, MAX_LEN - 1), (1, 4, 5)):
        cached = model.greedy_decode(src, td.SOS_ID, td.EOS_ID, max_new_tokens=limit, check_every=every)
        ref = model.greedy_decode(src, td.SOS_ID, td.EOS_ID, max_new_tokens=limit, use_cache=False)
        assert ref.shape[1] <= limit and torch.equal(cached, ref)
    early = model.greedy_decode(src[:4], td.SOS_ID, td.EOS_ID, check_every=4)  # all end long before the limit
    assert early.shape[1] < MAX_LEN - 1 and torch.equal(early, model.greedy_decode(src[:4], td.SOS_ID, td.EOS_ID, use_cache=False))


def test_a_cache_refuses_positions_beyond_its_capacity():
    cache = KVCache(capacity=2)
    k = torch.randn(1, 2, 1, 4)
    cache.extend(k, k, None)
    k_all, v_all, soft = cache.extend(2 * k, 3 * k, None)
    assert k_all.shape == (1, 2, 2, 4) and soft is None
    torch.testing.assert_close(v_all[:, :, 1:], 3 * k)
    with pytest.raises(ValueError, match="holds 2 positions; position 2 does not fit"):
        cache.extend(k, k, None)
