"""vit-cifar10: seed 001's ViT on CIFAR-10 (Krizhevsky 2009), data and augmentation resident on the device."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from headsearch.config import ArchConfig, RunConfig, TrainConfig
from headsearch.errors import ConfigError, DataError
from headsearch.tasks import DataSource, Metric, Task, register

DATA_OPTIONS = {
    "val_size": 5000,  # held out from the 50,000 training images (seeded); 0 validates on the test set, as seed 001 did
    "train_limit": None,  # train on a seeded subset of this many images (presets, quick runs)
    "test_limit": None,  # evaluate on the first N test images (the test set is class-balanced throughout)
    "augment": ["resized_crop", "flip"],  # seed 001's public code; "pad_crop" adds RandomCrop(32, padding 4)
    "eval_batch_size": 1024,
}


def default_config() -> RunConfig:
    """Seed 001: embed 48, 4 layers x 4 heads, MLP 192, AdamW lr 1e-2 (wd 1e-2), batch 256, 400 epochs."""
    return RunConfig(
        task="vit-cifar10",
        arch=ArchConfig(),
        train=TrainConfig(epochs=400, batch_size=256, optimizer="adamw", lr=1e-2, weight_decay=1e-2),
        data=dict(DATA_OPTIONS),
    )


PRESETS = {
    # A CPU smoke run of the seed model: minutes on two cores, clearly above chance.
    "tiny": {
        "train": {"epochs": 6, "batch_size": 128, "lr": 3e-3, "weight_decay": 0.05, "warmup_epochs": 1, "schedule": "cosine"},
        "data": {"train_limit": 20000, "val_size": 2000, "test_limit": None},
        # Each search trial: 6,000 images x 4 epochs (about 30 s here), enough to rank and prune.
        "search": {"train": {"epochs": 4, "warmup_epochs": 0.5},
                   "data": {"train_limit": 6000, "val_size": 1000, "test_limit": 2000, "augment": ["flip"]}},
    },
}


def check_source(source: DataSource) -> None:
    if source.data_file is not None:
        raise DataError("vit-cifar10 reads a directory of CIFAR-10 files: pass --data-dir, not --data-file")
    if source.data_dir is not None and not Path(source.data_dir).is_dir():
        raise DataError(
            f"data directory {source.data_dir} does not exist: pass a folder with train_*.npz + test.npz"
            " or the official cifar-10-batches-py files (or leave --data-dir out to download)"
        )


class BoundCifar:
    """CIFAR-10 resident on the device as uint8; augmentation runs batched on the device."""

    static_shapes = True  # batches are (batch_size, 3, 32, 32) but an epoch's last; warmup_shapes covers that one

    def __init__(self, cfg: RunConfig, source: DataSource, device):
        import numpy as np
        import torch

        from headsearch.tasks.cifar_data import DeviceImages, GpuAugment, load_cifar10, split_train_val

        self.cfg, self.device, opts = cfg, torch.device(device), cfg.data
        arrays = load_cifar10(source.data_dir)
        train_idx, val_idx = split_train_val(len(arrays.train_y), int(opts["val_size"]), cfg.seed)
        if opts["train_limit"]:
            limit = int(opts["train_limit"])
            if not 0 < limit <= len(train_idx):
                raise ConfigError(f"train_limit = {limit} must be between 1 and {len(train_idx)}")
            # A seeded subset, independent of the validation split's draw.
            train_idx = np.sort(np.random.default_rng(cfg.seed + 1).permutation(train_idx)[:limit])
        test_n = int(opts["test_limit"] or len(arrays.test_y))
        self.split = {"seed": cfg.seed, "train": len(train_idx), "val": len(val_idx), "test": test_n,
                      "train_sha256": hashlib.sha256(train_idx.tobytes()).hexdigest(),
                      "val_indices": val_idx.tolist(), "source": arrays.source}
        self.train = DeviceImages(arrays.train_x[train_idx], arrays.train_y[train_idx], self.device)
        self.test = DeviceImages(arrays.test_x[:test_n], arrays.test_y[:test_n], self.device)
        # val_size 0: validate on the test set (what seed 001 reports as "best test accuracy").
        self.val = DeviceImages(arrays.train_x[val_idx], arrays.train_y[val_idx], self.device) if len(val_idx) else self.test
        self.augment = GpuAugment(tuple(opts["augment"]))
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.n_train = len(self.train)
        self.num_classes = len(arrays.label_names)
        self.label_names = arrays.label_names

    def rebind(self, cfg: RunConfig) -> "BoundCifar":
        """The same resident data under another architecture/training config (a search trial).

        The augmentation generator restarts from the seed, so a trial trains exactly as
        `headsearch train` with the same config would.
        """
        import copy

        import torch

        new = copy.copy(self)
        new.cfg = cfg
        new.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        return new

    def with_eval_limit(self, n: int | None) -> "BoundCifar":
        """A copy whose validation and test sets keep their first `n` images (analysis on a sample)."""
        import copy

        new = copy.copy(self)
        if n:
            for split in ("val", "test"):
                images = copy.copy(getattr(self, split))
                images.x, images.y = images.x[:n], images.y[:n]
                setattr(new, split, images)
        return new

    @property
    def channels_last(self) -> bool:
        return self.cfg.train.uses_channels_last(self.device.type)

    def build_model(self):
        """The ViT, channels-last when configured: `.to(device)` keeps that layout."""
        import torch

        from headsearch.models import ViT

        model = ViT(self.cfg.arch, image_size=32, in_chans=3, num_classes=self.num_classes)
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def layout(self, x):
        """Model-ready images in the configured memory layout (channels-last: the patch convolution runs NHWC)."""
        import torch

        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def train_batches(self, epoch: int):
        bs = self.cfg.train.batch_size
        for x, y in self.train.batches(bs, shuffle=True, generator=self.generator):
            yield self.layout(self.augment(x, self.generator)), y

    def warmup_shapes(self, batch, steps_per_epoch: int) -> list:
        """`batch` and, when an epoch reaches the last, partial batch, a batch of that size (its first rows):
        both shapes compile before the timed epochs."""
        x, y = batch
        rest = self.n_train % self.cfg.train.batch_size
        reaches_last = steps_per_epoch * self.cfg.train.batch_size > self.n_train
        return [batch, (x[:rest], y[:rest])] if rest and reaches_last and rest != len(y) else [batch]

    def loss(self, model, batch, label_smoothing: float):
        import torch.nn.functional as F

        x, y = batch
        return F.cross_entropy(model(x), y, label_smoothing=label_smoothing), len(y)

    def evaluate(self, model, split: str) -> dict[str, float]:
        import torch
        import torch.nn.functional as F

        images = {"val": self.val, "test": self.test}[split]
        correct = torch.zeros((), device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        for x, y in images.batches(int(self.cfg.data["eval_batch_size"]), shuffle=False):
            logits = model(self.layout(self.augment.normalize(x))).float()
            correct += (logits.argmax(-1) == y).sum()
            loss_sum += F.cross_entropy(logits, y, reduction="sum")
        n = len(images)
        return {"accuracy": correct.item() / n, "loss": loss_sum.item() / n}

    def write_artifacts(self, run_dir: Path) -> None:
        (run_dir / "split.json").write_text(json.dumps(self.split))


def setup(cfg: RunConfig, source: DataSource, device, run_dir: Path | None = None) -> BoundCifar:
    augment = cfg.data.get("augment")
    if not isinstance(augment, (list, tuple)):
        raise ConfigError(f"data.augment = {augment!r} must be a list, e.g. [resized_crop, flip]")
    return BoundCifar(cfg, source, device)


TASK = register(
    Task(
        name="vit-cifar10",
        description="ViT on CIFAR-10 (seed 001): accuracy; data and augmentation on the device",
        metrics=(Metric("accuracy", "maximize", "top-1 accuracy"), Metric("loss", "minimize", "cross-entropy")),
        default_config=default_config,
        presets=PRESETS,
        data_options=DATA_OPTIONS,
        check_source=check_source,
        setup=setup,
    )
)
