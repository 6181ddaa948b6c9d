"""Benchmark: what compiling costs a search worker per trial, on the installed torch.

A search worker trains trial after trial in one process, each with a freshly built model. headsearch
compiles the transformer blocks (regional compiling, `headsearch.training.fastpath`), expecting Dynamo
to keep one entry per *kind* of block (head count, skip, fusion), so that a trial made of kinds
already seen compiles nothing. That holds where Dynamo inlines `nn.Module`s and guards on their
parameters' shapes rather than on the module object; on torch versions that guard on the module
instance, every new model recompiles every block, each trial pays the compile again, and the cache
entries pile up towards the recompile limit, past which Dynamo runs the blocks eagerly without a word.

This script is a worker's life in miniature: trials of two-layer ViTs made of two block kinds (4 and 8
heads), the second round repeating the first round's architectures with new models. Per trial: the
frames Dynamo compiled and the compile warm-up seconds, against the first trial (which compiles its
kinds) as the reference. Run it under each torch to compare (`make test-oldest` builds the floor's venv):

    .venv/bin/python benchmarks/compile_reuse.py --quick
    .venv-oldest/bin/python benchmarks/compile_reuse.py --quick
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from common import DATA, markdown_table, parser, report, resolve_device

ROUND = ([4, 4], [8, 8], [8, 4], [4, 8])


def trial_config(heads: list[int], quick: bool):
    from headsearch.tasks import apply_overrides, get_task, resolve_config

    task = get_task("vit-cifar10")
    over = {
        "seed": 0,
        "arch": {"d_model": 16 if quick else 48, "enc_layers": 2, "enc_heads": heads, "d_ff": 32 if quick else 96},
        "train": {"epochs": 1, "batch_size": 64, "compile": "default", "max_steps_per_epoch": 2},
        "data": {"train_limit": 128, "val_size": 64, "test_limit": 64},
    }
    return apply_overrides(task, resolve_config(task), over)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds of the four architectures (default 2)")
    args = p.parse_args()

    import torch

    from headsearch.tasks import DataSource
    from headsearch.training import train_run
    from headsearch.training.fastpath import RECOMPILE_LIMIT

    device = resolve_device(args.device)
    frames = torch._dynamo.utils.counters["frames"]
    rows, new_frames, seconds = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for heads in ROUND:
                cfg = trial_config(heads, args.quick)
                before = frames["ok"]
                out = Path(tmp) / f"{r}-{'-'.join(map(str, heads))}"
                _, result = train_run(cfg, DataSource(data_dir=DATA / "cifar10"), out, device=str(device), argv=["compile_reuse"])
                new_frames.append(frames["ok"] - before)
                seconds.append(result.compile_seconds)
                rows.append([len(rows) + 1, "→".join(map(str, heads)), "new" if r == 0 and heads in ROUND[:2] else "seen",
                             new_frames[-1], f"{result.compile_seconds:.2f}",
                             f"{result.compile_seconds / seconds[0]:.2f}", result.step_note or "-"])
    table = markdown_table(["trial", "heads", "block kinds", "frames compiled", "compile s", "vs trial 1", "fallback"], rows)
    later = new_frames[2:]
    per_trial = sum(later) / len(later)
    notes = [f"torch {torch.__version__}: trials made only of block kinds already compiled compiled {per_trial:.1f} frames each"
             f" and spent {sum(seconds[2:]) / len(later):.2f} s warming up (the first trial: {seconds[0]:.2f} s)"]
    if per_trial > 0:
        notes.append(f"every trial recompiles: at {per_trial:.0f} cache entries a trial, Dynamo's limit of {RECOMPILE_LIMIT}"
                     f" (headsearch's setting) is reached after about {RECOMPILE_LIMIT / per_trial:.0f} trials in a worker,"
                     " after which the blocks run eagerly")
    else:
        notes.append("a trial of known block kinds compiles nothing: the fixed cost is paid once per block kind per worker")
    report("Compiled blocks reused across trials", table, device, args, notes)


if __name__ == "__main__":
    main()
