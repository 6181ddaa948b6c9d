"""Benchmark 5: translation's data path and greedy decoding, each against the code it replaced.

(a) Training steps of the tiny preset's model (`headsearch train --task translation-en-es --preset
tiny`: 2+2 layers x 4 heads, d_model 64, batch 64, Adam, gradient clipping) on real Tatoeba pairs,
fed three ways: the old host-built batches (`HostBatcher` below, the code translation_data.py had:
each side of a batch padded to its own longest sentence by a Python loop over its rows, then copied
to the device), and the device-resident `BucketBatcher` with each padding (each side to its longest
sentence, as before: the CPU default; a few fixed lengths, 8 12 16 24 32: the CUDA default). A
round is one whole epoch over the same pairs for each (a seeded random 3,200 of them with --quick,
all of them without), batches built inside the timed round: every pair once, so the rates differ
by the padding and the data path only.

(b) Greedy decoding of the whole validation split, as `evaluate` does it (same batches, same
length cap), with the key/value cache and with the full recomputation of the prefix at every token
(`use_cache=False`), by a model trained for a few hundred steps first, so that translations end
where a trained model's do. Both decoders' translations are compared token for token.

Alternating rounds in one process, median of the rounds (benchmarks/common.py).

    python benchmarks/translation.py --quick     # CPU, about 4 minutes
    python benchmarks/translation.py             # GPU, full size (all Tatoeba pairs, 2,000 to decode)
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time

import numpy as np

from common import DATA, alternate, markdown_table, median, paired_ratio, parser, report, resolve_device, spread, synchronize


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per case (default 7 quick, 10 full)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's); 1 steadies CPU figures on a machine shared with other work")
    args = p.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from headsearch.tasks import DataSource, apply_overrides, get_task, resolve_config

    device = resolve_device(args.device)
    repeats = args.repeats or (7 if args.quick else 10)
    epoch_pairs = 3200 if args.quick else None  # pairs of a timed round's epoch (None: all)
    train_steps = 300 if args.quick else 2000  # before decoding
    task = get_task("translation-en-es")
    data = {} if args.quick else {"train_limit": None, "val_size": 2000}
    cfg = apply_overrides(task, resolve_config(task, preset="tiny"), {"data": data})
    t0 = time.perf_counter()
    bound = task.setup(cfg, DataSource(None, DATA / "spa-eng" / "spa.txt"), device)
    setup_s = time.perf_counter() - t0

    notes: list[str] = []
    train_rows, train_ratio, epoch = training_rows(bound, cfg, device, epoch_pairs, repeats)
    model = trained_model(bound, cfg, device, train_steps)
    decode_rows, decode_ratio = decoding_rows(bound, model, device, repeats, notes)
    rows = train_rows + decode_rows

    ladder = bound.batcher.buckets or cfg.data.bucket_lengths("cuda")
    notes = [
        f"tiny preset: {cfg.arch.enc_layers}+{cfg.arch.dec_layers} layers x {cfg.arch.enc_heads[0]} heads, d_model "
        f"{cfg.arch.d_model}, batch {cfg.train.batch_size}, {bound.n_train:,} training pairs (max_len {bound.max_len}), "
        f"{len(bound.eval_sets['val']['refs']):,} validation pairs; data set up in {setup_s:.1f} s "
        f"(tokenizers cached), the device table of a batcher built in {build_seconds(bound, device):.2f} s",
        f"training: one epoch of {epoch[0]:,} pairs ({epoch[1]} steps) a round, {repeats} rounds after one warm-up round;"
        f" fixed lengths {list(ladder)}; "
        "'padded length' is the mean padded width of a batch's source and target (equal with fixed lengths)",
        f"decoding: the whole validation split in batches of {cfg.data.eval_batch_size}, each capped at 1.5 x its "
        f"longest source + 10 tokens as in evaluate; the model trained {train_steps} steps first",
    ] + notes
    notes.append("rates are medians of the rounds; 'vs reference' is the median of the per-round ratios; ± is half "
                 "the range of the rounds")
    table = markdown_table(["benchmark", "path", "rate", "vs reference", "padded length", "±"], rows)
    report("Translation: device-resident batches and key/value-cache decoding", table, device, args, notes)
    if device.type == "cpu" and (train_ratio < 1.0 or decode_ratio <= 1.0):
        raise SystemExit(f"on the CPU the new paths must not be slower: training {train_ratio:.2f}x the old batches,"
                         f" decoding {decode_ratio:.2f}x the uncached decoder")


# ------------------------------------------------------------------------------------------ training
@dataclasses.dataclass
class HostBatch:
    src: object  # (B, S) long, on the device
    tgt_in: object  # (B, T)
    tgt_out: object  # (B, T)
    index: object  # (B,)
    n_tokens: int


class HostBatcher:
    """The reference: the batching translation_data.py had before its batches moved to the device.

    Chunks of batch_size * 50 shuffled pairs sorted by source length (ties by target length), batches
    in shuffled order; each batch built on the host by a loop over its rows, padded to its own
    longest source and target, and copied to the device.
    """

    def __init__(self, src_ids, tgt_ids, batch_size: int, bucket_factor: int = 50):
        self.src_ids, self.tgt_ids, self.batch_size, self.bucket_factor = src_ids, tgt_ids, batch_size, bucket_factor
        self._src_len = np.fromiter(map(len, src_ids), dtype=np.int64, count=len(src_ids))
        self._tgt_len = np.fromiter(map(len, tgt_ids), dtype=np.int64, count=len(tgt_ids))

    def batches(self, seed: int, device):
        n, bs = len(self.src_ids), self.batch_size
        rng = np.random.default_rng(seed)
        perm = rng.permutation(n)
        chunk = bs * self.bucket_factor
        batches = []
        for start in range(0, n, chunk):
            idx = perm[start : start + chunk]
            ordered = idx[np.lexsort((self._tgt_len[idx], self._src_len[idx]))]
            batches.extend(ordered[i : i + bs] for i in range(0, len(ordered), bs))
        for i in rng.permutation(len(batches)):
            yield self._make_batch(batches[i], device)

    def _make_batch(self, idx, device):
        import torch

        from headsearch.tasks.translation_data import EOS_ID, PAD_ID, SOS_ID

        b = len(idx)
        s_len, t_len = self._src_len[idx] + 1, self._tgt_len[idx] + 1
        src = np.full((b, s_len.max()), PAD_ID, dtype=np.int64)
        tgt_in = np.full((b, t_len.max()), PAD_ID, dtype=np.int64)
        tgt_out = np.full((b, t_len.max()), PAD_ID, dtype=np.int64)
        for row, i in enumerate(idx):
            s, t = self.src_ids[i], self.tgt_ids[i]
            src[row, : len(s)] = s
            src[row, len(s)] = EOS_ID
            tgt_in[row, 0] = SOS_ID
            tgt_in[row, 1 : len(t) + 1] = t
            tgt_out[row, : len(t)] = t
            tgt_out[row, len(t)] = EOS_ID
        to = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        return HostBatch(to(src), to(tgt_in), to(tgt_out), to(idx.astype(np.int64)), int(t_len.sum()))


def step_case(bound, cfg, device, batches_of_round):
    """Training steps as the trainer takes them (the task's loss, clipping, Adam; bf16 autocast and a
    fused optimizer on CUDA) over a new epoch's batches each round."""
    import torch

    torch.manual_seed(cfg.seed)
    model = bound.build_model().to(device).train()
    t = cfg.train
    opt = torch.optim.Adam(model.parameters(), lr=t.lr, betas=t.betas, eps=t.eps, fused=device.type == "cuda")
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext
    rounds = iter(range(1, 10**6))
    widths: list[float] = []

    def run() -> int:
        samples = 0
        for batch in batches_of_round(next(rounds)):
            with amp():
                loss, n = bound.loss(model, batch, t.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            opt.step()
            samples += n
            widths.append((batch.src.shape[1] + batch.tgt_in.shape[1]) / 2)
        return samples

    return run, widths


def training_rows(bound, cfg, device, epoch_pairs: int | None, repeats: int) -> tuple[list, float, tuple[int, int]]:
    """The table's training rows, the default new path's rate over the old one's, and (pairs, steps) of a round."""
    from headsearch.tasks import translation_data as td

    src, tgt, bs = bound.batcher.src_ids, bound.batcher.tgt_ids, cfg.train.batch_size
    if epoch_pairs and epoch_pairs < len(src):  # random pairs: the file, hence the list, runs from short to long
        pick = np.sort(np.random.default_rng(cfg.seed).choice(len(src), epoch_pairs, replace=False))
        src, tgt = [src[i] for i in pick], [tgt[i] for i in pick]
    host = HostBatcher(src, tgt, bs)
    ladder = cfg.data.bucket_lengths("cuda")
    own = td.BucketBatcher(src, tgt, bs, device=device)
    fixed = td.BucketBatcher(src, tgt, bs, buckets=ladder, device=device)
    default = "own" if bound.batcher.buckets is None else "fixed"
    cases = {
        "old": step_case(bound, cfg, device, lambda r: host.batches(seed=r, device=device)),
        "own": step_case(bound, cfg, device, lambda r: own.batches(shuffle=True, seed=r)),
        "fixed": step_case(bound, cfg, device, lambda r: fixed.batches(shuffle=True, seed=r)),
    }
    rates = alternate({k: run for k, (run, _) in cases.items()}, repeats, device)
    labels = {
        "old": "old: host-built batches, each side padded to its longest sentence (reference)",
        "own": "new: on the device, each side padded to its longest sentence" + (" (default here)" if default == "own" else ""),
        "fixed": f"new: on the device, fixed lengths {'-'.join(map(str, ladder[:1]))}..{ladder[-1]}"
                 + (" (default here)" if default == "fixed" else " (the CUDA default)"),
    }
    rows = [["training steps (samples/s)", labels[k], median(rates[k]), f"{paired_ratio(rates, k, 'old'):.2f}x",
             f"{statistics.mean(cases[k][1]):.1f}", spread(rates[k])] for k in ("old", "own", "fixed")]
    return rows, paired_ratio(rates, default, "old"), (len(src), len(own))


def build_seconds(bound, device) -> float:
    from headsearch.tasks import translation_data as td

    synchronize(device)
    t0 = time.perf_counter()
    td.BucketBatcher(bound.batcher.src_ids, bound.batcher.tgt_ids, bound.batcher.batch_size,
                     buckets=bound.batcher.buckets, device=device)
    synchronize(device)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ decoding
def trained_model(bound, cfg, device, steps: int):
    """The tiny preset's model after `steps` training steps (constant learning rate, as a first epoch would)."""
    import torch

    torch.manual_seed(cfg.seed)
    model = bound.build_model().to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=cfg.train.lr, eps=cfg.train.eps)
    done, epoch = 0, 1
    while done < steps:
        for batch in bound.train_batches(epoch):
            loss, _ = bound.loss(model, batch, cfg.train.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            opt.step()
            done += 1
            if done == steps:
                break
        epoch += 1
    return model.eval()


def decoding_rows(bound, model, device, repeats: int, notes: list) -> tuple[list, float]:
    """The table's decoding rows, and the cached decoder's rate over the uncached one's."""
    import torch

    from headsearch.tasks import translation_data as td

    batches = list(bound.eval_batcher("val", bound.cfg.data.eval_batch_size).batches(shuffle=False))
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext
    outputs: dict[bool, list] = {True: [], False: []}

    def case(use_cache: bool):
        def run() -> int:
            outs = []
            with torch.no_grad(), amp():
                for b in batches:
                    limit = min(bound.max_len - 1, int(b.src_len * 1.5) + 10)
                    outs.append(model.greedy_decode(b.src, td.SOS_ID, td.EOS_ID, max_new_tokens=limit, use_cache=use_cache))
            outputs[use_cache] = outs
            return sum(b.src.shape[0] for b in batches)

        return run

    rates = alternate({"uncached": case(False), "cached": case(True)}, repeats, device)
    same = sum(int(a.shape == b.shape and torch.equal(a[i], b[i]))
               for a, b in zip(outputs[True], outputs[False]) for i in range(a.shape[0]))
    total = sum(b.src.shape[0] for b in batches)
    lengths = [int((row != td.PAD_ID).sum()) for out in outputs[True] for row in out]
    ended = sum(td.EOS_ID in row.tolist() for out in outputs[True] for row in out)
    notes.append(f"decoded translations: {statistics.mean(lengths):.1f} tokens on average, {ended}/{total} ended with EOS "
                 f"before the cap; identical with and without the cache: {same}/{total}")
    speedup = paired_ratio(rates, "cached", "uncached")
    return [
        ["greedy decoding (sentences/s)", "full recomputation of the prefix per token (reference)", median(rates["uncached"]),
         "1.00x", "-", spread(rates["uncached"])],
        ["greedy decoding (sentences/s)", "key/value cache (default)", median(rates["cached"]), f"{speedup:.2f}x", "-",
         spread(rates["cached"])],
    ], speedup


if __name__ == "__main__":
    main()
