"""Translation cohorts: the padding a stacked step of K slots adds to K solo steps (batching arithmetic).

A cohort stacks K trials into one model and takes one batched step for all K. For translation each
trial (slot) draws its own epoch order from its own seed, so at one step the K slots' batches have
different lengths, and a stacked model needs one padded length per step: the longest over the slots.
This script measures what that costs, on the real Tatoeba English-Spanish pairs, without a model.

The data is the task's own: `translation-en-es` set up with its default config (batch size, max_len,
splits, tokenizers) on `DATA/spa-eng/spa.txt`, its training split in its own `BucketBatcher`, in both
paddings the task uses: fixed lengths (`bucket_lengths("cuda")`, the CUDA default) and each side to
its own longest sentence (`buckets=None`, the CPU default). Slot k of a cohort of K (k = 0..K-1) is
the task rebound with seed k, and walks epoch 1 as the trainer does (`train_batches(1)`: shuffled with
seed k * 100003 + 1). Every slot has the same number of batches, so step i of every slot holds the
same number of pairs B_i (the partial batch comes last in all of them).

At step i slot k's batch has source length S_ik and target length T_ik (the tensors' shapes; equal with
fixed lengths). Solo, slot k computes B_i * (S_ik + T_ik) token positions (encoder + decoder); stacked,
every slot computes B_i * (max_k S_ik + max_k T_ik). Reported per K, summed over the epoch's steps:

- dense work, stacked / solo: the token positions of the stacked steps over those of the K solo steps
  (what the linear layers, the feed-forward blocks and the output layer scale with);
- attention work, stacked / solo: the same with attention scores, S^2 (encoder self-attention) +
  T^2 (decoder self-attention) + S*T (cross-attention);
- real-token share: real tokens (not PAD_ID, counted from the batches' pad masks) over the padded
  positions, solo and stacked.

No model and no training, seconds on a CPU. The walks read each batch's pairs and padded lengths from
the batcher's own batching (`BucketBatcher.walk`: what `batches()` runs before it builds the
tensors), which spares building 112,000 batches of tensors. The first `CHECK` batches of every slot are
built as the trainer gets them (`train_batches`) and must match: shapes, and real tokens counted from
their pad masks. The batcher lives on the CPU: only the CPU pads each side to its own length, and
shapes are the same on any device.

    python benchmarks/translation_cohort.py --quick --no-write   # a seeded 10,000 of the training pairs
    python benchmarks/translation_cohort.py --no-write           # the whole training split
"""
from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np

from common import DATA, markdown_table, parser, report

KS = (1, 2, 4, 8, 16)
QUICK_PAIRS = 10_000  # --quick: a seeded subset of the training split (the task's train_limit)
EPOCH = 1  # the trainer's first epoch
CHECK = 64  # batches of each slot built as tensors, to check the walk against


@dataclasses.dataclass
class Walk:
    """One slot's epoch, step by step: pairs, padded source and target lengths, real tokens per side."""

    pairs: np.ndarray
    src_len: np.ndarray
    tgt_len: np.ndarray
    src_real: np.ndarray
    tgt_real: np.ndarray


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args()

    import torch

    from headsearch.tasks import DataSource, apply_overrides, get_task, resolve_config

    device = torch.device("cpu")  # shapes only: see the docstring
    task = get_task("translation-en-es")
    cfg = resolve_config(task)
    if args.quick:
        cfg = apply_overrides(task, cfg, {"data": {"train_limit": QUICK_PAIRS}})
    source = DATA / "spa-eng" / "spa.txt"
    t0 = time.perf_counter()
    bound = task.setup(cfg, DataSource(None, source), device)  # on the CPU: buckets=None, the CPU default
    ladder = cfg.data.bucket_lengths("cuda")
    # The CUDA default made explicit in the config, so that the CPU-bound task pads to it too.
    fixed_cfg = apply_overrides(task, cfg, {"data": {"buckets": list(ladder)}})
    modes = {"fixed lengths (CUDA default)": (bound.rebind(fixed_cfg), fixed_cfg),
             "own longest (CPU default)": (bound, cfg)}
    # Slot k: the task rebound with seed k (the data and batcher shared), as a cohort's slots are.
    slots = {mode: [b.rebind(apply_overrides(task, c, {"seed": k})) for k in range(max(KS))]
             for mode, (b, c) in modes.items()}
    walks = {mode: [checked(walk(slot), slot) for slot in mode_slots] for mode, mode_slots in slots.items()}
    seconds = time.perf_counter() - t0

    rows, ratios = [], {}
    for mode, mode_walks in walks.items():
        for k in KS:
            dense, attention, solo_share, stacked_share = cohort_ratios(mode_walks[:k])
            ratios[mode, k] = dense, attention
            rows.append([mode, k, f"{dense:.3f}", f"{attention:.3f}", f"{solo_share:.3f}", f"{stacked_share:.3f}"])
    table = markdown_table(["padding", "K", "dense work stacked / solo", "attention work stacked / solo",
                            "real-token share solo", "real-token share stacked"], rows)

    batcher, fixed_batcher = bound.batcher, modes["fixed lengths (CUDA default)"][0].batcher
    n, bs = len(batcher.src_ids), batcher.batch_size
    partial = n % bs
    notes = [
        f"data: {source.name}, {bound.split['pairs']:,} pairs; the task's training split "
        f"({bound.split['train']:,} pairs{', a seeded subset: --quick' if args.quick else ''}), {n:,} of them within "
        f"max_len {bound.max_len}; the task's default config: batch {bs}, {len(batcher)} steps an epoch",
        f"fixed lengths: the ladder {list(ladder)}, of which the data uses {list(fixed_batcher.lengths)}; source and "
        "target share the batch's length. Own longest: each side of a batch padded to its own longest sentence",
        (f"the last step of every slot is the partial batch of {partial} pairs (padded to the longest length used, "
         f"{fixed_batcher.lengths[-1]}, with fixed lengths), at the same step in every slot"
         if partial else "batch size divides the pairs: no partial batch"),
        f"slot k = 0..K-1 walks epoch {EPOCH} with the task rebound with seed k; work is summed over the epoch's steps "
        f"(dense: token positions, encoder + decoder; attention: S^2 + T^2 + S*T); the first {CHECK} batches of every "
        f"slot checked against the trainer's tensors (shapes, pad masks); set-up and walks {seconds:.0f} s",
    ] + [conclusion(mode, ratios) for mode in walks]
    report("Translation cohorts: padding of a stacked step vs solo steps", table, device, args, notes)


