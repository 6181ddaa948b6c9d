"""K ViTs as one stacked model: a cohort's parameters carry a leading slot axis, and every dense layer is
one batched matrix product over the K slots (model fusion in the manner of HFTA, Wang et al. 2021,
"Horizontally Fused Training Array", MLSys; `torch.func.stack_module_state` stacks the same way).

What lets headsearch's trials stack: with d_k = d_model / h (docs/design.md §1) every head schedule has the
same Q/K/V and output projections; only the split of their output into heads differs. So the slots of a
cohort share the shapes of every dense weight, and each slot keeps its own per-layer head count, skip kind
and fusion. In each layer the attention core (scores, softmax, the soft branch, the skips) runs once per
group of slots that split alike: the group's slots are folded into the head axis, (B, G·h, T, d_k), which
is exactly G separate attentions of h heads (a head never looks at another head's dimensions).

Layouts. A slot's solo parameter `name` of shape S is the stacked parameter `name` (dots as "__") of shape
(K, *S), except the soft branch (its shape depends on h): W1 and W2, solo (h, d_k, d_a), are stored as
(K, d_model, A) (the rows of all heads one after another, d_a ≤ A columns used), and w, solo (h, d_a), as
(K, d_model, A) (h ≤ d_model rows used). The unused parts get no gradient. `load_slot` and `slot_state`
convert between a slot and a solo `ViT`'s state_dict, so a trial in a cohort checkpoints, exports and
retrains exactly as a solo one.

Not stacked (`stack_refusal` says why, and such a trial trains alone): a fixed head width (its
projections depend on h), dropout (a slot's random draws could not match the solo run's), and the skips and
fusions models/variants.py marks `stacks=False` (value residual, U-net and dense skips, differential
attention: parameters this core does not hold yet).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from headsearch.config import ArchConfig
from headsearch.models.attention import additive_energy, map_score_heads
from headsearch.models.variants import Fuse, Skip, fusion_of, skip_of
from headsearch.models.vit import ViT

LN_EPS = 1e-5  # nn.LayerNorm's default, which every solo LayerNorm uses


def stack_refusal(arch: ArchConfig) -> str | None:
    """Why an architecture cannot join a cohort (None: it can)."""
    if arch.head_dim != "split":
        return f"head_dim = {arch.head_dim} makes the projections depend on the head count"
    if arch.dropout or arch.attn_dropout:
        return "dropout draws random numbers a cohort could not draw as the solo run does"
    if arch.dec_layers:
        return "only the encoder-only ViT stacks"
    for kind, variant in (("skip", skip_of(arch.skip)), ("fusion", fusion_of(arch.fusion))):
        if not variant.stacks:
            return f"{kind} {variant.name!r} is not in the cohort's batched core (models/cohort.py)"
    return None


def stack_signature(arch: ArchConfig) -> tuple:
    """What every slot of a cohort must share: every dense weight's shape (not the head schedule, skip or fusion)."""
    a = arch
    return (a.d_model, a.enc_layers, a.d_ff, a.patch_size, a.activation, a.soft_score, a.soft_dim)


def soft_width(arch: ArchConfig, min_heads: int) -> int:
    """The columns A a cohort's soft weights need for every slot whose layers have at least `min_heads` heads."""
    return arch.soft_dim or arch.d_model // min_heads


@dataclass(frozen=True)
class Group:
    """Slots of one layer whose attention cores run together: same heads, skip, running mean and fusion
    (the skip and the fusion as models/variants.py's records: `fuse` None means no soft branch)."""

    heads: int
    skip: Skip
    skip_mean: bool
    fuse: Fuse | None
    slots: tuple[int, ...]
    index: Tensor | None = None  # the slots as a device tensor (None: they are a run of slots, `start` on)
    start: int = 0

    def take(self, t: Tensor) -> Tensor:
        """The group's slots of a stacked tensor (slot axis first): a view when they are a run of slots, which
        costs nothing forward and a slice's backward; a gather otherwise."""
        if self.index is not None:
            return t.index_select(0, self.index)
        return t if self.start == 0 and len(self.slots) == t.shape[0] else t.narrow(0, self.start, len(self.slots))


