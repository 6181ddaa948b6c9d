"""StackedAdam: every slot of a stacked cohort parameter trains exactly as torch's own optimizer would train
that slot's model alone (the same lr schedule, clipping, weight decay), and a step never reads the device."""
from __future__ import annotations

import pytest
import torch

from headsearch.training.cohort_optim import StackedAdam
from headsearch.training.steps import lr_multiplier

# make test-oldest runs this module on the floor: torch's optimizer arithmetic (foreach kernels).
pytestmark = pytest.mark.floor

K = 3
SHAPES = [(5, 7), (7,), (2, 3, 4)]
BASE_LRS = [1e-2, 3e-3, 5e-2]  # a different base lr per slot
BETAS, EPS, WD = (0.9, 0.999), 1e-8, 0.05
STEPS = 20
TORCH_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}
# float64 agrees to rounding; float32 to a few ulps carried over the steps.
TOLERANCE = {torch.float64: dict(rtol=1e-6, atol=1e-9), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def stacked_params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((K,) + s, generator=gen, dtype=dtype).requires_grad_() for s in SHAPES]


class SoloSlot:
    """Slot k trained alone: leaf copies of its slices under torch's optimizer, as solo training runs it."""

    def __init__(self, stacked: list[torch.Tensor], k: int, kind: str):
        self.k = k
        self.params = [p.detach()[k].clone().requires_grad_() for p in stacked]
        self.optimizer = TORCH_OPTIMIZERS[kind](self.params, lr=BASE_LRS[k], betas=BETAS, eps=EPS, weight_decay=WD)

    def step(self, grads: list[torch.Tensor | None], lr: float, clip: float | None) -> None:
        for p, g in zip(self.params, grads):
            p.grad = None if g is None else g[self.k].clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()


def random_grads(params: list[torch.Tensor], gen: torch.Generator, scales=(0.01, 1.0, 10.0)) -> list[torch.Tensor]:
    """Gradients with a different size per slot: with max_norm 1, slot 0 stays under it and the others are clipped."""
    scale = torch.tensor(scales, dtype=params[0].dtype)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale.view((K,) + (1,) * (p.dim() - 1))
            for p in params]


def slot_lrs(step: int) -> list[float]:
    """Each slot's lr at `step`: its base lr under warm-up then cosine decay."""
    return [base * lr_multiplier(step, STEPS, 5, "cosine", 0.1) for base in BASE_LRS]


def assert_slot_matches(stacked: list[torch.Tensor], solo: SoloSlot, dtype: torch.dtype) -> None:
    for p, q in zip(stacked, solo.params):
        torch.testing.assert_close(p.detach()[solo.k], q.detach(), **TOLERANCE[dtype])


def stacked_step(opt: StackedAdam, params: list[torch.Tensor], grads: list[torch.Tensor | None], lrs: list[float],
                 clip: float | None) -> None:
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()
    if clip is not None:
        opt.clip_(clip)
    opt.step(torch.tensor(lrs, dtype=torch.float64))


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_each_slot_trains_as_torch_trains_it_alone(kind, dtype, clip):
    params = stacked_params(dtype)
    solos = [SoloSlot(params, k, kind) for k in range(K)]
    opt = StackedAdam(params, K, kind=kind, betas=BETAS, eps=EPS, weight_decay=WD)
    start = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        grads = random_grads(params, gen)
        lrs = slot_lrs(step)
        stacked_step(opt, params, grads, lrs, clip)
        for solo in solos:
            solo.step(grads, lrs[solo.k], clip)
    for solo in solos:
        assert_slot_matches(params, solo, dtype)
    assert all((p.detach() - s).abs().max() > 1e-3 for p, s in zip(params, start))  # they did move
    assert opt.step_count.tolist() == [STEPS] * K


def test_the_two_kinds_differ():
    """Adam's L2 decay and AdamW's decoupled decay give different parameters: each test above can tell them apart."""
    results = {}
    for k in ("adamw", "adam"):
        params = stacked_params(torch.float64)
        opt = StackedAdam(params, K, kind=k, weight_decay=WD)
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            stacked_step(opt, params, random_grads(params, gen), slot_lrs(step), None)
        results[k] = params[0].detach()
    assert (results["adamw"] - results["adam"]).abs().max() > 1e-6


