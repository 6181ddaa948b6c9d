"""The translation task's batches: resident on the device, padded to a few fixed lengths, and padding
that changes nothing but the time.

On CUDA the task pads every batch to one of a few lengths (`TranslationData.bucket_lengths`), so a
training epoch shows a handful of shapes, each compiled and captured in a CUDA graph once; on the CPU
it pads each side of a batch to its own longest sentence. These tests set `data.buckets` to get the fixed lengths
on the CPU, and check that the loss, its gradients and the validation metrics are the same at either
padding, that the warm-up batches show every shape an epoch can, and that the loss never reads the
device (it runs on the meta device, where any read or data-dependent shape fails).
"""
from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch

from headsearch.errors import ConfigError
from headsearch.tasks import DataSource, apply_overrides, get_task, resolve_config
from headsearch.tasks.translation import TranslationData
from headsearch.tasks.translation_data import PAD_ID, bucket_ladder

TASK = get_task("translation-en-es")
LADDER = [8, 12, 16]  # bucket_ladder(16)


def config(tiny_translation, data=None, train=None, arch=None):
    over = copy.deepcopy(tiny_translation)
    over["data"].update(data or {})
    over["train"].update({"batch_size": 64, **(train or {})})
    over["arch"].update(arch or {})
    return apply_overrides(TASK, resolve_config(TASK), over)


