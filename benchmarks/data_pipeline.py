"""Benchmark 2: the device-resident CIFAR-10 pipeline against torchvision DataLoader pipelines.

All three deliver the same thing to the training step: shuffled batches of 256 normalised float
images on the device, augmented with the HAM paper's RandomResizedCrop(32, scale=(0.8, 1)) and a
horizontal flip (Martínez-Marín et al.; docs/design.md §4.1). headsearch keeps the uint8 images on
the device and augments whole batches there (`DeviceImages` + `GpuAugment`); the references decode
and augment image by image in DataLoader workers, then copy each batch to the device:
- "torchvision PIL": the HAM paper's own pipeline (PIL images, ToTensor, Normalize);
- "torchvision v2": the faster tensor API (uint8 tensors, v2.RandomResizedCrop, ToDtype, Normalize).

    python benchmarks/data_pipeline.py --quick     # CPU: 10,000 images a round, under a minute
    python benchmarks/data_pipeline.py             # GPU: the 50,000 training images
"""
from __future__ import annotations

import os

from common import DATA, alternate, markdown_table, median, parser, report, resolve_device, spread

BATCH = 256
SCALE, RATIO = (0.8, 1.0), (3 / 4, 4 / 3)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: min(8, cores))")
    p.add_argument("--repeats", type=int, default=None, help="timed epochs per pipeline (default 3 quick, 5 full)")
    args = p.parse_args()

    import numpy as np

    from headsearch.tasks.cifar_data import load_cifar10

    device = resolve_device(args.device)
    arrays = load_cifar10(DATA / "cifar10")
    n = 10_000 if args.quick else len(arrays.train_y)
    x, y = arrays.train_x[:n], arrays.train_y[:n].astype(np.int64)  # (N, 32, 32, 3) uint8, (N,)
    workers = args.workers if args.workers is not None else min(8, os.cpu_count() or 1)
    repeats = args.repeats or (3 if args.quick else 5)

    cases = {
        "headsearch (device-resident)": device_resident(x, y, device),
        "torchvision PIL (HAM paper)": dataloader(x, y, device, workers, "pil"),
        "torchvision v2 (uint8 tensors)": dataloader(x, y, device, workers, "v2"),
    }
    rates = alternate(cases, repeats, device)
    ours = median(rates["headsearch (device-resident)"])
    rows = [[name, median(r), f"{median(r) / ours:.3f}", f"{ours / median(r):.1f}x", spread(r)] for name, r in rates.items()]
    table = markdown_table(["pipeline", "images/s", "rate vs headsearch", "headsearch speed-up", "±"], rows)
    notes = [f"one round = one shuffled epoch of {n:,} training images in batches of {BATCH}, augmented, normalised "
             f"and on the {device.type} device; median of {repeats} rounds after one warm-up round",
             f"DataLoader: {workers} worker processes (persistent), pin_memory={device.type == 'cuda'}"]
    report("CIFAR-10 data pipeline", table, device, args, notes)


def device_resident(x, y, device):
    import torch

    from headsearch.tasks.cifar_data import DeviceImages, GpuAugment

    images = DeviceImages(x, y, device)  # copied to the device once
    augment = GpuAugment(("resized_crop", "flip"), scale=SCALE, ratio=RATIO)
    generator = torch.Generator(device=device).manual_seed(0)

    def epoch() -> int:
        seen = 0
        for xb, yb in images.batches(BATCH, shuffle=True, generator=generator):
            augment(xb, generator)
            seen += len(yb)
        return seen

    return epoch


class ArrayDataset:
    """CIFAR-10 arrays as a map-style dataset, one augmented image per item (what torchvision's CIFAR10 does)."""

    def __init__(self, x, y, transform, as_pil: bool):
        self.x, self.y, self.transform, self.as_pil = x, y, transform, as_pil

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        import torch
        from PIL import Image

        img = Image.fromarray(self.x[i]) if self.as_pil else torch.from_numpy(self.x[i]).permute(2, 0, 1)
        return self.transform(img), int(self.y[i])


def dataloader(x, y, device, workers: int, kind: str):
    import torch
    from torchvision import transforms as T
    from torchvision.transforms import v2

    from headsearch.tasks.cifar_data import CIFAR_MEAN, CIFAR_STD

    if kind == "pil":
        transform = T.Compose([T.RandomResizedCrop(32, scale=SCALE, ratio=RATIO), T.RandomHorizontalFlip(),
                               T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    else:
        transform = v2.Compose([v2.RandomResizedCrop(32, scale=SCALE, ratio=RATIO, antialias=True), v2.RandomHorizontalFlip(),
                                v2.ToDtype(torch.float32, scale=True), v2.Normalize(CIFAR_MEAN, CIFAR_STD)])
    cuda = device.type == "cuda"
    loader = torch.utils.data.DataLoader(
        ArrayDataset(x, y, transform, as_pil=kind == "pil"), batch_size=BATCH, shuffle=True, num_workers=workers,
        pin_memory=cuda, persistent_workers=workers > 0, generator=torch.Generator().manual_seed(0),
    )

    def epoch() -> int:
        seen = 0
        for xb, yb in loader:
            xb = xb.to(device, non_blocking=cuda)
            seen += len(yb.to(device, non_blocking=cuda))
        return seen

    return epoch


if __name__ == "__main__":
    main()