def test_clipping_matches_clip_grad_norm_per_slot():
    params = stacked_params(torch.float64)
    gen = torch.Generator().manual_seed(2)
    grads = random_grads(params, gen)
    grads[1] = None  # a parameter without a gradient takes no part, as in clip_grad_norm_
    opt = StackedAdam(params, K)
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()
    norms = opt.clip_(1.0)
    assert norms.shape == (K,)
    for k in range(K):
        solo = [torch.zeros_like(g[k]).requires_grad_() if g is not None else torch.zeros(1, requires_grad=True)
                for g in grads]
        for q, g in zip(solo, grads):
            q.grad = None if g is None else g[k].clone()
        expected = torch.nn.utils.clip_grad_norm_(solo, 1.0)
        torch.testing.assert_close(norms[k], expected, rtol=1e-12, atol=0)
        for p, q in zip(params, solo):
            if q.grad is None:
                assert p.grad is None
            else:
                torch.testing.assert_close(p.grad[k], q.grad, rtol=1e-12, atol=0)
    assert norms[0] < 1.0 < norms[1] and norms[2] > 1.0
    # The slot under the threshold is multiplied by exactly 1; the others come out at norm 1.
    assert torch.equal(params[0].grad[0], grads[0][0]) and torch.equal(params[2].grad[0], grads[2][0])
    clipped = torch.stack([torch.linalg.vector_norm(p.grad.reshape(K, -1), dim=1) for p in (params[0], params[2])])
    torch.testing.assert_close(torch.linalg.vector_norm(clipped, dim=0)[1:], torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_a_reset_slot_trains_as_a_fresh_optimizer_while_the_others_go_on(kind):
    params = stacked_params(torch.float64)
    solos = [SoloSlot(params, k, kind) for k in range(K)]
    opt = StackedAdam(params, K, kind=kind, betas=BETAS, eps=EPS, weight_decay=WD)
    gen = torch.Generator().manual_seed(3)
    for step in range(10):
        grads, lrs = random_grads(params, gen), slot_lrs(step)
        stacked_step(opt, params, grads, lrs, None)
        for solo in solos:
            solo.step(grads, lrs[solo.k], None)
    opt.reset_slot(1)
    assert opt.step_count.tolist() == [10, 0, 10]
    assert all(not m[1].any() and not v[1].any() for m, v in zip(opt.exp_avg, opt.exp_avg_sq))
    solos[1] = SoloSlot(params, 1, kind)  # a new trial from the slot's current weights, fresh moments
    for step in range(10):
        grads = random_grads(params, gen)
        lrs = slot_lrs(10 + step)
        lrs[1] = slot_lrs(step)[1]  # the new trial starts its own schedule
        stacked_step(opt, params, grads, lrs, None)
        for solo in solos:
            solo.step(grads, lrs[solo.k], None)
    for solo in solos:
        assert_slot_matches(params, solo, torch.float64)
    assert opt.step_count.tolist() == [20, 10, 20]


def test_a_parameter_without_a_gradient_is_left_untouched():
    params = stacked_params(torch.float64)
    solos = [SoloSlot(params, k, "adamw") for k in range(K)]
    opt = StackedAdam(params, K, betas=BETAS, eps=EPS, weight_decay=WD)
    gen = torch.Generator().manual_seed(4)
    grads = random_grads(params, gen)
    stacked_step(opt, params, grads, slot_lrs(0), None)
    for solo in solos:
        solo.step(grads, slot_lrs(0)[solo.k], None)
    before = params[1].detach().clone()
    moments = (opt.exp_avg[1].clone(), opt.exp_avg_sq[1].clone())
    grads = random_grads(params, gen)
    grads[1] = None
    stacked_step(opt, params, grads, slot_lrs(1), None)
    for solo in solos:
        solo.step(grads, slot_lrs(1)[solo.k], None)
    assert torch.equal(params[1].detach(), before)  # no update, and no weight decay either
    assert torch.equal(opt.exp_avg[1], moments[0]) and torch.equal(opt.exp_avg_sq[1], moments[1])
    for solo in solos:
        assert_slot_matches(params, solo, torch.float64)  # the others stepped as torch steps them
    assert opt.step_count.tolist() == [2] * K  # the slots step together


def test_zero_grad_drops_the_gradients():
    params = stacked_params(torch.float32)
    for p in params:
        p.grad = torch.ones_like(p)
    StackedAdam(params, K).zero_grad()
    assert all(p.grad is None for p in params)


def test_a_parameter_needs_the_slot_axis_and_a_known_kind():
    with pytest.raises(ValueError, match="slot axis"):
        StackedAdam([torch.zeros(4, 2)], K)
    with pytest.raises(ValueError, match="kind"):
        StackedAdam([torch.zeros(K, 2)], K, kind="sgd")


class NoHostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any operation that reads a tensor's value back to the host: on a GPU each would wait for the
    device, and none can be captured in a CUDA graph."""

    READS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero", "aten::masked_select"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.READS:
            raise AssertionError(f"{func._schema.name} reads the device inside a step")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_a_step_never_reads_the_device(kind):
    params = stacked_params(torch.float32)
    opt = StackedAdam(params, K, kind=kind, weight_decay=WD)
    gen = torch.Generator().manual_seed(5)
    lr = torch.tensor(BASE_LRS)
    for p, g in zip(params, random_grads(params, gen)):
        p.grad = g
    with NoHostReads():
        opt.clip_(1.0)
        opt.step(lr)
        opt.reset_slot(1)
    with pytest.raises(AssertionError, match="reads the device"), NoHostReads():
        float(opt.step_count[0])  # the detector works: this one does read
