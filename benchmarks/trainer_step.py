"""Benchmark: the trainer against the bare model step, side by side in one process.

The bare step is the least a training step can be: forward, loss, backward and fused AdamW on one
batch that already sits normalised on the device (no data order, no augmentation, no schedule, no
bookkeeping), eager or compiled with torch's own CUDA graphs (`mode="reduce-overhead"`). The trainer
is what `headsearch train` runs, one real epoch at a time (`headsearch.training.trainer.train_epoch`):
the shuffled, augmented CIFAR-10 stream, the learning-rate schedule, the loss bookkeeping, in each
step mode. Target on a GPU: the default mode (auto) at >= 0.9 of the compiled bare step's samples/s.

    python benchmarks/trainer_step.py --quick      # CPU: eager trainer vs eager bare step, a few minutes
    python benchmarks/trainer_step.py              # GPU: every mode, the seed ViT (add --arch ham-b for HAM B)
"""
from __future__ import annotations

import time

from common import DATA, alternate, markdown_table, median, paired_ratio, parser, report, resolve_device, spread, synchronize

ARCHS = {"seed": {}, "ham-b": {"fusion": "add"}}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--arch", default="seed", choices=sorted(ARCHS), help="the seed ViT, or HAM B (fusion add)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per case (default 5 quick, 10 full)")
    p.add_argument("--modes", default=None, help="trainer step modes, comma list (default: off on the CPU; auto,graphs,off on a GPU)")
    args = p.parse_args()

    import torch

    device = resolve_device(args.device)
    torch.manual_seed(0)
    repeats = args.repeats or (5 if args.quick else 10)
    cuda = device.type == "cuda"
    modes = (args.modes or ("auto,graphs,off" if cuda else "off")).split(",")
    bound, cfg = cifar_task(device, args.quick, ARCHS[args.arch])
    epochs_per_round = 1 if args.quick else 3
    bare_steps = bound.batches_per_epoch() * epochs_per_round

    warm: dict[str, float] = {}
    cases = {"bare eager": bare_case(cfg, bound, device, False, bare_steps, warm)}
    if cuda:
        cases["bare compiled (reduce-overhead)"] = bare_case(cfg, bound, device, True, bare_steps, warm)
    for mode in modes:
        cases[f"trainer, compile {mode}"] = trainer_case(cfg, bound, device, mode, epochs_per_round, warm)
    syncs = check_no_syncs(cases, device) if cuda else None
    rates = alternate(cases, repeats, device)

    reference = "bare compiled (reduce-overhead)" if cuda else "bare eager"
    rows = [[name, f"{median(rates[name]):,.0f}", f"{paired_ratio(rates, name, reference):.3f}", spread(rates[name]),
             f"{warm.get(name, 0.0):.1f}"] for name in cases]
    table = markdown_table(["step", "samples/s", f"vs {reference}", "±", "warm-up s"], rows)
    n_train = bound.n_train
    notes = [f"{args.arch} ViT ({cfg.arch.enc_layers} x {cfg.arch.enc_heads[0]} heads, d {cfg.arch.d_model}, fusion {cfg.arch.fusion}),"
             f" batch {cfg.train.batch_size}, {n_train:,} real CIFAR-10 training images an epoch; a trainer round is"
             f" {epochs_per_round} epoch(s) of `train_epoch` (shuffle, augmentation, schedule, bookkeeping), a bare round"
             f" the same number of steps on one resident batch; medians of {repeats} alternating rounds",
             "warm-up (compiling, capturing) happens before the timed rounds and is reported apart"]
    if syncs is not None:
        notes.append(f"host syncs inside a trainer epoch (torch.cuda.set_sync_debug_mode('error') over one round): {syncs}")
    if cuda:
        ratio = paired_ratio(rates, "trainer, compile auto", reference) if "auto" in modes else float("nan")
        notes.append(f"target: trainer (compile auto) >= 0.9 x the compiled bare step: {ratio:.2f}"
                     f" ({'met' if ratio >= 0.9 else 'missed'})")
    report(f"Trainer vs bare step ({args.arch})", table, device, args, notes)


def check_no_syncs(cases: dict, device) -> str:
    """Run one round of each trainer case with CUDA's sync debugging set to raise: a step that reads the
    device back (item, bool, nonzero...) fails here. The epoch's own synchronize calls are explicit, not flagged."""
    import torch

    failed = []
    for name, run in cases.items():
        if not name.startswith("trainer"):
            continue
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        except RuntimeError as e:
            failed.append(f"{name}: {' '.join(str(e).split())[:120]}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return "; ".join(failed) or "none"


def cifar_task(device, quick: bool, arch: dict):
    """The vit-cifar10 task on the real shards beside the checkout (whatever train_*.npz are there)."""
    from headsearch.tasks import DataSource, apply_overrides, get_task, resolve_config

    task = get_task("vit-cifar10")
    over = {"arch": arch, "train": {"epochs": 400, "warmup_epochs": 1, "schedule": "cosine"},
            "data": {"val_size": 1000, "test_limit": 1000}}
    if quick:
        over["data"]["train_limit"] = 2048
    cfg = apply_overrides(task, resolve_config(task), over)
    return task.setup(cfg, DataSource(data_dir=DATA / "cifar10"), device), cfg


def bare_case(cfg, bound, device, compiled: bool, steps: int, warm: dict):
    """The bare step on one real, normalised batch: forward, loss, backward, fused AdamW."""
    import torch
    import torch.nn.functional as F

    from headsearch.training.steps import autocast_context, make_optimizer

    torch.manual_seed(0)
    model = bound.build_model().to(device)
    opt = make_optimizer(model, cfg.train, device)
    step_model = torch.compile(model, mode="reduce-overhead") if compiled else model
    x, y, _ = next(iter(bound.train_batches(1)))
    x = bound.layout(bound.augment.normalize(x))

    def step() -> None:
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast_context(cfg.train, device):
            loss = F.cross_entropy(step_model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    name = f"bare {'compiled (reduce-overhead)' if compiled else 'eager'}"
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(3):  # compile, record the graphs
        step()
    synchronize(device)
    warm[name] = time.perf_counter() - t0

    def run() -> int:
        for _ in range(steps):
            step()
        return steps * len(y)

    return run


def trainer_case(cfg, bound, device, mode: str, epochs: int, warm: dict):
    """The trainer's own epochs in step mode `mode`, on a copy of the task bound to that config."""
    import dataclasses

    import torch

    from headsearch.training.prepare import prepare_steps
    from headsearch.training.runtime import steps_per_epoch
    from headsearch.training.trainer import train_epoch

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=mode))
    mine = bound.rebind(cfg)
    torch.manual_seed(0)
    model = mine.build_model().to(device)
    spe = steps_per_epoch(mine, cfg.train)
    from headsearch.tasks import get_task

    steps, seconds, note = prepare_steps(get_task(cfg.task), cfg.train, mine, model, device, spe)
    warm[f"trainer, compile {mode}"] = seconds
    if note:
        print(f"note ({mode}): {note}")
    print(f"trainer, compile {mode}: {steps.mode.describe()}", flush=True)
    epoch = [0]

    def run() -> int:
        seen = 0
        for _ in range(epochs):
            epoch[0] += 1
            seen += train_epoch(steps, mine, epoch[0], cfg.train.epochs, spe, device)[0]
        return seen

    return run


if __name__ == "__main__":
    main()
