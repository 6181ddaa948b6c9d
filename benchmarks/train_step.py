"""Benchmark 1: training-step throughput against PyTorch's own transformer layers.

A step is what the trainer does: forward under the trainer's autocast, loss, backward, the trainer's
optimizer (fused AdamW on CUDA). Inputs are real: CIFAR-10 test images (normalised, batch 256 as
in the HAM paper, docs/design.md §4.1) and length-bucketed English-Spanish batches. Each headsearch
model is timed against a reference of the same sizes built from `nn.TransformerEncoderLayer` /
`nn.Transformer` (benchmarks/references.py), alternating in one process, median of the rounds.

The ratio column is time per step against the reference: classic attention must stay at or below
1.05. The overhead column is each skip / fusion variant against headsearch's classic attention.

    python benchmarks/train_step.py --quick          # CPU, about 3 minutes
    python benchmarks/train_step.py                  # GPU, full sizes
    python benchmarks/train_step.py --compile        # also torch.compile both sides (compile time reported)
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from common import DATA, alternate, markdown_table, median, paired_ratio, parser, report, resolve_device, spread, synchronize

VARIANTS = {  # name -> ArchConfig overrides of the classic model (ViT and Seq2Seq)
    "skip output (Deep Head)": {"skip": "output"},
    "skip scores (RealFormer)": {"skip": "scores"},
    "HAM A (hadamard)": {"fusion": "hadamard"},
    "HAM B (add)": {"fusion": "add"},
    "HAM B, key-only soft score": {"fusion": "add", "soft_score": "key"},
    "value residual (ResFormer)": {"skip": "value"},
    "U-net skips": {"skip": "unet"},
    "dense skips (DenseFormer)": {"skip": "dense"},
    "differential (DIFF Transformer)": {"fusion": "differential"},
}
SCHEDULE_BASE = {"d_model": 64, "enc_layers": 6, "d_ff": 256}  # 6 layers so that 64 heads can halve to 2


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--compile", action="store_true", help="torch.compile both models; warm-up outside the timing")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per case (default 9 quick, 20 full)")
    args = p.parse_args()

    import torch

    device = resolve_device(args.device)
    torch.manual_seed(0)
    repeats = args.repeats or (9 if args.quick else 20)
    steps = 2 if args.quick else (5 if device.type == "cpu" else 50)  # steps per timed round
    rows, notes = [], []

    vit = vit_cases(device, steps, args.compile)
    rows += ratio_rows("ViT seed (4 x 4 heads, d 48), batch 256", vit["ours"], vit["reference"], repeats, device)
    rows += overhead_rows("ViT seed", vit["ours"], vit["variants"], max(3, repeats // 3), device)
    rows += ratio_rows("ViT 6 x 4 heads (d 64)", vit["uniform"], vit["uniform_reference"], max(3, repeats // 2), device)
    rows += ratio_rows("ViT 64->32->16->8->4->2 heads (d 64)", vit["schedule"], vit["schedule_reference"],
                       max(3, repeats // 2), device, base=vit["uniform"])
    mt = translation_cases(device, args.quick, args.compile)
    label = f"Seq2Seq {mt['desc']}"
    rows += ratio_rows(label, mt["ours"], mt["reference"], repeats, device)
    rows += overhead_rows("Seq2Seq", mt["ours"], mt["variants"], max(3, repeats // 3), device)

    compile_times = {**vit["compile_s"], **mt["compile_s"]}
    if compile_times:
        notes.append("torch.compile warm-up (excluded from every rate): "
                     + ", ".join(f"{k} {v:.1f} s" for k, v in compile_times.items()))
    notes.append(f"rates are medians of timed rounds of {steps} step(s) (ViT) / {mt['batches']} batches (Seq2Seq); "
                 "± is half the range of the rounds; time ratio = reference rate / headsearch rate and overhead = classic rate / variant rate, "
                 "each the median of the ratios within rounds (<= 1.05 required for classic).")
    notes.append("tokens/s counts 65 tokens per image (64 patches + CLS) and the non-pad target tokens for Seq2Seq.")
    table = markdown_table(["model", "implementation", "samples/s", "tokens/s", "time ratio", "overhead vs classic", "±"], rows)
    report("Training-step throughput", table, device, args, notes)
    ok = all(r[4] == "-" or float(r[4]) <= 1.05 for r in rows if r[1] == "headsearch classic")
    if not ok:
        raise SystemExit("classic attention is more than 5% slower than the PyTorch reference")


# --------------------------------------------------------------------------------------------- cases
@dataclasses.dataclass
class Case:
    run: Callable[[], int]  # one timed round; returns the samples it processed
    tokens_per_sample: float


def make_case(model, batches, loss_fn, device, compile_model: bool, compile_s: dict, name: str,
              samples: int, tokens: int) -> Case:
    """Training steps over `batches` with the trainer's own optimizer and autocast."""
    import torch

    from headsearch.config import TrainConfig
    from headsearch.training.steps import autocast_context, make_optimizer

    model = model.to(device)
    t = TrainConfig(optimizer="adamw", lr=1e-3, weight_decay=0.01)
    opt = make_optimizer(model, t, device)  # fused AdamW on CUDA, as in training
    step_model = torch.compile(model) if compile_model else model

    def step(batch) -> None:
        with autocast_context(t, device):  # bf16 on CUDA, fp32 on the CPU, as in training
            loss = loss_fn(step_model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    if compile_model:  # compile (and autotune) now, outside every timed round, and report its cost
        synchronize(device)
        t0 = time.perf_counter()
        for b in batches[:2]:
            step(b)
        synchronize(device)
        compile_s[name] = time.perf_counter() - t0

    def run() -> int:
        for b in batches:
            step(b)
        return samples

    return Case(run, tokens / samples)


def image_batches(device, steps: int, bs: int = 256) -> list:
    """`steps` batches of real CIFAR-10 test images, normalised, resident on the device.

    Reads test.npz alone, so a GPU machine needs only that shard (and spa.txt) for this benchmark.
    """
    import numpy as np
    import torch

    from headsearch.tasks.cifar_data import GpuAugment

    n = bs * steps
    with np.load(DATA / "cifar10" / "test.npz", allow_pickle=False) as f:
        x_nhwc, labels = f["x"][:n], f["y"][:n].astype(np.int64)
    x = torch.from_numpy(x_nhwc).to(device).permute(0, 3, 1, 2).contiguous()  # (N, 3, 32, 32) uint8
    y = torch.from_numpy(labels).to(device)
    images = GpuAugment().normalize(x)
    return [(images[i : i + bs], y[i : i + bs]) for i in range(0, n, bs)]


def vit_case(cfg, reference: bool, batches, device, compile_model, compile_s, name) -> Case:
    import torch.nn.functional as F

    from headsearch.models import ViT
    from references import ReferenceViT

    model = (ReferenceViT if reference else ViT)(cfg)
    samples = sum(len(b[1]) for b in batches)
    tokens = samples * ((32 // cfg.patch_size) ** 2 + 1)  # patches + CLS
    return make_case(model, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]), device, compile_model,
                     compile_s, name, samples, tokens)


def vit_cases(device, steps: int, compile_model: bool) -> dict:
    from headsearch.config import ArchConfig

    batches = image_batches(device, steps)
    compile_s: dict[str, float] = {}
    case = lambda cfg, ref, name: vit_case(cfg, ref, batches, device, compile_model, compile_s, name)  # noqa: E731
    seed, uniform = ArchConfig(), ArchConfig(**SCHEDULE_BASE, enc_heads=4)
    halving = ArchConfig(**SCHEDULE_BASE, enc_heads=(64, 32, 16, 8, 4, 2))
    return {
        "ours": case(seed, False, "ViT"),
        "reference": case(seed, True, "ViT reference"),
        "variants": {k: case(dataclasses.replace(seed, **v), False, k) for k, v in VARIANTS.items()},
        "uniform": case(uniform, False, "ViT 6x4"),
        "uniform_reference": case(uniform, True, "ViT 6x4 reference"),
        "schedule": case(halving, False, "ViT 64->2"),
        "schedule_reference": case(halving, True, "ViT 64->2 reference"),
        "compile_s": compile_s,
    }


def translation_cases(device, quick: bool, compile_model: bool) -> dict:
    """The tiny preset's model (quick) or a small one (full) on real, length-bucketed Tatoeba batches."""
    import torch.nn.functional as F

    from headsearch.models import Seq2Seq
    from headsearch.tasks import DataSource, get_task, resolve_config
    from headsearch.tasks.translation_data import PAD_ID
    from references import ReferenceSeq2Seq

    task = get_task("translation-en-es")
    cfg = resolve_config(task, preset="tiny")
    batch_size = 64 if quick else 128
    if not quick:  # "a small config": 4+4 layers of width 256
        cfg = dataclasses.replace(cfg, arch=dataclasses.replace(cfg.arch, d_model=256, enc_layers=4, enc_heads=8, dec_layers=4,
                                                dec_heads=8, d_ff=1024))
    # Attention dropout as nn.Transformer applies it (its one dropout also drops attention weights).
    arch = dataclasses.replace(cfg.arch, attn_dropout=cfg.arch.dropout)
    cfg = dataclasses.replace(cfg, arch=arch, train=dataclasses.replace(cfg.train, batch_size=batch_size))
    bound = task.setup(cfg, DataSource(None, DATA / "spa-eng" / "spa.txt"), device)
    n_batches = 16 if quick else 50
    batches = [b for _, b in zip(range(n_batches), bound.train_batches(1))]
    samples = sum(b.src.shape[0] for b in batches)
    tokens = sum(b.n_tokens for b in batches)
    vocab = (bound.src_tok.get_vocab_size(), bound.tgt_tok.get_vocab_size())

    def loss(model, b):
        logits = model(b.src, b.tgt_in)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), b.tgt_out.flatten(), ignore_index=PAD_ID)

    compile_s: dict[str, float] = {}

    def case(a, reference: bool, name: str) -> Case:
        model = (ReferenceSeq2Seq if reference else Seq2Seq)(a, *vocab, bound.max_len, PAD_ID)
        return make_case(model, batches, loss, device, compile_model, compile_s, name, samples, tokens)

    desc = (f"({arch.enc_layers}+{arch.dec_layers} x {arch.enc_heads[0]} heads, d {arch.d_model}), "
            f"batch {batch_size}")
    return {
        "desc": desc,
        "batches": n_batches,
        "ours": case(arch, False, "Seq2Seq"),
        "reference": case(arch, True, "Seq2Seq reference"),
        "variants": {k: case(dataclasses.replace(arch, **v), False, f"Seq2Seq {k}") for k, v in VARIANTS.items()},
        "compile_s": compile_s,
    }


