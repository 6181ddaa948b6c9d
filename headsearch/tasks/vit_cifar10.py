"""vit-cifar10: the heterogeneous-attention ViT of Martínez-Marín et al. (HAM) on CIFAR-10 (Krizhevsky 2009),
with the data and its augmentation resident on the device."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from headsearch.config import ArchConfig, DataOptions, RunConfig, TrainConfig, coerce_fields, path_problem
from headsearch.errors import ConfigError, DataError
from headsearch.io import write_atomic
from headsearch.tasks.base import DataSource, Metric, PatchAttention, Task, limited, rebound, seeded_subset

# What data.augment accepts: the ops cifar_data.GpuAugment implements (a test keeps the two equal; cifar_data
# imports torch, which registering a task must not).
AUGMENTATIONS = ("flip", "resized_crop", "pad_crop")
TRAIN_IMAGES, TEST_IMAGES = 50_000, 10_000  # the official CIFAR-10 split


@dataclass(frozen=True)
class CifarData(DataOptions):
    """Data options of vit-cifar10, checked on construction (before any data loads)."""

    val_size: int = 5000  # held out from the 50,000 training images (seeded); 0 validates on the test set, as the HAM paper did
    train_limit: int | None = None  # train on a seeded subset of this many images (presets, quick runs)
    test_limit: int | None = None  # evaluate on the first N test images (the test set is class-balanced throughout)
    augment: tuple[str, ...] = ("resized_crop", "flip")  # the HAM paper's code; "pad_crop" adds RandomCrop(32, padding 4)
    eval_batch_size: int = 1024

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("val_size", "train_limit", "test_limit", "eval_batch_size"), optional=("train_limit", "test_limit"))
        if not 0 <= self.val_size < TRAIN_IMAGES:
            raise ConfigError(f"data.val_size = {self.val_size} must be in [0, {TRAIN_IMAGES}) (0: validate on the test set)")
        if self.train_limit is not None and not 1 <= self.train_limit <= TRAIN_IMAGES - self.val_size:
            raise ConfigError(f"data.train_limit = {self.train_limit} must be between 1 and {TRAIN_IMAGES - self.val_size}"
                              f" (the training images left after val_size = {self.val_size}), or null for all")
        if self.test_limit is not None and not 1 <= self.test_limit <= TEST_IMAGES:
            raise ConfigError(f"data.test_limit = {self.test_limit} must be between 1 and {TEST_IMAGES}, or null for all")
        if self.eval_batch_size < 1:
            raise ConfigError(f"data.eval_batch_size = {self.eval_batch_size} must be at least 1")
        augment = self.augment
        if isinstance(augment, str) or not isinstance(augment, (list, tuple)):
            raise ConfigError(f"data.augment = {augment!r} must be a list, e.g. [resized_crop, flip]")
        unknown = [op for op in augment if op not in AUGMENTATIONS]
        if unknown:
            raise ConfigError(f"data.augment: unknown augmentation(s) {unknown}: use any of {', '.join(AUGMENTATIONS)}")
        object.__setattr__(self, "augment", tuple(augment))


def default_config() -> RunConfig:
    """The HAM paper's ViT: embed 48, 4 layers x 4 heads, MLP 192, AdamW lr 1e-2 (wd 1e-2), batch 256, 400 epochs."""
    return RunConfig(
        task="vit-cifar10",
        arch=ArchConfig(),
        train=TrainConfig(epochs=400, batch_size=256, optimizer="adamw", lr=1e-2, weight_decay=1e-2),
        data=CifarData(),
    )


PRESETS = {
    # A CPU smoke run of the paper's model: minutes on two cores, clearly above chance.
    "tiny": {
        "train": {"epochs": 6, "batch_size": 128, "lr": 3e-3, "weight_decay": 0.05, "warmup_epochs": 1, "schedule": "cosine"},
        "data": {"train_limit": 20000, "val_size": 2000, "test_limit": None},
        # Each search trial: 6,000 images x 4 epochs (about 30 s here), enough to rank and prune.
        "search": {"train": {"epochs": 4, "warmup_epochs": 0.5},
                   "data": {"train_limit": 6000, "val_size": 1000, "test_limit": 2000, "augment": ["flip"]}},
    },
}


IMAGE_SIZE, CHANNELS, CLASSES = 32, 3, 10


def check_config(cfg: RunConfig) -> None:
    """What the ViT needs of an architecture, checked before any data loads or directory exists."""
    from headsearch.models.checks import check_vit_arch

    check_vit_arch(cfg.arch, IMAGE_SIZE)


def footprint(cfg: RunConfig):
    from headsearch.models.size import vit_footprint

    return vit_footprint(cfg.arch, cfg.train.batch_size, IMAGE_SIZE, CHANNELS, CLASSES)