def _look_up_variants(arch: ArchConfig) -> None:
    """A one-line ConfigError, at construction, when models/variants.py does not know the arch's skip or fusion."""
    skip_of(arch.skip)
    fusion_of(arch.fusion)


def _key(arch: ArchConfig, layer: int) -> tuple:
    """What a Group holds, in its order; the running mean counts only for a skip that carries scores."""
    skip = skip_of(arch.skip)
    return (arch.enc_heads[layer], skip, arch.skip_mean and skip.carries_scores, fusion_of(arch.fusion).soft)


def _param_name(solo_name: str) -> str:
    return solo_name.replace(".", "__")


def _linear(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Per-slot x @ w.T + b: x (K, ..., in), w (K, out, in), b (K, out) -> (K, ..., out)."""
    k, shape = x.shape[0], x.shape[1:-1]
    y = torch.baddbmm(b.unsqueeze(1), x.reshape(k, -1, x.shape[-1]), w.transpose(1, 2))  # (K, N, out)
    return y.view(k, *shape, w.shape[1])


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    """torch.cat, without the copy when there is one part (a group of one slot)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _layer_norm(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Per-slot LayerNorm over the last axis: x (K, ..., D), w and b (K, D)."""
    view = (w.shape[0],) + (1,) * (x.dim() - 2) + (w.shape[1],)
    return torch.addcmul(b.view(view), F.layer_norm(x, x.shape[-1:], eps=LN_EPS), w.view(view))


class StackedViT(nn.Module):
    """K ViTs of one `stack_signature` (`archs`), trained as one model: images (K, B, C, H, W) -> logits (K, B, classes).

    `soft_columns` is A, the width kept for soft-branch weights (`soft_width`; None: no slot may fuse).
    """

    def __init__(self, archs: Sequence[ArchConfig], image_size: int = 32, in_chans: int = 3, num_classes: int = 10,
                 soft_columns: int | None = None):
        super().__init__()
        if not archs:
            raise ValueError("a cohort needs at least one slot")
        first = archs[0]
        for a in archs:
            if (why := stack_refusal(a)) is not None:
                raise ValueError(f"cannot stack {a}: {why}")
            _look_up_variants(a)
            if stack_signature(a) != stack_signature(first):
                raise ValueError("the slots of a cohort must share d_model, layers, d_ff, patch size, activation and soft branch")
        self.image_size, self.in_chans, self.num_classes = image_size, in_chans, num_classes
        self.soft_columns = soft_columns
        self.archs: list[ArchConfig] = list(archs)
        template = ViT(first, image_size, in_chans, num_classes)  # the shapes of everything but the soft branch
        k = len(archs)
        params = {}
        for name, p in template.named_parameters():
            if ".soft." not in name and ".skip_norm." not in name:
                params[_param_name(name)] = nn.Parameter(p.detach().new_zeros(k, *p.shape))
        d = first.d_model
        for i in range(first.enc_layers):
            prefix = f"encoder.blocks.{i}.attn."
            if i > 0:  # every slot may use the output skip's LayerNorm: ones and zeros, as nn.LayerNorm starts
                params[_param_name(prefix + "skip_norm.weight")] = nn.Parameter(torch.ones(k, d))
                params[_param_name(prefix + "skip_norm.bias")] = nn.Parameter(torch.zeros(k, d))
            if soft_columns is not None:
                names = ["w_key", "w_energy"] + (["w_query"] if first.soft_score == "pairwise" else [])
                for n in names:
                    params[_param_name(prefix + "soft." + n)] = nn.Parameter(torch.zeros(k, d, soft_columns))
        self.params = nn.ParameterDict(params)
        self.groups: list[list[Group]] = []
        self._regroup()

    @property
    def slots(self) -> int:
        return len(self.archs)

    def p(self, solo_name: str) -> Tensor:
        return self.params[_param_name(solo_name)]

    # -- slots <-> solo models -------------------------------------------------------------------
    @classmethod
    def from_models(cls, models: Sequence[ViT], soft_columns: int | None = None) -> "StackedViT":
        """A cohort holding copies of `models`' weights, slot k = models[k]."""
        m0 = models[0]
        stacked = cls([m.cfg for m in models], _image_size(m0), m0.patch_embed.in_channels, m0.head.out_features,
                      soft_columns)
        stacked.to(m0.pos_embed.device)
        for k, m in enumerate(models):
            stacked.load_slot(k, m)
        return stacked

    def load_slot(self, k: int, model: ViT) -> None:
        """Slot k becomes a copy of `model` (a solo ViT of this cohort's signature): a refill."""
        arch = model.cfg
        if (why := stack_refusal(arch)) is not None or stack_signature(arch) != stack_signature(self.archs[0]):
            raise ValueError(f"{arch} cannot take a slot of this cohort: {why or 'another stack signature'}")
        _look_up_variants(arch)  # before the slot changes
        if fusion_of(arch.fusion).soft is not None:
            need = soft_width(arch, min(arch.enc_heads))
            if self.soft_columns is None or need > self.soft_columns:
                raise ValueError(f"this cohort keeps {self.soft_columns} soft-branch columns; {arch} needs {need}")
        self.archs[k] = arch
        with torch.no_grad():
            for name, target in self.params.items():  # what the solo model lacks starts as a fresh module would
                if "__soft__" in name or "skip_norm__bias" in name:
                    target[k].zero_()
                elif "skip_norm__weight" in name:
                    target[k].fill_(1.0)
            for name, value in model.state_dict().items():
                target = self.params[_param_name(name)]
                if ".soft." in name:
                    flat = value.reshape(-1, value.shape[-1])  # W1, W2: (h·d_k, d_a); w: (h, d_a)
                    target[k, : flat.shape[0], : flat.shape[1]] = flat
                else:
                    target[k].copy_(value)
        self._regroup()

    def slot_state(self, k: int) -> dict[str, Tensor]:
        """Slot k's weights as a solo `ViT(archs[k])`'s state_dict (copies)."""
        arch = self.archs[k]
        out = {}
        for name, shape in _solo_shapes(arch, self.image_size, self.in_chans, self.num_classes).items():
            value = self.params[_param_name(name)][k]
            if ".soft." in name:  # W1, W2: (h, d_k, d_a) from rows h·d_k; w: (h, d_a) from rows h
                value = value[: torch.Size(shape[:-1]).numel(), : shape[-1]]
            out[name] = value.detach().clone().reshape(shape)
        return out

    def slot_model(self, k: int) -> ViT:
        """A solo ViT with slot k's current weights (evaluation, checkpoints, analysis)."""
        model = ViT(self.archs[k], self.image_size, self.in_chans, self.num_classes)
        model.load_state_dict(self.slot_state(k))
        return model.to(next(self.parameters()).device)

    def _regroup(self) -> None:
        """Per layer, the slots whose attention cores run together (with their indices on the device, made
        once here: a tensor made from a list inside forward would be a host-to-device copy every step)."""
        device = next(iter(self.params.values())).device
        k = self.slots
        self.groups, self.inverse = [], []
        for i in range(self.archs[0].enc_layers):
            by_key: dict[tuple, list[int]] = {}
            for s, a in enumerate(self.archs):
                by_key.setdefault(_key(a, i), []).append(s)
            groups = [Group(*key, slots=tuple(ks), start=ks[0],
                            index=None if ks == list(range(ks[0], ks[0] + len(ks))) else torch.tensor(ks, device=device))
                      for key, ks in by_key.items()]
            order = [s for g in groups for s in g.slots]
            # Concatenated in group order, the slots need putting back in slot order (the inverse permutation).
            inverse = None if order == list(range(k)) else torch.tensor(order).argsort().to(device)
            self.groups.append(groups)
            self.inverse.append(inverse)

    def _apply(self, fn, *args, **kwargs):
        """Moving the model (`.to`, `.cuda`) moves the group indices too."""
        out = super()._apply(fn, *args, **kwargs)
        self._regroup()
        return out

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, images: Tensor) -> Tensor:
        """images: (K, B, C, H, W) normalised floats, each slot its own batch -> logits (K, B, classes)."""
        k, b = images.shape[:2]
        p = self.p
        w = p("patch_embed.weight")  # (K, D, C, P, P)
        size = w.shape[-1]
        patches = F.unfold(images.reshape(k * b, *images.shape[2:]), size, stride=size)  # (K·B, C·P·P, N)
        patches = patches.transpose(1, 2).reshape(k, b, -1, patches.shape[1])  # (K, B, N, C·P·P)
        x = _linear(patches, w.reshape(k, w.shape[1], -1), p("patch_embed.bias"))  # (K, B, N, D)
        cls = p("cls_token").expand(k, b, 1, x.shape[-1])  # (K, B, 1, D): cls_token is (K, 1, 1, D)
        x = torch.cat([cls, x], dim=2) + p("pos_embed")  # (K, B, N + 1, D)
        skips: list[Tensor | None] = [None] * k
        for i in range(len(self.groups)):
            x, skips = self._block(i, x, skips)
        x = _layer_norm(x, p("encoder.norm.weight"), p("encoder.norm.bias"))
        return _linear(x[:, :, 0], p("head.weight"), p("head.bias"))  # (K, B, classes)

    def _block(self, i: int, x: Tensor, skips: list[Tensor | None]) -> tuple[Tensor, list[Tensor | None]]:
        """One pre-LN encoder block for every slot (transformer.EncoderBlock): x (K, B, T, D)."""
        pre = f"encoder.blocks.{i}."
        p = self.p
        h = _layer_norm(x, p(pre + "norm1.weight"), p(pre + "norm1.bias"))
        qkv = _linear(h, p(pre + "attn.qkv_proj.weight"), p(pre + "attn.qkv_proj.bias"))  # (K, B, T, 3D)
        merged, skips = self.layer_attention(i, qkv, skips)  # (K, B, T, D)
        x = x + _linear(merged, p(pre + "attn.out_proj.weight"), p(pre + "attn.out_proj.bias"))
        h = _layer_norm(x, p(pre + "norm2.weight"), p(pre + "norm2.bias"))
        h = _linear(h, p(pre + "mlp.fc1.weight"), p(pre + "mlp.fc1.bias"))
        h = F.gelu(h) if self.archs[0].activation == "gelu" else F.relu(h)
        return x + _linear(h, p(pre + "mlp.fc2.weight"), p(pre + "mlp.fc2.bias")), skips

    def layer_attention(self, i: int, qkv: Tensor, skips: list[Tensor | None]) -> tuple[Tensor, list[Tensor | None]]:
        """Layer i's attention cores, one per group: merged heads (K, B, T, D) and each slot's skip emission."""
        parts, emitted, groups = [], list(skips), self.groups[i]
        # Groups that are runs of slots in order split qkv in one op, whose backward is one cat (a view each
        # would give every group's gradient as a zero-filled tensor of all K slots, summed after).
        ins = qkv.split([len(g.slots) for g in groups]) if self.inverse[i] is None else [g.take(qkv) for g in groups]
        for g, qkv_g in zip(groups, ins):
            merged_g, out_skips = self._core(i, g, qkv_g, [skips[s] for s in g.slots])
            parts.append(merged_g)
            for s, e in zip(g.slots, out_skips):
                emitted[s] = e
        if len(parts) == 1:
            return parts[0], emitted
        merged = torch.cat(parts)
        return (merged if self.inverse[i] is None else merged.index_select(0, self.inverse[i])), emitted  # (K, B, T, D)

    def _core(self, i: int, g: Group, qkv: Tensor, skips: list[Tensor | None]) -> tuple[Tensor, list[Tensor | None]]:
        """Attention (docs/design.md §2, §3) of the G slots of group `g`, folded into the head axis:
        qkv (G, B, T, 3D) -> merged heads (G, B, T, D), and what each slot's skip passes on."""
        n, b, t, three_d = qkv.shape
        d, heads = three_d // 3, g.heads
        d_k = d // heads
        pre = f"encoder.blocks.{i}.attn."

        def split(z: Tensor) -> Tensor:  # (G, B, T, D) -> (B, G·h, T, d_k)
            return z.reshape(n, b, t, heads, d_k).permute(1, 0, 3, 2, 4).reshape(b, n * heads, t, d_k)

        q, k, v = (split(z) for z in qkv.chunk(3, dim=-1))
        skip_in = i > 0 and g.skip.carries
        emitted_scores = None
        if g.skip.carries_scores:
            scores = (q @ k.transpose(-2, -1)) * d_k**-0.5  # (B, G·h, T, T)
            if skip_in:
                scores = scores + _cat([map_score_heads(s, heads) for s in skips], dim=1)  # RealFormer residual
            emitted_scores = scores
            weights = (scores / (i + 1.0) if g.skip_mean else scores).softmax(dim=-1)
            out = weights @ v  # (B, G·h, T, d_k)
        else:
            out = F.scaled_dot_product_attention(q, k, v)  # (B, G·h, T, d_k)
        if g.fuse is not None:
            soft = self._soft(pre, g, q, k, v, d_k)
            out = g.fuse(out, soft)  # HAM A / HAM B: (B, G·h, T, d_k)
        merged = out.reshape(b, n, heads, t, d_k).permute(1, 0, 3, 2, 4).reshape(n, b, t, d)  # concat_h per slot
        if g.skip.carries_output:
            if skip_in:
                w, bias = (g.take(self.p(pre + "skip_norm." + n)) for n in ("weight", "bias"))
                merged = _layer_norm(merged + _cat([s.unsqueeze(0) for s in skips], dim=0), w, bias)  # Deep Head: add, normalise
            return merged, list(merged.unbind(0))
        if g.skip.carries_scores:
            return merged, list(emitted_scores.split(heads, dim=1))  # (B, h, T, T) each
        return merged, [None] * n

    def _soft(self, pre: str, g: Group, q: Tensor, k: Tensor, v: Tensor, d_k: int) -> Tensor:
        """The soft (additive) branch of attention.SoftAttention, each slot's own per-head weights: (B, G·h, T, d_k)."""
        arch = self.archs[g.slots[0]]
        a = arch.soft_dim or d_k
        heads, n = g.heads, len(g.slots)
        rows = heads * d_k  # = D
        w_key = g.take(self.p(pre + "soft.w_key"))[:, :rows, :a].reshape(n * heads, d_k, a)  # (G·h, d_k, A)
        w_energy = g.take(self.p(pre + "soft.w_energy"))[:, :heads, :a].reshape(n * heads, a)  # (G·h, A)
        keys = torch.einsum("bhtd,hda->bhta", k, w_key)  # (B, G·h, T, A)
        if arch.soft_score == "pairwise":
            w_query = g.take(self.p(pre + "soft.w_query"))[:, :rows, :a].reshape(n * heads, d_k, a)
            queries = torch.einsum("bhtd,hda->bhta", q, w_query)
            energy = additive_energy(queries, keys, w_energy)  # (B, G·h, T, T)
        else:
            energy = torch.einsum("bhka,ha->bhk", torch.tanh(keys), w_energy)
            energy = energy.unsqueeze(2).expand(-1, -1, q.shape[2], -1)
        return energy.softmax(dim=-1) @ v


def _image_size(model: ViT) -> int:
    n_patches = model.pos_embed.shape[1] - 1
    return int(round(n_patches**0.5)) * model.patch_embed.kernel_size[0]


_SHAPES: dict[tuple, dict[str, tuple[int, ...]]] = {}


def _solo_shapes(arch: ArchConfig, image_size: int, in_chans: int, classes: int) -> dict[str, tuple[int, ...]]:
    """The state_dict shapes of a solo ViT of `arch` (built once per architecture, on the meta device)."""
    key = (arch, image_size, in_chans, classes)
    if key not in _SHAPES:
        with torch.device("meta"):
            model = ViT(arch, image_size, in_chans, classes)
        _SHAPES[key] = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return _SHAPES[key]
