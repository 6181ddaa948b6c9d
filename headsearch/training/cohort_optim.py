"""Adam and AdamW for a cohort: K models stacked on a leading slot axis, one independent optimizer per slot.

A cohort trains K small models as one stacked model: each parameter has shape (K, *solo_shape), slot k
being the k-th model's parameter. Each slot must train exactly as if it were trained alone by
`torch.optim.AdamW` / `torch.optim.Adam` (what `headsearch.training.steps.make_optimizer` builds for
solo training), so a trial's result does not depend on whether it shared a cohort. One torch optimizer
over the stacked tensors would not do: its learning rate, step count (bias corrections) and gradient
clipping are shared by the whole tensor. Here every per-slot quantity is a (K,) tensor on the device,
viewed as (K, 1, ..., 1) against each parameter:

- the learning rate: slots hold trials at different points of their schedules, with different base lrs;
- the step count: a slot refilled by a new trial (`reset_slot`) starts its bias corrections from step 1;
- the gradient norm for clipping (`clip_`): `clip_grad_norm_` over one model's gradients, per slot.

Nothing reads a tensor back to the host and all state is allocated once, in place thereafter, so a step
can be captured in a CUDA graph with the rest of the training step.

The formulas are torch's single-tensor ones (torch/optim/adam.py):
    AdamW: p *= 1 - lr * wd                   Adam: g = g + wd * p  (L2 decay in the gradient)
    m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
    p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
"""
from __future__ import annotations

from typing import Sequence

import torch

KINDS = ("adamw", "adam")


class StackedAdam:
    """Adam (L2 weight decay added to the gradient, as torch.optim.Adam) or AdamW (decoupled decay, as torch.optim.AdamW;
    Loshchilov & Hutter 2019) over parameters stacked on a leading slot axis: one independent optimizer per slot."""

    def __init__(self, params: Sequence[torch.Tensor], slots: int, *, kind: str = "adamw",
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        self.params = list(params)
        if not self.params:
            raise ValueError("StackedAdam needs at least one parameter")
        if kind not in KINDS:
            raise ValueError(f"kind = {kind!r} must be one of {KINDS}")
        for p in self.params:
            if p.dim() == 0 or p.shape[0] != slots:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} has no leading slot axis of size {slots}")
        self.slots, self.kind = slots, kind
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        device = self.params[0].device
        # Bias corrections 1 - beta^t are computed in float64 where the device has it: in float32,
        # 1 - 0.999 is off by 1e-5 relative, which the first steps' update would carry (torch uses Python floats).
        self._scalar_dtype = torch.float32 if device.type == "mps" else torch.float64
        self.step_count = torch.zeros(slots, dtype=self._scalar_dtype, device=device)
        self.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        # The shape a (K,) per-slot tensor takes to broadcast against each parameter.
        self._slot_shapes = [(slots,) + (1,) * (p.dim() - 1) for p in self.params]

    # -- the step ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, lr: torch.Tensor) -> None:
        """One step of every slot, slot k with learning rate lr[k] ((K,) on the params' device). Parameters
        without a gradient are left as they are; every slot's step count advances all the same, since the
        slots step together."""
        self.step_count.add_(1)
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return
        factors = self._slot_factors(lr)
        params = [self.params[i] for i in live]
        grads = [self.params[i].grad for i in live]
        exp_avg = [self.exp_avg[i] for i in live]
        exp_avg_sq = [self.exp_avg_sq[i] for i in live]
        per_slot = self._broadcaster(live, params)

        if self.weight_decay != 0:
            if self.kind == "adamw":
                torch._foreach_mul_(params, per_slot(factors["decay"]))
            else:
                grads = torch._foreach_add(grads, params, alpha=self.weight_decay)
        torch._foreach_lerp_(exp_avg, grads, 1 - self.beta1)
        torch._foreach_mul_(exp_avg_sq, self.beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - self.beta2)

        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, per_slot(factors["bias_correction2_sqrt"]))
        torch._foreach_add_(denom, self.eps)
        update = torch._foreach_div(exp_avg, denom)
        torch._foreach_addcmul_(params, update, per_slot(factors["neg_step_size"]))

    def _slot_factors(self, lr: torch.Tensor) -> dict[str, torch.Tensor]:
        """The (K,) per-slot numbers of this step, from the learning rates and each slot's own step count."""
        lr = lr.to(device=self.step_count.device, dtype=self._scalar_dtype)
        bias_correction1 = 1 - torch.pow(self.beta1, self.step_count)
        bias_correction2 = 1 - torch.pow(self.beta2, self.step_count)
        factors = {"neg_step_size": -(lr / bias_correction1), "bias_correction2_sqrt": bias_correction2.sqrt()}
        if self.kind == "adamw":
            factors["decay"] = 1 - lr * self.weight_decay
        return factors

    def _broadcaster(self, live: list[int], params: list[torch.Tensor]):
        """A function taking a (K,) factor to one (K, 1, ...) view per live parameter, in its dtype (a
        float64 factor would make a float32 update compute in float64). Casts once per dtype."""
        def per_slot(factor: torch.Tensor) -> list[torch.Tensor]:
            cast: dict[torch.dtype, torch.Tensor] = {}
            views = []
            for i, p in zip(live, params):
                if p.dtype not in cast:
                    cast[p.dtype] = factor.to(p.dtype)
                views.append(cast[p.dtype].view(self._slot_shapes[i]))
            return views
        return per_slot

    # -- clipping ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def clip_(self, max_norm: float) -> torch.Tensor:
        """`clip_grad_norm_` per slot: each slot's gradients, over all parameters that have one, scaled so that
        their 2-norm is at most max_norm. Returns each slot's norm before clipping, (K,).

        As torch: the norm of the per-parameter norms, coef = max_norm / (norm + 1e-6) clamped at 1, so a slot
        under the threshold is multiplied by exactly 1."""
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return torch.zeros(self.slots, device=self.step_count.device)
        grads = [self.params[i].grad for i in live]
        norms = [torch.linalg.vector_norm(g.reshape(self.slots, -1), 2, dim=1) for g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), 2, dim=0)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        views = self._broadcaster(live, grads)(coef)
        torch._foreach_mul_(grads, views)
        return total

    # -- slots -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def reset_slot(self, k: int) -> None:
        """Slot k as a fresh optimizer (moments and step count zero), for a new trial that takes the slot.
        In place: a captured graph keeps reading the same memory."""
        for m, v in zip(self.exp_avg, self.exp_avg_sq):
            m[k].zero_()
            v[k].zero_()
        self.step_count[k].zero_()

    def zero_grad(self) -> None:
        """Drop the gradients (set to None), as torch's default `zero_grad(set_to_none=True)`."""
        for p in self.params:
            p.grad = None
