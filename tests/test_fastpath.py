"""The GPU fast path, on the CPU: torch.compile and its warm-up outside the timings, CUDA-graph
guards, channels-last. What needs a GPU (CUDA graphs, fused AdamW, bf16) is not run here; what the
trainer does around it (warm-up shapes, RNG, copies of kept tensors, refusals) is.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from headsearch.errors import ConfigError
from headsearch.tasks import DataSource, Task, apply_overrides, cifar_data, get_task, translation_data, resolve_config
from headsearch.training import train_run, trainer
from headsearch.training import preflight
from headsearch.training.fastpath import check_compile, kept_loss, mark_step, warm_up
from headsearch.training.trainer import autocast_context, fit, make_optimizer, steps_per_epoch

VIT = get_task("vit-cifar10")
TRANSLATION = get_task("translation-en-es")

# A ViT small enough to compile in seconds; 300 images = 4 batches of 64 and a partial one of 44.
TINY_VIT = {
    "seed": 0,
    "arch": {"d_model": 16, "enc_layers": 1, "enc_heads": 2, "d_ff": 32},
    "train": {"epochs": 1, "batch_size": 64},
    "data": {"train_limit": 300, "val_size": 200, "test_limit": 200},
}
TINY_TRANSLATION = {
    "seed": 0,
    "arch": {"d_model": 16, "enc_layers": 1, "enc_heads": 2, "dec_layers": 1, "dec_heads": 2, "d_ff": 32},
    "train": {"epochs": 1, "batch_size": 64},
    "data": {"train_limit": 1000, "val_size": 40, "test_size": 40, "max_len": 16, "vocab_size": 1000},
}


def vit_config(train=None, data=None, arch=None):
    over = json.loads(json.dumps(TINY_VIT))
    over["arch"].update(arch or {})
    over["train"].update(train or {})
    over["data"].update(data or {})
    return apply_overrides(VIT, resolve_config(VIT), over)


def translation_config(train=None):
    over = json.loads(json.dumps(TINY_TRANSLATION))
    over["train"].update(train or {})
    return apply_overrides(TRANSLATION, resolve_config(TRANSLATION), over)


@pytest.fixture(scope="module")
def cifar_arrays(cifar_dir):
    return cifar_data.load_cifar10(cifar_dir)


@pytest.fixture
def cifar(monkeypatch, cifar_dir, cifar_arrays) -> DataSource:
    """The real CIFAR-10 arrays, read from disk once for the module."""
    monkeypatch.setattr(cifar_data, "load_cifar10", lambda *a, **k: cifar_arrays)
    return DataSource(data_dir=cifar_dir)


@pytest.fixture(scope="module")
def translation_bound(spa_file, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HEADSEARCH_CACHE", str(tmp_path_factory.mktemp("cache")))
        return TRANSLATION.setup(translation_config(), DataSource(data_file=spa_file), "cpu")


def same_batches(a, b) -> bool:
    """Equal ViT (x, y) batches, or equal translation batches, in order."""
    a, b = list(a), list(b)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        pairs = zip(x, y) if isinstance(x, tuple) else ((x.src, y.src), (x.tgt_in, y.tgt_in), (x.tgt_out, y.tgt_out))
        if not all(p.shape == q.shape and torch.equal(p, q) for p, q in pairs):
            return False
    return True


# ------------------------------------------------------------------------------ a compiled CPU run


@pytest.mark.slow
def test_a_compiled_run_matches_the_eager_one_and_times_its_warm_up_apart(cifar, tmp_path, monkeypatch):
    frames = torch._dynamo.utils.counters["frames"]
    seen = {}

    def timed_warm_up(*args, **kwargs):
        seconds = warm_up(*args, **kwargs)
        seen["frames"], seen["end"] = frames["total"], trainer.time.perf_counter()
        return seconds

    monkeypatch.setattr(trainer, "warm_up", timed_warm_up)
    eager_dir, eager = train_run(vit_config(), cifar, tmp_path / "eager", device="cpu", argv=["test"])
    compiled_dir, compiled = train_run(vit_config({"compile": "default"}), cifar, tmp_path / "compiled", device="cpu",
                                       argv=["test"])
    returned = trainer.time.perf_counter()
    print(f"compile warm-up: {compiled.compile_seconds:.1f} s")

    assert eager.compile_seconds == 0.0 and "frames" in seen
    assert compiled.compile_seconds > 0
    final = json.loads((compiled_dir / "final.json").read_text())
    assert final["compile_seconds"] == compiled.compile_seconds
    # Every timing starts after the warm-up ended, so none of them holds it.
    assert compiled.train_seconds <= compiled.wall_seconds <= returned - seen["end"]
    assert compiled.best_train_seconds <= compiled.train_seconds
    assert final["samples_per_s"] == pytest.approx(final["samples"] / final["train_seconds"])
    # Both batch shapes (64 and the last 44) compiled in the warm-up: nothing recompiled while timed.
    assert frames["total"] == seen["frames"]
    # The warm-up changed neither the weights nor the data: the same training, to float tolerance.
    assert compiled.samples == eager.samples == 300
    for e, c in zip(eager.history, compiled.history):
        assert c.train_loss == pytest.approx(e.train_loss, rel=1e-4)
        assert c.metrics["loss"] == pytest.approx(e.metrics["loss"], rel=1e-4)
        assert c.metrics["accuracy"] == pytest.approx(e.metrics["accuracy"], abs=0.01)  # a near tie may flip
    assert compiled.test_metrics["loss"] == pytest.approx(eager.test_metrics["loss"], rel=1e-4)


# ---------------------------------------------------------------------------------- the warm-up


def test_warm_up_leaves_weights_gradients_and_the_global_rng_as_they_were(cifar):
    cfg = vit_config({"compile": "default"}, arch={"dropout": 0.1})  # dropout draws from the global RNG
    bound = VIT.setup(cfg, cifar, "cpu")
    model = bound.build_model()
    optimizer = make_optimizer(model, cfg.train, torch.device("cpu"))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    # The eager model stands in for the compiled one: what is checked is what the warm-up does around it.
    seconds = warm_up(model, optimizer, bound, bound.warmup_batches(5), cfg.train, torch.device("cpu"),
                      lambda: autocast_context(cfg.train, torch.device("cpu")))
    assert seconds > 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert not optimizer.state  # never stepped


def test_warm_up_shapes_cover_the_last_partial_batch_only_when_an_epoch_reaches_it(cifar):
    bound = VIT.setup(vit_config(), cifar, "cpu")  # 300 images in batches of 64: 4 full and one of 44
    assert [len(y) for _, y in bound.warmup_batches(5)] == [64, 44]
    assert [len(y) for _, y in bound.warmup_batches(4)] == [64]  # max_steps_per_epoch 4: no partial batch
    even = VIT.setup(vit_config(data={"train_limit": 256}), cifar, "cpu")
    assert [len(y) for _, y in even.warmup_batches(4)] == [64]
    small = VIT.setup(vit_config({"batch_size": 512}), cifar, "cpu")  # one batch, itself partial
    assert [len(y) for _, y in small.warmup_batches(1)] == [300]


def test_the_warm_up_batch_leaves_the_vit_runs_data_order_untouched(cifar):
    cfg = vit_config()
    bound = VIT.setup(cfg, cifar, "cpu")
    untouched = VIT.setup(cfg, cifar, "cpu")
    warm = bound.warmup_batches(steps_per_epoch(bound, cfg.train))
    run = list(bound.train_batches(1))
    assert same_batches(run, untouched.train_batches(1))
    assert torch.equal(warm[0][0], run[0][0])  # the warm-up saw the run's first batch (same shape, same values)


def test_the_warm_up_batch_leaves_the_translation_runs_data_order_untouched(translation_bound):
    cfg = translation_config({"compile": "default"})
    bound = translation_bound.rebind(cfg)
    before = list(bound.train_batches(1))
    warm = bound.warmup_batches(steps_per_epoch(bound, cfg.train))
    assert len(warm) == 1 and torch.equal(warm[0].src, before[0].src)
    assert same_batches(bound.train_batches(1), before)
    assert same_batches(bound.train_batches(2), translation_bound.rebind(cfg).train_batches(2))


# ------------------------------------------------------------------------------------- CUDA graphs


def test_reduce_overhead_for_translation_is_refused_before_anything_loads_or_trains(spa_file, tmp_path, monkeypatch):
    cfg = translation_config({"compile": "reduce-overhead"})
    expected = ("compile: reduce-overhead uses CUDA graphs, which need static shapes; translation batches vary in length:"
                " use compile: default")
    with pytest.raises(ConfigError) as e:
        preflight(TRANSLATION, cfg, DataSource(data_file=spa_file))
    assert str(e.value) == expected
    # train_run: before the corpus loads and before the run directory exists.
    monkeypatch.setattr(translation_data, "read_parallel_tsv", lambda *a, **k: pytest.fail("the corpus was read"))
    with pytest.raises(ConfigError, match="need static shapes"):
        train_run(cfg, DataSource(data_file=spa_file), tmp_path / "run", device="cpu")
    assert not (tmp_path / "run").exists()
    # fit itself, for library callers: before the model is built.
    unbuildable = SimpleNamespace(build_model=lambda: pytest.fail("the model was built"))
    with pytest.raises(ConfigError, match="need static shapes"):
        fit(TRANSLATION, cfg, unbuildable, device=torch.device("cpu"))


def test_static_shape_tasks_and_other_modes_are_not_refused():
    check_compile(vit_config({"compile": "reduce-overhead"}).train, VIT)
    for mode in ("off", "default", "max-autotune"):
        check_compile(translation_config({"compile": mode}).train, TRANSLATION)
    silent = dataclasses.replace(VIT, static_shapes=False, shape_note=Task.shape_note)  # a task that says nothing about its shapes
    with pytest.raises(ConfigError, match="batches vary in shape: use compile: default"):
        check_compile(vit_config({"compile": "reduce-overhead"}).train, silent)


def test_under_cuda_graphs_the_kept_loss_is_a_copy():
    loss = torch.tensor(1.5, requires_grad=True) * 2
    graphs, plain = vit_config({"compile": "reduce-overhead"}).train, vit_config({"compile": "default"}).train
    kept = kept_loss(loss, graphs)
    assert kept.data_ptr() != loss.data_ptr() and float(kept) == 3.0 and not kept.requires_grad
    assert kept_loss(loss, plain).data_ptr() == loss.data_ptr()  # no copy where nothing overwrites it
    mark_step(graphs)  # callable without a GPU
    mark_step(plain)


# ---------------------------------------------------------------------------------- channels-last


def test_channels_last_gives_the_same_logits_for_the_same_weights(cifar):
    off = VIT.setup(vit_config({"channels_last": "off"}), cifar, "cpu")
    on = off.rebind(vit_config({"channels_last": "on"}))
    torch.manual_seed(0)
    model_off = off.build_model().eval()
    model_on = on.build_model().eval()
    model_on.load_state_dict(model_off.state_dict())
    assert model_on.patch_embed.weight.is_contiguous(memory_format=torch.channels_last)
    assert model_off.patch_embed.weight.is_contiguous()
    x = off.eval_sets["val"].x[:64]
    x_on = on.layout(on.augment.normalize(x))
    assert x_on.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert torch.allclose(model_on(x_on), model_off(off.layout(off.augment.normalize(x))), atol=1e-5, rtol=0)
        metrics_on, metrics_off = on.evaluate(model_on, "val"), off.evaluate(model_off, "val")
    assert metrics_on["accuracy"] == metrics_off["accuracy"]
    assert metrics_on["loss"] == pytest.approx(metrics_off["loss"], abs=1e-5)
    # Training batches: the same augmented images, in the channels-last layout.
    (xb_on, yb_on), (xb_off, yb_off) = next(iter(on.train_batches(1))), next(iter(off.rebind(off.cfg).train_batches(1)))
    assert xb_on.is_contiguous(memory_format=torch.channels_last) and torch.equal(xb_on, xb_off)


def test_a_channels_last_run_trains_like_the_default_layout_and_saves_a_plain_checkpoint(cifar, tmp_path):
    from safetensors.torch import load_file

    short = {"max_steps_per_epoch": 2}
    _, off = train_run(vit_config(short), cifar, tmp_path / "off", device="cpu", argv=["test"])
    on_dir, on = train_run(vit_config({**short, "channels_last": "on"}), cifar, tmp_path / "on", device="cpu", argv=["test"])
    assert on.history[0].train_loss == pytest.approx(off.history[0].train_loss, rel=1e-5)
    assert on.test_metrics["loss"] == pytest.approx(off.test_metrics["loss"], rel=1e-4)
    weight = load_file(str(on_dir / "model.safetensors"))["patch_embed.weight"]
    assert weight.is_contiguous()  # the standard layout on disk, whatever the training layout
