"""The GPU fast path, on the CPU: step modes, regional compiling and its warm-up outside the timings,
the step written for a CUDA graph (device-side learning rate, capturable optimizer, bookkeeping in
device tensors) run uncaptured against the eager step, no host syncs inside a step, fallbacks,
channels-last. The capture itself needs a GPU (benchmarks/trainer_step.py measures it there); what
surrounds it runs here.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from headsearch.errors import ConfigError, Diverged
from headsearch.tasks import DataSource, Task, apply_overrides, get_task, translation_data, resolve_config
from headsearch.training import train_run, trainer
from headsearch.training import preflight
from headsearch.training.fastpath import StepMode, check_compile, compile_blocks, resolve_mode
from headsearch.training.steps import (
    CaptureMismatch, EagerSteps, GraphSteps, StepState, batch_tensors, clone_batch, lr_multiplier, lr_multiplier_tensor,
    STRAY_FRACTION, STRAY_STEPS, signature, verify_step, weights_apart,
)
from headsearch.training.prepare import fallbacks, prepare_steps
from headsearch.training.runtime import steps_per_epoch
from headsearch.training.trainer import fit

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


def make_steps_for(cls, bound, cfg, mode, model=None, step_model=None):
    torch.manual_seed(cfg.seed)
    model = model if model is not None else bound.build_model()
    spe = steps_per_epoch(bound, cfg.train)
    return cls(model, step_model or model, bound, cfg.train, torch.device("cpu"), mode, spe)


EAGER, GRAPHS = StepMode("off", None, False), StepMode("graphs", None, True)


# ------------------------------------------------------------------------------------------ step modes


@pytest.mark.floor
@pytest.mark.parametrize("mode, device, static, expected", [
    ("auto", "cpu", True, ("off", None, False)),
    ("auto", "cuda", True, ("reduce-overhead", "default", True)),
    ("auto", "cuda", False, ("default", "default", False)),  # a task without fixed shapes: no graphs
    ("off", "cuda", True, ("off", None, False)),
    ("graphs", "cuda", True, ("graphs", None, True)),
    ("graphs", "cpu", True, ("graphs", None, False)),  # no CUDA graphs on the CPU
    ("default", "cuda", True, ("default", "default", False)),
    ("reduce-overhead", "cpu", True, ("reduce-overhead", "default", False)),
    ("max-autotune", "cuda", True, ("max-autotune", "max-autotune-no-cudagraphs", True)),
])
def test_each_mode_resolves_to_a_model_and_a_graph_choice(mode, device, static, expected):
    task = dataclasses.replace(VIT, static_shapes=static)
    resolved = resolve_mode(vit_config({"compile": mode}).train, task, torch.device(device))
    assert (resolved.name, resolved.inductor, resolved.cuda_graph) == expected


@pytest.mark.floor
def test_the_default_is_auto_and_the_fallbacks_end_eager():
    assert vit_config().train.compile == "auto"
    fast = StepMode("reduce-overhead", "default", True)
    assert [m.name for m in fallbacks(fast)] == ["reduce-overhead", "graphs", "off"]
    assert [m.name for m in fallbacks(StepMode("default", "default", False))] == ["default", "off"]
    assert [m.name for m in fallbacks(EAGER)] == ["off"]
    assert fast.describe() == "reduce-overhead: compiled blocks (default), whole step in a CUDA graph"


def test_graph_modes_are_refused_for_a_task_whose_shapes_vary():
    silent = dataclasses.replace(VIT, static_shapes=False, shape_note=Task.shape_note)
    for mode in ("graphs", "reduce-overhead", "max-autotune"):
        with pytest.raises(ConfigError, match=f"compile: {mode} captures CUDA graphs, which need static shapes;"
                                              " this task's batches vary in shape: use compile: default"):
            check_compile(vit_config({"compile": mode}).train, silent)
    for mode in ("auto", "off", "default"):
        check_compile(vit_config({"compile": mode}).train, silent)
    # fit itself refuses too, for library callers: before the model is built.
    unbuildable = SimpleNamespace(cfg=vit_config({"compile": "graphs"}), build_model=lambda: pytest.fail("the model was built"))
    with pytest.raises(ConfigError, match="need static shapes"):
        fit(silent, unbuildable, device=torch.device("cpu"))


# ------------------------------------------------------------------- the learning rate as a tensor


@pytest.mark.parametrize("total, warmup, schedule, floor", [
    (110, 10, "cosine", 0.1), (8, 0, "cosine", 0.0), (100, 4, "constant", 0.0), (50, 0, "constant", 0.3), (7, 7, "cosine", 0.2),
])
def test_the_device_learning_rate_equals_the_host_one(total, warmup, schedule, floor):
    for s in range(total + 5):
        on_device = lr_multiplier_tensor(torch.tensor(s), total, warmup, schedule, floor)
        assert float(on_device) == pytest.approx(lr_multiplier(s, total, warmup, schedule, floor), rel=1e-12, abs=1e-12)


# ---------------------------------------------------------------- the step written for a CUDA graph


def test_the_graph_step_trains_like_the_eager_step(cifar):
    """20 steps with a warm-up and a cosine schedule: the device-side schedule and the fused,
    tensor-lr AdamW give the eager step's losses (float32, relative 1e-5) and weights (to 2% of one step)."""
    cfg = vit_config({"max_steps_per_epoch": 20, "warmup_epochs": 0.2, "schedule": "cosine", "min_lr_ratio": 0.1,
                      "lr": 3e-3, "weight_decay": 0.05, "grad_clip": 1.0}, data={"train_limit": 2000})
    bound = VIT.setup(cfg, cifar, "cpu")
    eager, graph = make_steps_for(EagerSteps, bound, cfg, EAGER), make_steps_for(GraphSteps, bound, cfg, GRAPHS)
    assert all(torch.equal(a, b) for a, b in zip(eager.model.parameters(), graph.model.parameters()))
    batches = list(itertools.islice(bound.train_batches(1), 20))
    for i, batch in enumerate(batches):
        assert eager.lr() == pytest.approx(graph.lr(), rel=1e-12)
        eager_lr = eager.optimizer.param_groups[0]["lr"]  # what this step uses (the scheduler moves it after)
        assert eager.step(batch) == graph.step(batch) == 64
        assert float(graph.lr_tensor) == pytest.approx(eager_lr, rel=1e-6)  # computed on the device, in the step
        assert float(graph.state.last_loss) == pytest.approx(float(eager.state.last_loss), rel=1e-5), f"step {i + 1}"
    assert int(graph.state.step) == int(eager.state.step) == 20
    assert float(graph.state.loss_sum) == pytest.approx(float(eager.state.loss_sum), rel=1e-5)
    # Adam moves every weight by about lr a step, whatever its gradient's size: float noise in a small
    # gradient shows up as a fraction of one step, never as a drift.
    with torch.no_grad():
        assert max(float((a - b).abs().max()) for a, b in zip(eager.model.parameters(), graph.model.parameters())) < 0.02 * cfg.train.lr


class NoHostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any operation that reads a tensor's value back to the host (item, bool, int, nonzero):
    on a GPU each would wait for the device, and none can be captured in a CUDA graph."""

    READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique", "aten::item"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.READS:
            raise AssertionError(f"{func._schema.name} reads the device inside a step")
        return func(*args, **(kwargs or {}))


def test_a_vit_step_never_reads_the_device(cifar):
    cfg = vit_config({"grad_clip": 1.0, "warmup_epochs": 0.5, "schedule": "cosine"},
                     data={"augment": ["resized_crop", "flip", "pad_crop"]})
    bound = VIT.setup(cfg, cifar, "cpu")
    steps = make_steps_for(GraphSteps, bound, cfg, GRAPHS)
    batch = next(iter(bound.train_batches(1)))
    steps.step(batch)  # Adam's state exists after a first step, as it does before any capture
    with NoHostReads():
        steps.step_body(clone_batch(batch))
    with pytest.raises(AssertionError, match="reads the device"), NoHostReads():
        steps.state.check_finite(1)  # the detector works: this one does read


def test_translation_with_fixed_lengths_trains_in_graph_steps_of_warmed_up_shapes_only(translation_bound):
    """The CUDA setup of translation, on the CPU: padded to fixed lengths (data.buckets, the CUDA default),
    the warm-up sees every shape an epoch shows (so every step would replay a graph), and the graph-ready
    step (device learning rate, fused AdamW, gradient clipping) trains like the eager one."""
    cfg = apply_overrides(TRANSLATION, translation_config({"grad_clip": 1.0, "schedule": "cosine", "warmup_epochs": 0.3,
                                                          "lr": 2e-3}),
                          {"data": {"buckets": [8, 12, 16]}, "arch": {"dropout": 0.0}})  # the two draw masks in turn
    bound = translation_bound.rebind(cfg)
    graph = make_steps_for(GraphSteps, bound, cfg, GRAPHS)
    spe = steps_per_epoch(bound, cfg.train)
    graph.warm_up(bound.warmup_batches(spe))
    epoch = list(bound.train_batches(1))
    assert {signature(b) for b in epoch} <= set(graph.graphs)  # no shape left for an uncaptured step
    assert len(graph.graphs) <= 4  # three lengths and the last, partial batch
    eager = make_steps_for(EagerSteps, bound, cfg, EAGER)
    for i, batch in enumerate(epoch[:12]):
        assert eager.step(batch) == graph.step(batch)
        assert float(graph.state.last_loss) == pytest.approx(float(eager.state.last_loss), rel=1e-5), f"step {i + 1}"
    with NoHostReads():
        graph.step_body(clone_batch(epoch[0]))


def test_warm_up_captures_each_shape_and_leaves_weights_optimizer_steps_and_rng_as_they_were(cifar):
    cfg = vit_config({"schedule": "cosine"}, arch={"dropout": 0.1})  # dropout draws from the global RNG
    bound = VIT.setup(cfg, cifar, "cpu")
    steps = make_steps_for(GraphSteps, bound, cfg, GRAPHS)
    weights = {k: v.clone() for k, v in steps.model.state_dict().items()}
    rng = torch.get_rng_state()
    warm = bound.warmup_batches(steps_per_epoch(bound, cfg.train))
    seconds = steps.warm_up(warm)
    assert seconds > 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, weights[k]) for k, v in steps.model.state_dict().items())
    assert steps.optimizer.state  # the warm-up stepped, so the state exists (a graph would hold it) ...
    for state in steps.optimizer.state.values():  # ... and is back at its start
        assert all(not v.any() for v in state.values() if isinstance(v, torch.Tensor))
    assert int(steps.state.step) == 0 and int(steps.state.first_bad) == -1 and steps.steps_taken == 0
    assert set(steps.graphs) == {signature(b) for b in warm} and len(steps.graphs) == 2  # 64 and the last 44


@pytest.mark.parametrize("warmup_epochs", [0, 1])
def test_a_captured_step_is_checked_against_the_uncaptured_one(cifar, warmup_epochs):
    """verify_step, which runs after capture on a GPU: a replay that computes the step agrees; one that
    computes something else (other labels, a step skipped, a doubled learning rate) is a CaptureMismatch,
    so the trainer falls back instead of training quietly wrong. Here the "replay" is the step itself.
    Under learning-rate warm-up the first step is 1/5 of lr here (5 steps an epoch): the tolerance follows it."""
    cfg = vit_config({"schedule": "cosine", "lr": 3e-3, "warmup_epochs": warmup_epochs})
    bound = VIT.setup(cfg, cifar, "cpu")
    steps = make_steps_for(GraphSteps, bound, cfg, GRAPHS)
    batch = next(iter(bound.train_batches(1)))
    weights = [p.detach().clone() for p in steps.model.parameters()]

    def other_labels(b):
        x, y, u = b
        return steps.step_body((x, (y + 1) % 10, u))

    def doubled_lr(b):
        n = steps.step_body(b)
        with torch.no_grad():
            for p, w in zip(steps.model.parameters(), weights):
                p.add_(p - w)  # as if the update had been twice as large
        return n

    with steps.restored_afterwards() as start:
        verify_step(steps, steps.step_body, batch, start)
        for wrong in (other_labels, lambda b: 64, doubled_lr):
            with pytest.raises(CaptureMismatch, match="the captured step gave loss"):
                verify_step(steps, wrong, batch, start)
    assert all(torch.equal(p, w) for p, w in zip(steps.model.parameters(), weights))  # and put back


def test_a_few_flipped_signs_pass_the_check_and_many_do_not(cifar):
    """A nondeterministic kernel can flip the sign of a near-zero gradient between two runs of the same step:
    Adam then leaves that weight two steps from the uncaptured one (seen on an H200 for tiny translation,
    weights 1.07e-05 apart at a first step of 5.3e-06). A capture with a few such weights is correct; one
    where many weights went the other way, or one weight went far, is not."""
    cfg = vit_config({"schedule": "cosine", "lr": 3e-3, "warmup_epochs": 0})
    bound = VIT.setup(cfg, cifar, "cpu")
    steps = make_steps_for(GraphSteps, bound, cfg, GRAPHS)
    batch = next(iter(bound.train_batches(1)))
    weights = [p.detach().clone() for p in steps.model.parameters()]
    total = sum(w.numel() for w in weights)
    largest = max(range(len(weights)), key=lambda i: weights[i].numel())

    def flipped(count, steps_away=2.0):
        def replay(b):
            n = steps.step_body(b)
            with torch.no_grad():  # `count` weights of the largest matrix land `steps_away` steps off
                p = list(steps.model.parameters())[largest].view(-1)
                p[:count] += steps_away * steps.lr(0)
            return n
        return replay

    few = int(STRAY_FRACTION * total)
    with steps.restored_afterwards() as start:
        verify_step(steps, flipped(few), batch, start)
        for wrong in (flipped(few + 1 + total // 100), flipped(1, steps_away=STRAY_STEPS + 1)):
            with pytest.raises(CaptureMismatch, match="beyond half a step"):
                verify_step(steps, wrong, batch, start)
    assert weights_apart([torch.tensor([0.0, 1.0, 3.0])], [torch.zeros(3)], 0.5) == (3.0, 2, 3)


def test_batch_tensors_and_clones_keep_fields_in_order():
    @dataclasses.dataclass
    class Pair:
        a: torch.Tensor
        n: int
        b: torch.Tensor

    pair = Pair(torch.ones(2, 3), 7, torch.zeros(4, dtype=torch.long))
    twin = clone_batch(pair)
    assert twin.n == 7 and [t.shape for t in batch_tensors(twin)] == [(2, 3), (4,)]
    assert twin.a.data_ptr() != pair.a.data_ptr() and torch.equal(twin.a, pair.a)
    assert signature(pair) == (((2, 3), torch.float32), ((4,), torch.long))
    triple = (torch.ones(1), torch.ones(2), torch.ones(3))
    assert [t.shape[0] for t in clone_batch(triple)] == [1, 2, 3] and isinstance(clone_batch(triple), tuple)


def test_the_eager_step_records_the_first_non_finite_loss():
    state = StepState.on(torch.device("cpu"))
    for loss in (1.0, 2.0, float("nan"), float("inf"), 3.0):
        state.record(torch.tensor(loss), 4)
    assert int(state.step) == 5 and int(state.first_bad) == 3 and math.isnan(float(state.bad_loss))
    with pytest.raises(Diverged, match="step 3"):
        state.check_finite(1)


# ---------------------------------------------------------------------------- regional compiling


@pytest.mark.floor
def test_compiled_blocks_share_the_weights_and_leave_the_model_eager(cifar):
    bound = VIT.setup(vit_config(), cifar, "cpu")
    model = bound.build_model()
    twin = compile_blocks(model, StepMode("default", "default", False), dynamic=None)
    assert twin is not model and twin.encoder is not model.encoder
    assert all(isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in twin.encoder.blocks)
    assert not any(isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in model.encoder.blocks)
    assert [p.data_ptr() for p in twin.parameters()] == [p.data_ptr() for p in model.parameters()]
    assert twin.patch_embed is model.patch_embed and twin.head is model.head
    assert compile_blocks(model, EAGER, dynamic=None) is model
    dynamo = torch._dynamo.config  # recompile_limit from torch 2.7 on, cache_size_limit before
    assert (getattr(dynamo, "recompile_limit", None) or dynamo.cache_size_limit) >= 256


@pytest.mark.floor
@pytest.mark.serial  # times its compile warm-up apart from training: nothing else may run beside it
@pytest.mark.slow
def test_a_compiled_run_matches_the_eager_one_and_times_its_warm_up_apart(cifar, tmp_path, monkeypatch):
    frames = torch._dynamo.utils.counters["frames"]
    seen = {}
    real_warm_up = EagerSteps.warm_up

    def timed_warm_up(self, batches):
        seconds = real_warm_up(self, batches)
        seen["frames"], seen["end"] = frames["total"], trainer.time.perf_counter()
        return seconds

    monkeypatch.setattr(EagerSteps, "warm_up", timed_warm_up)
    eager_dir, eager = train_run(vit_config({"compile": "off"}), cifar, tmp_path / "eager", device="cpu", argv=["test"])
    compiled_dir, compiled = train_run(vit_config({"compile": "default"}), cifar, tmp_path / "compiled", device="cpu",
                                       argv=["test"])
    returned = trainer.time.perf_counter()
    print(f"compile warm-up: {compiled.compile_seconds:.1f} s")

    assert eager.compile_seconds == 0.0 and "frames" in seen
    assert compiled.compile_seconds > 0 and compiled.step_note is None
    final = json.loads((compiled_dir / "final.json").read_text())
    assert final["compile_seconds"] == compiled.compile_seconds
    assert final["step_mode"] == "default: compiled blocks (default)"
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


@pytest.mark.processes
@pytest.mark.floor
@pytest.mark.slow
def test_a_worker_compiles_each_block_kind_once_across_trials(cifar, tmp_path, one_thread):
    """Four trials in one process (a search worker's life): [4, 4] and [8, 8] compile their block kinds;
    [8, 4] and [4, 8] are made of kinds already compiled and compile nothing: the fixed cost is paid per
    kind of block, not per trial."""
    frames = torch._dynamo.utils.counters["frames"]
    new_frames, warm_up = [], []
    for heads in ([4, 4], [8, 8], [8, 4], [4, 8]):
        cfg = vit_config({"compile": "default", "max_steps_per_epoch": 2}, data={"train_limit": 128},
                         arch={"enc_layers": 2, "enc_heads": heads})
        before = frames["ok"]
        _, result = train_run(cfg, cifar, tmp_path / "-".join(map(str, heads)), device="cpu", argv=["test"])
        new_frames.append(frames["ok"] - before)
        warm_up.append(result.compile_seconds)
        assert result.step_note is None
    # A new kind compiles one frame; torch 2.6 may serve the second head count from the first one's graph,
    # made dynamic, and compile none (measured: [1, 0] there, [1, 1] from 2.11 on). Known kinds: nothing.
    assert new_frames[0] == 1 and new_frames[1] <= 1 and new_frames[2:] == [0, 0], new_frames
    # Faster than the compiling trial (which may itself hit Inductor's on-disk cache from an earlier run).
    assert max(warm_up[2:]) < warm_up[0]


@pytest.mark.floor
def test_a_fast_path_that_fails_falls_back_with_one_note(cifar, monkeypatch):
    """A compiler error (injected: torch.compile raising, as on a machine whose toolchain is broken) costs the
    compiled mode, not the run: the step falls back to eager and says why in one line."""
    def broken(*args, **kwargs):
        raise RuntimeError("inductor could not find a C++ compiler\nsecond line")

    monkeypatch.setattr(torch, "compile", broken)
    cfg = vit_config({"compile": "default", "max_steps_per_epoch": 2})
    bound = VIT.setup(cfg, cifar, "cpu")
    model = bound.build_model()
    steps, seconds, note = prepare_steps(VIT, cfg.train, bound, model, torch.device("cpu"), 2)
    assert isinstance(steps, EagerSteps) and steps.mode.name == "off" and steps.step_model is model
    assert note == "default: compiled blocks (default) failed (RuntimeError: inductor could not find a C++ compiler second line)"
    assert "\n" not in note


# ---------------------------------------------------------------------------------- the warm-up


def test_warm_up_shapes_cover_the_last_partial_batch_only_when_an_epoch_reaches_it(cifar):
    bound = VIT.setup(vit_config(), cifar, "cpu")  # 300 images in batches of 64: 4 full and one of 44
    assert [len(b[1]) for b in bound.warmup_batches(5)] == [64, 44]
    assert [len(b[1]) for b in bound.warmup_batches(4)] == [64]  # max_steps_per_epoch 4: no partial batch
    even = VIT.setup(vit_config(data={"train_limit": 256}), cifar, "cpu")
    assert [len(b[1]) for b in even.warmup_batches(4)] == [64]
    small = VIT.setup(vit_config({"batch_size": 512}), cifar, "cpu")  # one batch, itself partial
    assert [len(b[1]) for b in small.warmup_batches(1)] == [300]


def test_the_warm_up_batch_leaves_the_vit_runs_data_order_untouched(cifar):
    cfg = vit_config()
    bound = VIT.setup(cfg, cifar, "cpu")
    untouched = VIT.setup(cfg, cifar, "cpu")
    warm = bound.warmup_batches(steps_per_epoch(bound, cfg.train))
    run = list(bound.train_batches(1))
    assert same_batches(run, untouched.train_batches(1))
    assert torch.equal(warm[0][0], run[0][0])  # the warm-up saw the run's first batch (same shape, same values)


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
    # Training batches: the same images and draws; the loss augments them in the channels-last layout.
    batch_on, batch_off = next(iter(on.train_batches(1))), next(iter(off.rebind(off.cfg).train_batches(1)))
    assert all(torch.equal(a, b) for a, b in zip(batch_on, batch_off))
    with torch.no_grad():
        loss_on, _ = on.loss(model_on, batch_on, 0.0)
        loss_off, _ = off.loss(model_off, batch_off, 0.0)
    assert float(loss_on) == pytest.approx(float(loss_off), rel=1e-5)


def test_a_channels_last_run_trains_like_the_default_layout_and_saves_a_plain_checkpoint(cifar, tmp_path):
    from safetensors.torch import load_file

    short = {"max_steps_per_epoch": 2}
    _, off = train_run(vit_config(short), cifar, tmp_path / "off", device="cpu", argv=["test"])
    on_dir, on = train_run(vit_config({**short, "channels_last": "on"}), cifar, tmp_path / "on", device="cpu", argv=["test"])
    assert on.history[0].train_loss == pytest.approx(off.history[0].train_loss, rel=1e-5)
    assert on.test_metrics["loss"] == pytest.approx(off.test_metrics["loss"], rel=1e-4)
    weight = load_file(str(on_dir / "model.safetensors"))["patch_embed.weight"]
    assert weight.is_contiguous()  # the standard layout on disk, whatever the training layout