def check_source(source: DataSource) -> None:
    if source.data_file is not None:
        raise DataError("vit-cifar10 reads a directory of CIFAR-10 files: pass --data-dir, not --data-file")
    if source.data_dir is not None and (problem := path_problem(source.data_dir, "folder")):
        raise DataError(
            f"data directory {source.data_dir} {problem}: pass a folder with train_*.npz + test.npz"
            " or the official cifar-10-batches-py files (or leave --data-dir out to download)"
        )


class BoundCifar:
    """CIFAR-10 resident on the device as uint8; augmentation runs batched on the device. The task's `setup`
    (`run_dir`: nothing of a run's own is reloaded, the split follows from the seed)."""

    def __init__(self, cfg: RunConfig, source: DataSource, device, run_dir: Path | None = None):
        import torch

        from headsearch.tasks.cifar_data import DeviceImages, GpuAugment, load_cifar10, split_train_val

        self.cfg, self.device, opts = cfg, torch.device(device), cfg.data
        arrays = load_cifar10(source.data_dir)
        train_idx, val_idx = split_train_val(len(arrays.train_y), opts.val_size, cfg.seed)
        train_idx = seeded_subset(train_idx, opts.train_limit, cfg.seed, "training images")
        test_n = min(opts.test_limit or len(arrays.test_y), len(arrays.test_y))
        self.split = {"seed": cfg.seed, "train": len(train_idx), "val": len(val_idx), "test": test_n,
                      "train_sha256": hashlib.sha256(train_idx.tobytes()).hexdigest(),
                      "val_indices": val_idx.tolist(), "source": arrays.source}
        self.train = DeviceImages(arrays.train_x[train_idx], arrays.train_y[train_idx], self.device)
        test = DeviceImages(arrays.test_x[:test_n], arrays.test_y[:test_n], self.device)
        # val_size 0: validate on the test set (what the HAM paper reports as "best test accuracy").
        val = DeviceImages(arrays.train_x[val_idx], arrays.train_y[val_idx], self.device) if len(val_idx) else test
        self.eval_sets = {"val": val, "test": test}
        self.augment = GpuAugment(opts.augment)
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.n_train = len(self.train)
        self.label_names = arrays.label_names

    # -- the same data under another config ------------------------------------------------------
    def rebind(self, cfg: RunConfig) -> "BoundCifar":
        """The same resident data under another architecture/training config (a search trial).

        The augmentation generator restarts from the seed, so a trial trains exactly as
        `headsearch train` with the same config would.
        """
        import torch

        return rebound(self, cfg, generator=torch.Generator(device=self.device).manual_seed(cfg.seed))

    def with_eval_limit(self, n: int | None) -> "BoundCifar":
        """A copy whose validation and test sets keep their first `n` images (analysis on a sample)."""
        import copy

        def first(images, k):
            cut = copy.copy(images)
            cut.x, cut.y = images.x[:k], images.y[:k]
            return cut

        return limited(self, n, first)

    # -- training --------------------------------------------------------------------------------
    @property
    def channels_last(self) -> bool:
        return self.cfg.train.uses_channels_last(self.device.type)

    def build_model(self):
        """The ViT, channels-last when configured: `.to(device)` keeps that layout."""
        import torch

        from headsearch.models import ViT

        model = ViT(self.cfg.arch, image_size=IMAGE_SIZE, in_chans=CHANNELS, num_classes=len(self.label_names))
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def layout(self, x):
        """Model-ready images in the configured memory layout (channels-last: the patch convolution runs NHWC)."""
        import torch

        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def batches_per_epoch(self) -> int:
        return -(-self.n_train // self.cfg.train.batch_size)

    def train_batches(self, epoch: int):
        """(images uint8 (B, 3, 32, 32), labels (B,), augmentation draws (B, U)) on the device.

        The augmentation itself runs in `loss`, from the draws: a training step is then pure tensor
        work on fixed shapes, which the trainer can capture in one CUDA graph with the model."""
        bs = self.cfg.train.batch_size
        for x, y in self.train.batches(bs, shuffle=True, generator=self.generator):
            yield x, y, self.augment.draw(len(y), self.generator, self.device)

    def data_state(self):
        """The generator of shuffles and augmentation draws, which goes on across epochs: what a paused run keeps
        to resume with the same data order (`headsearch.training.pause`)."""
        return self.generator.get_state()

    def load_data_state(self, state) -> None:
        self.generator.set_state(state)

    def warmup_batches(self, steps_per_epoch: int) -> list:
        """A first batch (from a fresh data order: the run's own is untouched) and, when an epoch reaches
        the last, partial batch, a batch of that size: both shapes compile before the timed epochs."""
        x, y, u = batch = next(iter(self.rebind(self.cfg).train_batches(1)))
        rest = self.n_train % self.cfg.train.batch_size
        reaches_last = steps_per_epoch * self.cfg.train.batch_size > self.n_train
        return [batch, (x[:rest], y[:rest], u[:rest])] if rest and reaches_last and rest != len(y) else [batch]

    def loss(self, model, batch, label_smoothing: float):
        """Augment (HAM's flips and crops, from the batch's draws), then cross-entropy of the model's logits."""
        import torch.nn.functional as F

        x, y, u = batch
        images = self.layout(self.augment.apply(x, u))  # (B, 3, 32, 32) float, normalised
        return F.cross_entropy(model(images), y, label_smoothing=label_smoothing), len(y)

    # -- cohorts (headsearch.training.cohort) -------------------------------------------------------
    def build_cohort(self, models, soft_columns: int | None):
        """The solo ViTs `models` as one `StackedViT` (slot k = models[k])."""
        from headsearch.models.cohort import StackedViT

        return StackedViT.from_models(models, soft_columns)

    def cohort_loss(self, stacked, batches, label_smoothing: float):
        """Each slot's cross-entropy on its own batch (a list of `train_batches` items, one a slot, of one size):
        (K,) losses and the batch size. Augmentation is per image, so one call augments every slot's images."""
        import torch
        import torch.nn.functional as F

        x, y, u = (torch.stack(parts) for parts in zip(*batches))  # (K, B, 3, 32, 32), (K, B), (K, B, U)
        k, b = y.shape
        images = self.augment.apply(x.flatten(0, 1), u.flatten(0, 1))  # (K·B, 3, 32, 32)
        logits = stacked(images.view(k, b, *images.shape[1:]))  # (K, B, classes)
        losses = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), label_smoothing=label_smoothing, reduction="none")
        return losses.view(k, b).mean(dim=1), b

    def evaluate(self, model, split: str) -> dict[str, float]:
        import torch
        import torch.nn.functional as F

        images = self.eval_sets[split]
        correct = torch.zeros((), device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        for x, y in images.batches(self.cfg.data.eval_batch_size, shuffle=False):
            logits = model(self.layout(self.augment.normalize(x))).float()
            correct += (logits.argmax(-1) == y).sum()
            loss_sum += F.cross_entropy(logits, y, reduction="sum")
        n = len(images)
        return {"accuracy": correct.item() / n, "loss": loss_sum.item() / n}

    def write_artifacts(self, run_dir: Path) -> None:
        write_atomic(run_dir / "split.json", json.dumps(self.split))

    def write_outputs(self, run_dir: Path) -> None:
        """Nothing beyond the metrics: accuracy needs no per-image file."""

    # -- analysis --------------------------------------------------------------------------------
    def analysis_batches(self, split: str, samples: int | None, batch_size: int) -> list[dict]:
        """The first `samples` images of `split`, normalised, unshuffled: {"inputs": (images,), "masks": {}, "targets": labels}."""
        images = self.with_eval_limit(samples).eval_sets[split]
        return [{"inputs": (self.augment.normalize(x),), "masks": {}, "targets": y}
                for x, y in images.batches(batch_size, shuffle=False)]

    def summed_loss(self, model, batch):
        """Cross-entropy summed over the batch's images (no label smoothing), and the image count."""
        import torch.nn.functional as F

        logits = model(*batch["inputs"]).float()  # (B, classes)
        return F.cross_entropy(logits, batch["targets"], reduction="sum"), int(batch["targets"].numel())

    def attention_views(self, model, samples: int = 4) -> list[PatchAttention]:
        """Every layer's attention on the first `samples` test images, for maps over the 8x8 patch grid."""
        import torch

        images = self.eval_sets["test"]
        x, y = images.x[:samples], images.y[:samples]  # uint8 (N, 3, 32, 32), (N,)
        with torch.no_grad():
            logits, weights = model(self.augment.normalize(x), need_weights=True)
        names = self.label_names
        return [PatchAttention(
            images=x.permute(0, 2, 3, 1).cpu().numpy(),
            labels=[names[i] for i in y.tolist()],
            predictions=[names[i] for i in logits.argmax(-1).tolist()],
            weights=[w.self_attn.float().cpu() for w in weights],
            soft=[w.soft.float().cpu() if w.soft is not None else None for w in weights],
            grid=int(round((weights[0].self_attn.shape[-1] - 1) ** 0.5)),
        )]


def stack_refusal(cfg: RunConfig) -> str | None:
    from headsearch.models.cohort import stack_refusal as arch_refusal

    return arch_refusal(cfg.arch)


TASK = Task(
    name="vit-cifar10",
    description="ViT on CIFAR-10 (HAM, Martínez-Marín et al.): accuracy; data and augmentation on the device",
    metrics=(Metric("accuracy", "maximize", "top-1 accuracy"), Metric("loss", "minimize", "cross-entropy")),
    default_config=default_config,
    presets=PRESETS,
    data_options=CifarData,
    check_source=check_source,
    setup=BoundCifar,
    # Batches are (batch_size, 3, 32, 32) but an epoch's last, which warmup_batches covers.
    static_shapes=True,
    check_config=check_config,
    footprint=footprint,
    stack_refusal=stack_refusal,
)