def walk(slot) -> Walk:
    """Pairs, padded lengths and real tokens of each batch of one slot's epoch, in step order: the batches
    `slot.train_batches(EPOCH)` yields, read from the batcher's own batching without building tensors."""
    rows = slot.batcher.walk(slot.epoch_seed(EPOCH))  # (steps, 5), what train_batches shuffles with
    return Walk(rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4])


def checked(w: Walk, slot) -> Walk:
    """The walk, once its first CHECK steps match the tensors the trainer gets: shapes and pad-mask counts."""
    from headsearch.tasks.translation_data import PAD_ID

    for i, batch in enumerate(itertools.islice(slot.train_batches(EPOCH), CHECK)):
        got = (batch.src.shape[0], batch.src.shape[1], batch.tgt_in.shape[1], int((batch.src != PAD_ID).sum()),
               int((batch.tgt_in != PAD_ID).sum()))
        want = (w.pairs[i], w.src_len[i], w.tgt_len[i], w.src_real[i], w.tgt_real[i])
        assert got == want, f"step {i}: the batch has (B, S, T, real S, real T) {got}, the walk {want}"
    return w


def cohort_ratios(slots: list[Walk]) -> tuple[float, float, float, float]:
    """(dense work stacked / solo, attention work stacked / solo, real-token share solo, stacked) of K slots."""
    pairs = slots[0].pairs
    # Same data, same batch size, partial batch last: every slot's step i holds the same number of pairs.
    assert all(np.array_equal(s.pairs, pairs) for s in slots), "slots disagree on batch sizes"
    src, tgt = np.stack([s.src_len for s in slots]), np.stack([s.tgt_len for s in slots])  # (K, steps)
    k, s_max, t_max = len(slots), src.max(axis=0), tgt.max(axis=0)  # a stacked step pads to the longest slot
    solo_dense = (pairs * (src + tgt)).sum()
    stacked_dense = k * (pairs * (s_max + t_max)).sum()
    solo_attention = (pairs * (src**2 + tgt**2 + src * tgt)).sum()
    stacked_attention = k * (pairs * (s_max**2 + t_max**2 + s_max * t_max)).sum()
    real = sum(int(s.src_real.sum() + s.tgt_real.sum()) for s in slots)
    return stacked_dense / solo_dense, stacked_attention / solo_attention, real / solo_dense, real / stacked_dense


def conclusion(mode: str, ratios: dict) -> str:
    dense, attention = ratios[mode, 8]
    dense16, attention16 = ratios[mode, 16]
    return (f"{mode}: a stacked step of K=8 computes {dense:.2f}x the dense token positions and {attention:.2f}x the "
            f"attention scores of 8 solo steps ({dense - 1:.0%} and {attention - 1:.0%} more; K=16: {dense16:.2f}x "
            f"and {attention16:.2f}x)")


if __name__ == "__main__":
    main()