@pytest.fixture(scope="module")
def bound(spa_file, tmp_path_factory, tiny_translation):
    """1,000 real pairs (max_len 16) on the CPU: each side of a batch padded to its longest sentence."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HEADSEARCH_CACHE", str(tmp_path_factory.mktemp("cache")))
        return TASK.setup(config(tiny_translation), DataSource(data_file=spa_file), "cpu")


@pytest.fixture(scope="module")
def fixed(bound, tiny_translation):
    """The same data padded to the CUDA default lengths, 8, 12 and 16."""
    return bound.rebind(config(tiny_translation, data={"buckets": LADDER}))


def test_data_buckets_default_by_device_and_are_checked():
    data = TranslationData(max_len=32)
    assert data.buckets is None and data.bucket_lengths("cuda") == bucket_ladder(32) == (8, 12, 16, 24, 32)
    assert data.bucket_lengths("cpu") is None  # the CPU pays for every padded position
    chosen = TranslationData(max_len=32, buckets=[10, 20.0])
    assert chosen.buckets == (10, 20) and chosen.bucket_lengths("cpu") == chosen.bucket_lengths("cuda") == (10, 20, 32)
    assert TranslationData(max_len=32, buckets=[16, 32]).bucket_lengths("cuda") == (16, 32)
    assert TranslationData.from_dict(chosen.to_dict()) == chosen  # YAML round trip (a list)
    example = "e.g. [8, 12, 16, 24, 32]"
    for value, message in [
        ([], f"data.buckets = [] must be a list of padded lengths, {example}, or null"),
        (16, f"data.buckets = 16 must be a list of padded lengths, {example}, or null"),
        ("8,16", f"data.buckets = '8,16' must be a list of padded lengths, {example}, or null"),
        ([8, 1.5], f"data.buckets = [8, 1.5] must hold whole numbers of tokens, {example}"),
        ([8, True], f"data.buckets = [8, True] must hold whole numbers of tokens, {example}"),
        ([16, 8], f"data.buckets = [16, 8] must be increasing lengths, {example}"),
        ([8, 8], f"data.buckets = [8, 8] must be increasing lengths, {example}"),
        ([8, 64], "data.buckets = [8, 64]: each length must be between 2 (a word and EOS) and max_len = 32"),
        ([1, 8], "data.buckets = [1, 8]: each length must be between 2 (a word and EOS) and max_len = 32"),
    ]:
        with pytest.raises(ConfigError) as e:
            TranslationData(max_len=32, buckets=value)
        assert str(e.value) == message


def test_fixed_lengths_give_a_few_shapes_all_shown_by_the_warm_up(fixed):
    """A CUDA graph per shape: the warm-up batches hold each shape an epoch shows, no other."""
    assert TASK.static_shapes
    n = fixed.n_train
    spe = fixed.batches_per_epoch()
    assert spe == -(-n // 64) and n % 64  # a partial batch
    warm = [tuple(b.src.shape) for b in fixed.warmup_batches(spe)]
    assert warm == [(64, 8), (64, 12), (64, 16), (n % 64, 16)]
    shown = {tuple(b.src.shape) for epoch in (1, 2, 3) for b in fixed.train_batches(epoch)}
    assert shown <= set(warm) and len(shown) >= 3
    # An epoch cut short (max_steps_per_epoch) never reaches the partial batch, which comes last.
    assert [tuple(b.src.shape) for b in fixed.warmup_batches(spe - 1)] == warm[:-1]
    assert all(b.src.shape[0] == 64 for b in list(fixed.train_batches(1))[:-1])


def test_the_warm_up_leaves_the_runs_data_order_untouched(fixed):
    before = [b.index.tolist() for b in fixed.train_batches(1)]
    fixed.warmup_batches(fixed.batches_per_epoch())
    assert [b.index.tolist() for b in fixed.train_batches(1)] == before
    assert [b.index.tolist() for b in fixed.train_batches(2)] != before  # (seed, epoch) orders each epoch


def test_the_same_batches_at_either_padding(bound, fixed):
    own, padded = list(bound.train_batches(1)), list(fixed.train_batches(1))
    assert [b.index.tolist() for b in own] == [b.index.tolist() for b in padded]
    assert all(p.src.shape[1] >= o.src.shape[1] for o, p in zip(own, padded))
    assert any(p.src.shape[1] > o.src.shape[1] for o, p in zip(own, padded))


@pytest.mark.parametrize("arch", [{}, {"skip": "scores", "fusion": "add"}, {"skip": "output", "fusion": "hadamard"}],
                         ids=["classic", "scores-add", "output-hadamard"])
def test_padding_to_a_bucket_changes_neither_the_loss_nor_its_gradients(bound, fixed, tiny_translation, arch, one_thread):
    cfg = config(tiny_translation, arch={"dropout": 0.0, **arch})
    torch.manual_seed(0)
    model = bound.rebind(cfg).build_model()  # no dropout: train mode is deterministic
    for own, padded in list(zip(bound.train_batches(1), fixed.train_batches(1)))[:4]:
        assert padded.src.shape[1] > own.src.shape[1] or padded.src.shape == own.src.shape
        results = []
        for batch in (own, padded):
            model.zero_grad()
            loss, n = bound.loss(model, batch, label_smoothing=0.1)
            loss.backward()
            results.append((loss.detach(), n, [p.grad.clone() for p in model.parameters()]))
        (l1, n1, g1), (l2, n2, g2) = results
        assert n1 == n2 == own.src.shape[0] and type(n2) is int
        torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6)
        for a, b in zip(g1, g2):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_the_loss_never_reads_the_device(fixed, tiny_translation):
    """On the meta device tensors have no values: any .item(), bool() or data-dependent shape raises."""
    cfg = config(tiny_translation, arch={"skip": "scores", "fusion": "hadamard"}, data={"buckets": LADDER})
    model = fixed.rebind(cfg).build_model().to("meta")
    batch = fixed.warmup_batches(fixed.batches_per_epoch())[-1]
    meta = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to("meta") for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})
    loss, n = fixed.loss(model, meta, label_smoothing=0.1)
    loss.backward()
    assert loss.device.type == "meta" and loss.shape == () and n == batch.src.shape[0]


def test_rebind_to_another_batch_size_shares_the_device_table(fixed, tiny_translation):
    other = fixed.rebind(config(tiny_translation, data={"buckets": LADDER}, train={"batch_size": 100}))
    assert other.batcher.table is fixed.batcher.table and fixed.batcher.batch_size == 64
    assert other.n_train == fixed.n_train and other.batches_per_epoch() == -(-fixed.n_train // 100)
    assert sum(b.src.shape[0] for b in other.train_batches(1)) == other.n_train
    assert [tuple(b.src.shape) for b in other.warmup_batches(other.batches_per_epoch())] == [
        (100, 8), (100, 12), (100, 16), (other.n_train % 100, 16)]


@pytest.mark.slow
def test_validation_metrics_are_the_same_at_either_padding_and_with_or_without_the_cache(bound, fixed, one_thread):
    torch.manual_seed(0)
    model = bound.build_model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(1, 9):  # 8 short epochs: translations that differ from one another
        for batch in bound.train_batches(epoch):
            loss, _ = bound.loss(model, batch, 0.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        own = bound.evaluate(model, "val")
        hyps = bound.last_outputs["val"]
        padded = fixed.evaluate(model, "val")
        model.greedy_decode = functools.partial(model.greedy_decode, use_cache=False)  # the reference decoder
        reference = bound.evaluate(model, "val")
    assert len(hyps) == len(bound.eval_sets["val"]["refs"]) == 40 and len(set(hyps)) > 10
    assert fixed.last_outputs["val"] == hyps == bound.last_outputs["val"]
    for name in ("bleu", "cer", "wer"):
        assert padded[name] == own[name] == reference[name]
    assert padded["loss"] == pytest.approx(own["loss"], rel=1e-5)
    eval_widths = {b.src.shape[1] for b in fixed.eval_batcher("val", 16).batches(shuffle=False)}
    assert eval_widths <= set(LADDER)