# ---------------------------------------------------------------------------------------------- rows
def ratio_rows(label: str, ours: Case, ref: Case, repeats: int, device, base: Case | None = None) -> list:
    """headsearch's classic attention against the reference, alternating; overhead against `base` if given."""
    cases = {"ours": ours.run, "ref": ref.run}
    if base is not None:
        cases["base"] = base.run
    rates = alternate(cases, repeats, device)
    m_ours, m_ref = median(rates["ours"]), median(rates["ref"])
    overhead = f"{paired_ratio(rates, 'base', 'ours'):.2f}x" if base is not None else "-"
    ratio = paired_ratio(rates, "ref", "ours")
    return [
        [label, "headsearch classic", m_ours, m_ours * ours.tokens_per_sample, f"{ratio:.3f}", overhead, spread(rates["ours"])],
        [label, "PyTorch reference", m_ref, m_ref * ref.tokens_per_sample, "1.000", "-", spread(rates["ref"])],
    ]


def overhead_rows(label: str, classic: Case, variants: dict[str, Case], repeats: int, device) -> list:
    """Each variant alternating with classic attention; overhead = classic rate / variant rate.

    The classic row is repeated from these rounds, so each overhead reads against the rate beside it.
    """
    rates = alternate({"classic": classic.run, **{k: v.run for k, v in variants.items()}}, repeats, device)
    m_classic = median(rates["classic"])
    rows = [[label, "classic (in these rounds)", m_classic, m_classic * classic.tokens_per_sample, "-", "1.00x",
             spread(rates["classic"])]]
    return rows + [[label, name, median(rates[name]), median(rates[name]) * variants[name].tokens_per_sample, "-",
                    f"{paired_ratio(rates, 'classic', name):.2f}x", spread(rates[name])] for name in variants]


if __name__ == "__main__":
    main()
