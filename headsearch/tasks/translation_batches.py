"""Length-bucketed batches of translation pairs, resident on the device and padded to a few fixed lengths."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from headsearch.errors import ConfigError, DataError
from headsearch.tasks.translation_tokens import EOS_ID, PAD_ID, SOS_ID


def bucket_ladder(max_len: int, smallest: int = 8) -> tuple[int, ...]:
    """8, 12, 16, 24, 32, 48, 64, ...: the powers of two from `smallest` and the midpoints between them,
    below max_len, then max_len itself.

    Each length is at most 1.5x the one before, so padding a batch up to its bucket adds at most half
    of its longest pair. Only the lengths the data fills become batch shapes.
    """
    lengths, p = [], smallest
    while p < max_len:
        lengths += [n for n in (p, p * 3 // 2) if n < max_len]
        p *= 2
    return tuple(lengths) + (max_len,)


def _pack(seqs: Sequence[Sequence[int]], width: int, dtype, first: int | None = None, last: int | None = None) -> np.ndarray:
    """Rows [first] + seq + [last], left-aligned in an (N, width) array of PAD, without a loop over rows."""
    n = len(seqs)
    lens = np.fromiter(map(len, seqs), dtype=np.int64, count=n)
    flat = np.fromiter((i for seq in seqs for i in seq), dtype=np.int64, count=int(lens.sum()))
    out = np.full((n, width), PAD_ID, dtype=dtype)
    start = 0 if first is None else 1
    if first is not None:
        out[:, 0] = first
    cols = np.arange(width)
    out[(cols >= start) & (cols < start + lens[:, None])] = flat  # row-major order = the order of `flat`
    if last is not None:
        out[np.arange(n), start + lens] = last
    return out


@dataclass
class TranslationBatch:
    """One batch of pairs: with fixed lengths (buckets), source and target padded to one length L, the
    batch's bucket (S = T = L); without, each side padded to its own longest sentence in the batch.

    The tensors live on the batcher's device. The plain numbers describe the batch and differ between
    batches of one shape, and a training step (`BoundTranslation.loss`) reads none of them, so a step
    captured in a CUDA graph on one batch replays correctly on another of the same shape once the
    tensors are copied into its buffers.
    """

    src: torch.Tensor  # (B, S) long: source ids + [EOS], PAD-padded
    tgt_in: torch.Tensor  # (B, T) long: [SOS] + target ids (decoder input), PAD-padded
    tgt_out: torch.Tensor  # (B, T) long: target ids + [EOS] (labels), PAD where padded
    index: torch.Tensor  # (B,) long: positions of these pairs in the lists given to the batcher
    n_tokens: int  # non-pad target tokens (the loss is averaged over these)
    src_len: int  # the longest source in the batch, [EOS] included (S may be larger)


class BucketBatcher:
    """Length-bucketed batches of pairs resident on the device, padded to a few fixed lengths.

    Data: the pairs are copied to the device once, as a (3, N, W) table of source, decoder-input and
    label rows (PAD-padded to the longest length used, W; int16 when the ids fit). A batch is an
    `index_select` of its rows and a slice to its length: no Python loop over rows, and no copy to
    the device but the epoch's order of rows (one index tensor per epoch).

    Batching, as Transformer training usually does it: pairs of similar length share a batch, so
    little compute is spent on padding. Shuffled epochs stay random at two levels: which pairs meet (a
    seeded permutation cut into chunks of batch_size * bucket_factor pairs, each sorted by length) and
    the order of the batches. bucket_factor=1 is plain random batching. Every pair comes once an epoch.

    Padding with `buckets` (fixed lengths, for CUDA graphs): a pair needs max(len(source) + 1,
    len(target) + 1) positions (with EOS; with SOS), and a batch's source and target share one length
    L, the smallest bucket that holds all of its pairs: one length for both sides keeps the shapes few
    (a shape per bucket, not per pair of buckets). When batch_size does not divide the pairs, the one
    partial batch comes last in the epoch and is padded to the longest bucket the data uses, so a
    training epoch shows at most len(`lengths`) + 1 shapes, which `shape_samples` returns one batch of
    each. `buckets=None` pads each side of each batch to its own longest sentence instead: the least
    padding, in shapes that vary from batch to batch.
    """

    def __init__(self, src_ids: list[list[int]], tgt_ids: list[list[int]], batch_size: int, *,
                 buckets: Sequence[int] | None = None, bucket_factor: int = 50, device: str | torch.device = "cpu"):
        if len(src_ids) != len(tgt_ids):
            raise ValueError(f"{len(src_ids)} source but {len(tgt_ids)} target sequences")
        if batch_size < 1 or bucket_factor < 1:
            raise ConfigError(f"batch_size={batch_size}, bucket_factor={bucket_factor}: both must be at least 1")
        if not src_ids:
            raise DataError("no sentence pairs to batch — the split is empty; use more data or a larger max_len")
        self.src_ids, self.tgt_ids = src_ids, tgt_ids
        self.batch_size, self.bucket_factor, self.device = batch_size, bucket_factor, torch.device(device)
        self.buckets = None if buckets is None else tuple(buckets)
        self._src_len = np.fromiter(map(len, src_ids), dtype=np.int64, count=len(src_ids)) + 1  # + EOS
        self._tgt_len = np.fromiter(map(len, tgt_ids), dtype=np.int64, count=len(tgt_ids)) + 1  # + SOS (in) / EOS (out)
        self._need = need = np.maximum(self._src_len, self._tgt_len)  # positions each pair needs
        self._padded = None  # each pair's bucket length, with buckets
        if buckets is None:
            self.lengths = tuple(int(n) for n in np.unique(need))  # the lengths the data needs
        else:
            ladder = np.asarray(self.buckets, dtype=np.int64)
            if np.any(np.diff(ladder) <= 0):
                raise ConfigError(f"buckets {list(self.buckets)} must be increasing lengths")
            if need.max() > ladder[-1]:
                raise ConfigError(f"buckets {list(self.buckets)} end below the longest pair ({need.max()} tokens with SOS/EOS):"
                                  " make the last length at least that")
            self._padded = ladder[np.searchsorted(ladder, need)]
            self.lengths = tuple(int(n) for n in np.unique(self._padded))  # the bucket lengths the data uses
        width = self.lengths[-1]
        top_id = max(max((max(s) for s in side if s), default=0) for side in (src_ids, tgt_ids))
        dtype = np.int16 if top_id < 2**15 else np.int32  # converted to long per batch, after the slice
        table = np.stack([_pack(src_ids, width, dtype, last=EOS_ID), _pack(tgt_ids, width, dtype, first=SOS_ID),
                          _pack(tgt_ids, width, dtype, last=EOS_ID)])
        self.table = torch.from_numpy(table).to(self.device)  # (3, N, W): src, tgt_in, tgt_out rows

    def padded_lengths(self, buckets: Sequence[int] | None) -> np.ndarray:
        """Each pair's padded length under the bucket ladder `buckets` (the positions it needs without one):
        what its batch's length is, give or take its batch-mates (batches are sorted by length)."""
        if buckets is None:
            return self._need.copy()
        ladder = np.asarray(buckets, dtype=np.int64)
        return ladder[np.minimum(np.searchsorted(ladder, self._need), len(ladder) - 1)]

    def __len__(self) -> int:
        # Chunks hold a multiple of batch_size pairs, so only one batch can be short.
        return math.ceil(len(self.src_ids) / self.batch_size)

    def with_batch_size(self, batch_size: int) -> "BucketBatcher":
        """The same pairs (the same device table) in batches of another size."""
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be at least 1")
        new = copy.copy(self)
        new.batch_size = batch_size
        return new

    def batches(self, *, shuffle: bool, seed: int | None = None) -> Iterator[TranslationBatch]:
        """One epoch: every pair exactly once. Not shuffled: sorted by length, always the same batches."""
        groups = self._batch_indices(shuffle, seed)
        rows = self._to_device(np.concatenate(groups))  # the epoch's rows in batch order
        for idx, batch_rows in zip(groups, torch.split(rows, [len(idx) for idx in groups])):
            yield self._make_batch(idx, batch_rows, self._widths(idx))

    def walk(self, seed: int) -> np.ndarray:
        """The shuffled epoch `batches(shuffle=True, seed=seed)` yields, read without building its tensors:
        one row per batch, (pairs, padded source length, padded target length, real source tokens, real target
        tokens), a pair's real tokens being its source + EOS and SOS + target."""
        groups = self._batch_indices(True, seed)
        return np.array([(len(idx), *self._widths(idx), self._src_len[idx].sum(), self._tgt_len[idx].sum())
                         for idx in groups], dtype=np.int64).reshape(-1, 5)  # (steps, 5)

    def shape_samples(self, seed: int, partial: bool = True) -> list[TranslationBatch]:
        """One batch of each shape an epoch can show, from real pairs drawn with their own generator:
        (batch_size, L) for each bucket length L the data uses (when there is a full batch), and the
        partial batch's (N mod batch_size, longest L) when `partial` (an epoch that reaches its last batch).

        Without buckets shapes vary from batch to batch, without a fixed set: then the first three
        batches of different shapes of an epoch drawn with `seed`, enough for a compiler to see the
        lengths change and compile once for dynamic shapes (there are no CUDA graphs to capture).
        """
        n, bs, out = len(self.src_ids), self.batch_size, []
        if self.buckets is None:
            shapes = set()
            for batch in self.batches(shuffle=True, seed=seed):
                shape = (*batch.src.shape, batch.tgt_in.shape[1])
                if shape not in shapes and (partial or len(batch.index) == bs):
                    shapes.add(shape)
                    out.append(batch)
                if len(out) == 3:
                    break
            return out
        rng = np.random.default_rng(seed)
        for length in self.lengths if n >= bs else ():
            fits = np.flatnonzero(self._padded <= length)
            out.append(self._sample(rng.choice(fits, bs, replace=len(fits) < bs), length))
        if partial and n % bs:
            out.append(self._sample(rng.choice(n, n % bs, replace=False), self.lengths[-1]))
        return out

    def _sample(self, idx: np.ndarray, length: int) -> TranslationBatch:
        return self._make_batch(idx, self._to_device(idx), (length, length))

    def _to_device(self, idx: np.ndarray) -> torch.Tensor:
        """Row indices on the device. On CUDA through pinned memory, so the copy does not wait for the
        work already queued (a copy from pageable memory synchronises the stream)."""
        rows = torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))
        if self.device.type == "cuda":
            return rows.pin_memory().to(self.device, non_blocking=True)
        return rows.to(self.device)

    def _widths(self, idx: np.ndarray) -> tuple[int, int]:
        """A batch's padded (source, target) lengths: its bucket's, twice (the partial batch's is the
        longest bucket, so it has one shape); without buckets each side's longest sentence."""
        if self.buckets is None:
            return int(self._src_len[idx].max()), int(self._tgt_len[idx].max())
        length = self.lengths[-1] if len(idx) < self.batch_size else int(self._padded[idx].max())
        return length, length

    def _by_length(self, idx: np.ndarray) -> np.ndarray:
        # Sort by the positions a pair needs, ties by target then source length; stable. The target
        # decides more of the cost (the decoder and the vocabulary-wide output run over it).
        order = np.lexsort((self._src_len[idx], self._tgt_len[idx], self._need[idx]))
        return idx[order]

    def _batch_indices(self, shuffle: bool, seed: int | None) -> list[np.ndarray]:
        n, bs = len(self.src_ids), self.batch_size
        if not shuffle:
            ordered = self._by_length(np.arange(n))
            return [ordered[i : i + bs] for i in range(0, n, bs)]
        rng = np.random.default_rng(seed)
        perm = rng.permutation(n)
        chunk = bs * self.bucket_factor
        batches = []
        for start in range(0, n, chunk):
            ordered = self._by_length(perm[start : start + chunk])
            batches.extend(ordered[i : i + bs] for i in range(0, len(ordered), bs))
        # The partial batch (the last chunk's last) stays last: an epoch cut short never meets its shape.
        full, partial = (batches[:-1], batches[-1:]) if n % bs else (batches, [])
        # Otherwise each chunk would run from short to long sentences, a visible pattern in the loss.
        return [full[i] for i in rng.permutation(len(full))] + partial

    def _make_batch(self, idx: np.ndarray, rows: torch.Tensor, widths: tuple[int, int]) -> TranslationBatch:
        """idx: the pairs (host), rows: the same on the device; widths: the padded (S, T)."""
        s, t = widths
        # Rows first, then the slice: index_select from a sliced (non-contiguous) table is ~150x slower on the CPU.
        ids = self.table.index_select(1, rows)[:, :, : max(s, t)].long()  # (3, B, max(S, T))
        src, tgt_in, tgt_out = ids[0, :, :s], ids[1, :, :t], ids[2, :, :t]
        return TranslationBatch(src=src, tgt_in=tgt_in, tgt_out=tgt_out, index=rows,
                                n_tokens=int(self._tgt_len[idx].sum()), src_len=int(self._src_len[idx].max()))
