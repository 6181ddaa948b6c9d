"""Benchmark: a cohort's attention cores grouped by head count (what StackedViT does) against fine heads masked into coarse ones.

Two ways to run one layer's attention for K slots whose head counts differ (d_k = d_model / h, so the slots
share every weight shape and differ only in how Q, K and V split into heads):

- grouped (headsearch.models.cohort, `StackedViT.layer_attention`, the production path): the slots with the same
  head count form a group; each group's slots are folded into the head axis, (B, G·h, T, d_k), and run as
  one scaled_dot_product_attention; the groups' outputs are put back in slot order. One attention call
  per distinct head count, each doing only its slots' own work.
- masked (written here, as the issue proposes it): every slot is split into the finest head count H of the
  layer (d_f = d_model / H). A coarse head of slot s is H / h_s consecutive fine heads, and its scores are
  the sum of their partial scores: S_c = sum_{f in c} q_f k_f^T / sqrt(d_model / h_s). So one batched
  product gives the fine partial scores (K, H, B, T, T), one (K, H, H) block-diagonal matrix per slot
  (its "mask", the scale folded in) sums them over each coarse head and copies the sum to its fine heads,
  softmax, and each fine head multiplies its coarse head's weights by its own V slice. Every slot runs the
  same shapes whatever its heads: no grouping, so a refill would not change the computation (what a CUDA
  graph wants), at the price of H·T² scores and softmax per slot instead of h_s·T², and an H×H product.

Before timing, both are checked against each other (and so against the solo attention, which the grouped
path equals: tests/test_cohort.py). Timed: forward and backward of the attention core alone on a
(K, B, T, 3·d_model) input with gradients; the seed ViT's d_model 48 and T = 65 (CIFAR-10, patch 4).
Slot s of K takes the head count HEADS[s mod 8] (the first layer of benchmarks/cohort.py's mix).

    python benchmarks/cohort_attention.py --quick   # CPU: K = 2, 4, 8, 16; batch 64; 5 rounds (~1 min)
    python benchmarks/cohort_attention.py           # GPU: K = 2, 4, 8, 16; batch 256; 20 rounds
"""
from __future__ import annotations

from common import alternate, markdown_table, median, paired_ratio, parser, report, resolve_device, spread

HEADS = [4, 8, 1, 2, 16, 4, 2, 8]  # slot s of a cohort takes HEADS[s % 8]: layer 0 of benchmarks/cohort.py's ARCHS
D_MODEL, TOKENS = 48, 65  # the seed ViT; 64 patches of 4x4 and the class token


def masks(heads: list[int], fine: int, d_model: int, device, dtype):
    """(K, H, H): slot s's block-diagonal sum over each coarse head's fine heads, times 1/sqrt(d_model / h_s)."""
    import torch

    f = torch.arange(fine, device=device)
    out = []
    for h in heads:
        r = fine // h  # fine heads a coarse head holds
        same = (f[:, None] // r) == (f[None, :] // r)
        out.append(same.to(dtype) * (d_model / h) ** -0.5)
    return torch.stack(out)


def masked_attention(qkv, mask):
    """Attention of K slots, each split into its own heads, computed at the finest head count H for all:
    qkv (K, B, T, 3D), mask (K, H, H) from `masks` -> merged heads (K, B, T, D)."""
    k, b, t, three_d = qkv.shape
    d, fine = three_d // 3, mask.shape[1]
    d_f = d // fine

    def split(z):  # (K, B, T, D) -> (K, H, B, T, d_f)
        return z.reshape(k, b, t, fine, d_f).permute(0, 3, 1, 2, 4)

    q, key, v = (split(z) for z in qkv.chunk(3, dim=-1))
    partial = q @ key.transpose(-2, -1)  # (K, H, B, T, T): each fine head's share of its coarse head's scores
    scores = (mask @ partial.reshape(k, fine, -1)).view(k, fine, b, t, t)  # coarse sums, copied to their fine heads
    out = scores.softmax(dim=-1) @ v  # (K, H, B, T, d_f)
    return out.permute(0, 2, 3, 1, 4).reshape(k, b, t, d)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ks", default="2,4,8,16", help="cohort sizes, comma list")
    p.add_argument("--batch", type=int, default=None, help="batch per slot (default 64 quick, 256 full)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5 quick, 20 full)")
    args = p.parse_args()

    import torch

    from headsearch.config import ArchConfig
    from headsearch.models.cohort import StackedViT

    device = resolve_device(args.device)
    batch = args.batch or (64 if args.quick else 256)
    rounds = args.rounds or (5 if args.quick else 20)
    rows = []
    for k in (int(x) for x in args.ks.split(",") if x):
        heads = [HEADS[s % len(HEADS)] for s in range(k)]
        fine = max(heads)
        stacked = StackedViT([ArchConfig(d_model=D_MODEL, enc_layers=1, d_ff=4 * D_MODEL, enc_heads=[h]) for h in heads]).to(device)
        mask = masks(heads, fine, D_MODEL, device, torch.float32)
        gen = torch.Generator(device=device).manual_seed(k)
        qkv = torch.randn(k, batch, TOKENS, 3 * D_MODEL, device=device, generator=gen).requires_grad_()
        grad_out = torch.randn(k, batch, TOKENS, D_MODEL, device=device, generator=gen)

        def grouped():
            return stacked.layer_attention(0, qkv, [None] * k)[0]

        def masked():
            return masked_attention(qkv, mask)

        torch.testing.assert_close(masked(), grouped(), rtol=1e-4, atol=1e-5)  # the same attention, two ways

        def timed(fn):
            def case() -> int:
                qkv.grad = None
                fn().backward(grad_out)
                return k * batch
            return case

        rates = alternate({"grouped": timed(grouped), "masked": timed(masked)}, rounds, device, warmup=2)
        score_work = fine * k / sum(heads)  # T x T scores and softmax the masked way does for each the grouped way does
        rows.append([k, " ".join(map(str, heads)), len(set(heads)), median(rates["grouped"]), median(rates["masked"]),
                     f"{paired_ratio(rates, 'masked', 'grouped'):.2f}", f"{score_work:.1f}",
                     spread(rates["grouped"]), spread(rates["masked"])])
        print(f"K={k}: grouped {rows[-1][3]:,.0f}, masked {rows[-1][4]:,.0f} samples/s", flush=True)

    table = markdown_table(["K", "heads of the slots", "groups", "grouped samples/s", "masked samples/s",
                            "masked / grouped", "masked score work / grouped", "± grouped", "± masked"], rows)
    notes = [f"one attention layer of the seed ViT (d_model {D_MODEL}, T {TOKENS}), forward + backward of the attention"
             f" core alone (no skip, no fusion); batch {batch} per slot; {rounds} rounds after 2 warm-up rounds,"
             " alternating; medians, ratios = medians of the ratios within rounds",
             "grouped: StackedViT.layer_attention (one scaled_dot_product_attention per head count); masked: every slot at"
             " the layer's finest head count H, scores summed into coarse heads by a (K, H, H) block-diagonal matrix;"
             " both checked equal before timing",
             "masked score work / grouped = K·H / sum of the slots' heads: the T×T scores and softmax the masked way"
             " computes for each one the grouped way does; masked would also have to run every slot's soft branch"
             " and skips (a slot's fusion and skip kind are per group the grouped way), which this leaves out"]
    report("Cohort attention: grouped by head count vs masked fine heads", table, device, args, notes)


if __name__ == "__main__":
    main()
