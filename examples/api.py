"""headsearch from Python: train one architecture, search a space, read the report and the trials, load
the best model. The same runs as the CLI's commands (docs/python-and-trackers.md: "From Python").

    python examples/api.py --data-dir ../shared/data/cifar10 --work api-demo           # a few minutes on a CPU
    python examples/api.py --data-dir ../shared/data/cifar10 --work api-demo --quick   # seconds: tiny slices
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from headsearch import api

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--data-dir", default=None, help="CIFAR-10 folder (default: torchvision's download)")
p.add_argument("--work", type=Path, default=Path("api-demo"), help="folder for the study and the run directories")
p.add_argument("--quick", action="store_true", help="one step per epoch on tiny slices (a smoke run)")
args = p.parse_args()
examples = Path(__file__).resolve().parent

small = {"train": {"max_steps_per_epoch": 2}, "data": {"train_limit": 256, "val_size": 64, "test_limit": 64}} if args.quick else None
storage = f"sqlite:///{args.work / 'search.db'}"

# 1. One architecture: HAM B (additive soft-attention fusion) on the tiny ViT.
run = api.train("vit-cifar10", examples / "ham-b.yaml", preset="tiny", data_dir=args.data_dir, out=args.work / "ham-b",
                device="cpu", sets=small, epochs=1 if args.quick else None)
print(f"trained {run.run_dir}: test accuracy {run.result.test_metrics['accuracy']:.3f}")

# 2. A search over the ham space (9 architectures), the paper's classic ViT first.
rep = api.search("vit-cifar10", space="ham", preset="tiny", trials=3 if args.quick else 9, storage=storage,
                 data_dir=args.data_dir, run_root=str(args.work / "runs"), device="cpu", sets=small,
                 epochs=1 if args.quick else None, enqueue=[examples / "vit-classic.yaml"])
print(f"study {rep.study}: {rep.counts}")
for row in rep.front:
    print(f"  front: {row.skip:7s} {row.fusion:9s} {row.values}")

# 3. Every trial as a DataFrame.
df = api.trials(storage)
print(df[["number", "state", "user_attrs_arch", *[c for c in df.columns if c.startswith("values_")]]].to_string(index=False))

# 4. The front's first architecture, as a model.
model, cfg = api.load_model(rep.front[0].run_dir, data_dir=args.data_dir)
with torch.no_grad():
    logits = model(torch.zeros(2, 3, 32, 32))
print(f"loaded {cfg.arch.enc_heads} skip={cfg.arch.skip} fusion={cfg.arch.fusion}: logits {tuple(logits.shape)}")
