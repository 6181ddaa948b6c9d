"""CIFAR-10 for the ViT task: loading, a seeded validation split, and augmentation on the device.

CIFAR-10: A. Krizhevsky, "Learning Multiple Layers of Features from Tiny Images", technical report,
University of Toronto, 2009.

The whole dataset is small (60,000 images of 32x32x3 bytes, 184 MB as uint8), so training keeps it
resident on the device and augments whole batches there, as airbench does, instead of decoding and
augmenting image by image in DataLoader workers: the CPU stops being the bottleneck, and every random
draw comes from one generator on the device, so a run is reproducible from its seed.

`load_cifar10` reads, from a directory,
- npz shards (the layout of the project's shared copy): ``train_*.npz`` + ``test.npz``, each with
  ``x`` uint8 (N, 32, 32, 3) HWC RGB, ``y`` (N,) in 0..9 and ``label_names`` (10,); or
- the official python release, a ``cifar-10-batches-py`` folder with ``data_batch_1`` ..
  ``data_batch_5``, ``test_batch`` and ``batches.meta`` (the folder itself or its parent);
and, with no directory, downloads through torchvision.
"""
from __future__ import annotations

import math
import pickle
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from headsearch.config import path_problem
from headsearch.errors import ConfigError, DataError

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
# The figures of the augmentation table of Martínez-Marín et al. (HAM), widely copied across CIFAR code.
# The true per-channel std of the training pixels is (0.2470, 0.2435, 0.2616); these stay so results
# compare with that paper (docs/design.md §4.1).
CIFAR_STD = (0.2023, 0.1994, 0.2010)

NUM_CLASSES = 10
IMAGE_SHAPE = (32, 32, 3)  # HWC, as stored on disk
DEFAULT_DOWNLOAD_ROOT = Path("~/.cache/headsearch/cifar10")

_NPZ_FILES = "train_*.npz + test.npz"
_PY_DIR = "cifar-10-batches-py"
_PY_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_PY_TEST = "test_batch"
_PY_META = "batches.meta"
_PY_FILES = "data_batch_1..data_batch_5, test_batch, batches.meta"
_EXPECTED = f"expected {_NPZ_FILES} (x, y, label_names), or a {_PY_DIR} folder with {_PY_FILES}"

# torchvision's RandomResizedCrop tries this many (area, ratio) draws before its central-crop fallback.
_CROP_ATTEMPTS = 10
# U[0, 1) numbers each augmentation reads per image: a coin; an (area, ratio) pair per attempt and a corner; a corner.
_UNIFORMS = {"flip": 1, "resized_crop": 2 * _CROP_ATTEMPTS + 2, "pad_crop": 2}
AUGMENTATIONS = tuple(_UNIFORMS)  # the ops GpuAugment implements


@dataclass(frozen=True)
class CifarArrays:
    """CIFAR-10 in host memory, exactly as read."""

    train_x: np.ndarray  # (N, 32, 32, 3) uint8, HWC RGB
    train_y: np.ndarray  # (N,) int64 in 0..9
    test_x: np.ndarray  # (M, 32, 32, 3) uint8
    test_y: np.ndarray  # (M,) int64
    label_names: tuple[str, ...]
    source: str  # human-readable: which layout / path it came from


# --------------------------------------------------------------------------------------------- loading


def load_cifar10(data_dir: str | Path | None, download_root: str | Path | None = None) -> CifarArrays:
    """Load CIFAR-10 from `data_dir` (npz shards or `cifar-10-batches-py`), or download it if None.

    Raises DataError, naming the path and the files expected, when the data is missing or malformed.
    """
    if data_dir is None:
        return _download(Path(download_root or DEFAULT_DOWNLOAD_ROOT).expanduser())
    d = Path(data_dir).expanduser()
    if problem := path_problem(d, "folder"):
        raise DataError(f"CIFAR-10 directory {d} {problem}: point --data-dir at a folder; {_EXPECTED}")
    # The npz layout wins when both are present: it is the project's own format.
    if any(d.glob("train_*.npz")) or (d / "test.npz").exists():
        return _load_npz(d)
    py_dir = _find_python_dir(d)
    if py_dir is not None:
        return _load_python(py_dir)
    raise DataError(f"no CIFAR-10 files in {d}: {_EXPECTED}")


def _download(root: Path) -> CifarArrays:
    import torchvision  # only the online path needs it

    try:
        train, test = (torchvision.datasets.CIFAR10(root=str(root), train=t, download=True) for t in (True, False))
    except (OSError, RuntimeError) as e:  # network errors are OSError; a failed checksum is RuntimeError
        raise DataError(
            f"downloading CIFAR-10 into {root} failed ({_oneline(e)}): pass --data-dir with a local copy; {_EXPECTED}"
        ) from e
    where = f"torchvision download in {root}"
    train_x, test_x = np.asarray(train.data), np.asarray(test.data)  # (N, 32, 32, 3) uint8 already
    return CifarArrays(
        train_x=train_x,
        train_y=_check_split(train_x, np.asarray(train.targets), where),
        test_x=test_x,
        test_y=_check_split(test_x, np.asarray(test.targets), where),
        label_names=_check_names(train.classes, where),
        source=f"CIFAR-10 ({where})",
    )


def _load_npz(d: Path) -> CifarArrays:
    shards = sorted(d.glob("train_*.npz"))
    test_path = d / "test.npz"
    missing = ([] if shards else ["train_*.npz"]) + ([] if test_path.is_file() else ["test.npz"])
    if missing:
        raise DataError(f"{d} lacks {' and '.join(missing)}: expected {_NPZ_FILES} with arrays x, y, label_names")
    train = [_read_npz(p) for p in shards]
    test_x, test_y, names = _read_npz(test_path)
    if names is None:
        raise DataError(f"{test_path} has no label_names array: expected {_NPZ_FILES} with arrays x, y, label_names")
    for p, (_, _, shard_names) in zip(shards, train):
        if shard_names is not None and shard_names != names:
            raise DataError(f"{p} has label_names {shard_names}, but {test_path} has {names}: use shards of one export")
    return CifarArrays(
        train_x=np.concatenate([x for x, _, _ in train]),
        train_y=np.concatenate([y for _, y, _ in train]),
        test_x=test_x,
        test_y=test_y,
        label_names=names,
        source=f"CIFAR-10 npz shards in {d} ({', '.join(p.name for p in shards)}, test.npz)",
    )


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray, tuple[str, ...] | None]:
    """(x, y int64, label_names or None) of one shard, validated."""
    try:
        # Opened here, not by np.load, so the file is closed even when np.load fails on a truncated zip.
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            keys = set(z.files)
            x = z["x"] if "x" in keys else None
            y = z["y"] if "y" in keys else None
            names = z["label_names"].tolist() if "label_names" in keys else None
    # A truncated zip fails in zipfile/zlib; a file that is not an npz at all fails as .npy (ValueError).
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise DataError(
            f"cannot read {path} ({_oneline(e)}): it is truncated or not an .npz; re-copy it ({_EXPECTED})"
        ) from e
    if x is None or y is None:
        raise DataError(f"{path} has arrays {sorted(keys)}: expected {_NPZ_FILES} with arrays x, y, label_names")
    y = _check_split(x, y, str(path))
    return x, y, None if names is None else _check_names(names, str(path))


def _find_python_dir(d: Path) -> Path | None:
    """`d` itself if it holds official batch files, else its `cifar-10-batches-py` subfolder if that exists."""
    names = (*_PY_TRAIN, _PY_TEST, _PY_META)
    return next((candidate for candidate in (d, d / _PY_DIR) if any((candidate / n).exists() for n in names)), None)


def _load_python(d: Path) -> CifarArrays:
    missing = [name for name in (*_PY_TRAIN, _PY_TEST, _PY_META) if not (d / name).is_file()]
    if missing:
        raise DataError(f"{d} lacks {', '.join(missing)}: expected the official {_PY_DIR} files {_PY_FILES}")
    train = [_read_batch(d / name) for name in _PY_TRAIN]
    test_x, test_y = _read_batch(d / _PY_TEST)
    meta_path = d / _PY_META
    names = _check_names(_field(_unpickle(meta_path), "label_names", meta_path), str(meta_path))
    return CifarArrays(
        train_x=np.concatenate([x for x, _ in train]),
        train_y=np.concatenate([y for _, y in train]),
        test_x=test_x,
        test_y=test_y,
        label_names=names,
        source=f"CIFAR-10 python batches in {d}",
    )


def _unpickle(path: Path) -> dict:
    # The official release is pickle by definition (Python 2 pickles, hence encoding="bytes");
    # nothing else in the project reads pickles.
    try:
        with open(path, "rb") as f:
            obj = pickle.load(f, encoding="bytes")
    except Exception as e:  # a damaged pickle can fail with nearly any exception type
        raise DataError(
            f"cannot read {path} ({type(e).__name__}: {_oneline(e)}): it is truncated or not a CIFAR-10 batch; "
            f"re-extract the official {_PY_DIR} files ({_PY_FILES})"
        ) from e
    if not isinstance(obj, dict):
        raise DataError(f"{path} holds a {type(obj).__name__}, not a dict: expected the official {_PY_DIR} files")
    return obj


def _field(batch: dict, key: str, path: Path):
    # Python 2 pickles keep bytes keys under encoding="bytes"; a re-pickled copy may have str keys.
    for k in (key.encode(), key):
        if k in batch:
            return batch[k]
    raise DataError(f"{path} has no {key!r} entry: expected the official {_PY_DIR} files ({_PY_FILES})")


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(x (N, 32, 32, 3) uint8, y (N,) int64) of one official batch."""
    batch = _unpickle(path)
    data = np.asarray(_field(batch, "data", path))  # (N, 3072): 1024 R, then G, then B, each row-major
    labels = np.asarray(_field(batch, "labels", path))
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(
            f"{path}: data has shape {data.shape} and dtype {data.dtype}, expected uint8 (N, 3072); "
            f"re-extract the official {_PY_DIR} files"
        )
    x = np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))  # CHW -> (N, 32, 32, 3)
    return x, _check_split(x, labels, str(path))


def _check_split(x: np.ndarray, y: np.ndarray, where: str) -> np.ndarray:
    """Validate images and labels; return the labels as int64."""
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != IMAGE_SHAPE or len(x) == 0:
        raise DataError(
            f"{where}: images have shape {x.shape} and dtype {x.dtype}, expected uint8 (N, 32, 32, 3) HWC RGB "
            f"with N > 0; {_EXPECTED}"
        )
    if y.shape != (len(x),) or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{where}: labels have shape {y.shape} and dtype {y.dtype}, expected integers ({len(x)},)")
    if y.min() < 0 or y.max() >= NUM_CLASSES:
        raise DataError(f"{where}: labels span {y.min()}..{y.max()}, expected 0..{NUM_CLASSES - 1}; re-copy the data")
    return y.astype(np.int64)


def _check_names(names, where: str) -> tuple[str, ...]:
    names = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)
    if len(names) != NUM_CLASSES:
        raise DataError(f"{where}: {len(names)} label names, expected {NUM_CLASSES}")
    return names


def _oneline(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ------------------------------------------------------------------------------------------- splitting


def split_train_val(n: int, val_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of range(n) into (train_idx, val_idx): int64, disjoint, complete, each sorted."""
    if not 0 <= val_size < n:
        raise ConfigError(f"val_size={val_size} does not fit {n} training images: choose 0 <= val_size < {n}")
    perm = np.random.default_rng(seed).permutation(n)
    # Sorted indices keep the gathered arrays in file order, so the split depends only on the seed.
    return np.sort(perm[val_size:]).astype(np.int64), np.sort(perm[:val_size]).astype(np.int64)


# ----------------------------------------------------------------------------------- on-device batches


class DeviceImages:
    """A split resident on `device`: x (N, 3, 32, 32) uint8, y (N,) int64."""

    def __init__(self, x_nhwc: np.ndarray, y: np.ndarray, device: torch.device | str):
        if x_nhwc.dtype != np.uint8 or x_nhwc.ndim != 4 or x_nhwc.shape[-1] != 3:
            raise ValueError(f"expected uint8 images (N, H, W, 3), got {x_nhwc.dtype} {x_nhwc.shape}")
        if np.shape(y) != (len(x_nhwc),):
            raise ValueError(f"expected labels of shape ({len(x_nhwc)},), got {np.shape(y)}")
        self.device = torch.device(device)
        # Ship the HWC bytes as one contiguous block and transpose on the device, where it is cheap.
        x = torch.from_numpy(np.require(x_nhwc, np.uint8, ["C", "W"])).to(self.device)  # (N, H, W, 3)
        self.x = x.permute(0, 3, 1, 2).contiguous()  # (N, 3, H, W)
        self.y = torch.from_numpy(np.asarray(y).astype(np.int64)).to(self.device)  # (N,)

    def __len__(self) -> int:
        return self.x.shape[0]

    def batches(
        self,
        batch_size: int,
        *,
        shuffle: bool,
        generator: torch.Generator | None = None,
        drop_last: bool = False,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (x uint8 (B, 3, H, W), y (B,)) on the device, each index once per call.

        The permutation is drawn now (not at the first `next`), from `generator`, which must live on the
        device. Unshuffled batches are views, not copies.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        n = len(self)
        order = torch.randperm(n, generator=generator, device=self.device) if shuffle else None
        stop = n - n % batch_size if drop_last else n
        return self._iterate(order, batch_size, stop)

    def _iterate(self, order: torch.Tensor | None, batch_size: int, stop: int):
        for start in range(0, stop, batch_size):
            if order is None:
                yield self.x[start : start + batch_size], self.y[start : start + batch_size]
            else:
                idx = order[start : start + batch_size]  # (B,)
                yield self.x[idx], self.y[idx]


# ---------------------------------------------------------------------------------------- augmentation


class GpuAugment:
    """The HAM paper's training augmentation (docs/design.md §4.1), batched on the device: each op
    draws per-image random parameters.

    Images are converted to float once, augmented in pixel units (so padding is black, as when
    torchvision pads the raw image), then normalised. Ops run in the order given:
    - ``flip``: horizontal flip with p = 0.5 per image;
    - ``resized_crop``: torchvision's RandomResizedCrop(size=(H, W), scale, ratio), bilinear, but in float
      (no rounding back to uint8) and sampled with one affine grid per image, clamped to the crop so
      it equals torchvision's crop-then-resize on the same boxes;
    - ``pad_crop``: torchvision's RandomCrop((H, W), padding=padding) with zero padding.
    """

    def __init__(
        self,
        ops: Sequence[str] = ("resized_crop", "flip"),
        *,
        scale: tuple[float, float] = (0.8, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        padding: int = 4,
    ):
        ops = (ops,) if isinstance(ops, str) else tuple(ops)
        unknown = [op for op in ops if op not in AUGMENTATIONS]
        if unknown:
            names = ", ".join(map(repr, unknown))
            raise ConfigError(f"unknown augmentation {names}: choose from {', '.join(AUGMENTATIONS)}")
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ConfigError(f"resized_crop scale must satisfy 0 < min <= max <= 1, got {scale}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ConfigError(f"resized_crop ratio must satisfy 0 < min <= max, got {ratio}")
        if int(padding) != padding or padding < 0:
            raise ConfigError(f"pad_crop padding must be a non-negative integer, got {padding}")
        self.ops = ops
        self.mean, self.std = CIFAR_MEAN, CIFAR_STD  # CIFAR-10's, as the HAM paper normalises
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.padding = int(padding)
        self._affine: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return (
            f"GpuAugment(ops={self.ops}, mean={self.mean}, std={self.std}, scale={self.scale}, "
            f"ratio={self.ratio}, padding={self.padding})"
        )

    def __call__(self, x_uint8: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Augment then normalise a batch: uint8 (B, 3, H, W) -> float32 (B, 3, H, W), on x's device."""
        return self.apply(x_uint8, self.draw(x_uint8.shape[0], generator, x_uint8.device))

    # The random numbers of a batch are drawn apart from their use, so a training step can take them as
    # an input: drawn by the data stream from its own generator, used inside a captured CUDA graph.
    def uniforms_per_image(self) -> int:
        """How many U[0, 1) numbers `apply` reads per image (at least one, so a batch always has its draws)."""
        return max(1, sum(_UNIFORMS[op] for op in self.ops))

    def draw(self, b: int, generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """The random numbers `apply` needs for `b` images: (B, uniforms_per_image) float32 in [0, 1)."""
        return torch.rand(b, self.uniforms_per_image(), generator=generator, device=device)

    def apply(self, x_uint8: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Augment with the drawn numbers `u` (from `draw`), then normalise: uint8 (B, 3, H, W) -> float32.

        Pure tensor work on the device (no host syncs, fixed shapes), so it can run inside a CUDA graph."""
        x = _to_float(x_uint8)  # (B, 3, H, W), 0..255
        at = 0
        for op in self.ops:
            n = _UNIFORMS[op]
            x = getattr(self, f"_{op}")(x, u[:, at : at + n])
            at += n
        return self._normalize_(x)

    def normalize(self, x_uint8: torch.Tensor) -> torch.Tensor:
        """No augmentation (for evaluation): x / 255, minus mean, over std, as float32 (B, 3, H, W)."""
        return self._normalize_(_to_float(x_uint8))

    def _normalize_(self, x: torch.Tensor) -> torch.Tensor:
        # (x / 255 - mean) / std folded into one multiply-add, in place on a tensor this class made.
        mul, add = self._affine_on(x.device)
        return x.mul_(mul).add_(add)

    def _affine_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Cached per device so a training step does not copy the constants host -> device every batch.
        if device not in self._affine:
            mean = torch.tensor(self.mean, dtype=torch.float64)
            std = torch.tensor(self.std, dtype=torch.float64)
            mul, add = 1 / (255 * std), -mean / std
            self._affine[device] = tuple(t.float().view(3, 1, 1).to(device) for t in (mul, add))
        return self._affine[device]

    def _flip(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        flip = u[:, 0] < 0.5  # (B,) Bernoulli(0.5)
        return torch.where(flip[:, None, None, None], x.flip(-1), x)

    def _pad_crop(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        p = self.padding
        if p == 0:
            return x
        b, c, h, w = x.shape
        padded = F.pad(x, (p, p, p, p))  # (B, C, H + 2p, W + 2p), zeros: black, as in RandomCrop(padding=p)
        # Window corners uniform in 0..2p; the clamp guards u * (2p + 1) rounding up to 2p + 1.
        dy, dx = (u.t() * (2 * p + 1)).floor().long().clamp_(max=2 * p)  # (B,) each
        rows = dy[:, None] + torch.arange(h, device=x.device)  # (B, H)
        cols = dx[:, None] + torch.arange(w, device=x.device)  # (B, W)
        bi = torch.arange(b, device=x.device)[:, None, None, None]
        ci = torch.arange(c, device=x.device)[None, :, None, None]
        return padded[bi, ci, rows[:, None, :, None], cols[:, None, None, :]]  # (B, C, H, W)

    def _resized_crop(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        top, left, ch, cw = self._boxes(u, h, w)  # (B,) each, whole pixels
        # affine_grid maps output coords in [-1, 1] (pixel edges, align_corners=False) to input coords:
        # the crop [left, left + cw] x [top, top + ch] has centre (2 left + cw) / W - 1 and half-width cw / W.
        zero = torch.zeros_like(cw)
        theta = torch.stack([torch.stack([cw / w, zero, (2 * left + cw) / w - 1], dim=-1),
                             torch.stack([zero, ch / h, (2 * top + ch) / h - 1], dim=-1)], dim=1)  # (B, 2, 3)
        grid = F.affine_grid(theta, [b, c, h, w], align_corners=False)  # (B, H, W, 2), (x, y) order
        # torchvision crops first and then resizes, so a sample near the crop's edge is clamped to the
        # crop's edge pixel instead of blending in the pixel just outside: clamp to the edge pixels' centres.
        lo = torch.stack([(2 * left + 1) / w - 1, (2 * top + 1) / h - 1], dim=-1)  # (B, 2)
        hi = torch.stack([(2 * (left + cw) - 1) / w - 1, (2 * (top + ch) - 1) / h - 1], dim=-1)
        grid = torch.maximum(torch.minimum(grid, hi[:, None, None, :]), lo[:, None, None, :])
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)

    def _boxes(self, u: torch.Tensor, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """torchvision's RandomResizedCrop.get_params for B images at once: (top, left, height, width).

        Each image gets `_CROP_ATTEMPTS` draws of an area fraction (uniform in `scale`) and an aspect
        ratio (log-uniform in `ratio`), rounded to whole pixels; the first draw that fits in the image
        wins and its corner is uniform over the positions where it fits. An image with no fitting draw
        gets torchvision's fallback: the largest central crop with the ratio clamped into `ratio`.
        `u` (B, 2 T + 2) holds the draws: T area fractions, T ratios, then the corner's two.
        All four results are float32 tensors (B,) holding integers.
        """
        t = _CROP_ATTEMPTS
        u_area, u_ratio, corner = u[:, :t], u[:, t : 2 * t], u[:, 2 * t : 2 * t + 2].t()  # (B, T), (B, T), (2, B)
        area = h * w * (self.scale[0] + (self.scale[1] - self.scale[0]) * u_area)  # (B, T)
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        aspect = torch.exp(log_lo + (log_hi - log_lo) * u_ratio)  # (B, T), width / height
        cw = torch.sqrt(area * aspect).round()  # round half to even, as Python's round() in torchvision
        ch = torch.sqrt(area / aspect).round()
        fits = (cw >= 1) & (cw <= w) & (ch >= 1) & (ch <= h)  # (B, T)
        attempt = torch.arange(t, device=u.device)
        first = torch.where(fits, attempt, t).amin(dim=1, keepdim=True)  # (B, 1): first fitting draw, or T
        found = first.squeeze(1) < t  # (B,)
        first = first.clamp(max=t - 1)
        fb_h, fb_w = self._fallback_size(h, w)
        cw = torch.where(found, cw.gather(1, first).squeeze(1), float(fb_w))  # (B,)
        ch = torch.where(found, ch.gather(1, first).squeeze(1), float(fb_h))
        # Uniform integer corner in [0, H - ch]; the clamp guards u * (H - ch + 1) rounding up to the bound.
        top = torch.minimum(torch.floor(corner[0] * (h - ch + 1)), h - ch)
        left = torch.minimum(torch.floor(corner[1] * (w - cw + 1)), w - cw)
        top = torch.where(found, top, float((h - fb_h) // 2))
        left = torch.where(found, left, float((w - fb_w) // 2))
        return top, left, ch, cw

    def _fallback_size(self, h: int, w: int) -> tuple[int, int]:
        """torchvision's central-crop size when no draw fits: the image, its ratio clamped into `ratio`."""
        in_ratio = w / h
        if in_ratio < self.ratio[0]:
            return int(round(w / self.ratio[0])), w
        if in_ratio > self.ratio[1]:
            return h, int(round(h * self.ratio[1]))
        return h, w


def _to_float(x_uint8: torch.Tensor) -> torch.Tensor:
    if x_uint8.dtype != torch.uint8 or x_uint8.ndim != 4 or x_uint8.shape[1] != 3:
        raise ValueError(f"expected uint8 images (B, 3, H, W), got {x_uint8.dtype} {tuple(x_uint8.shape)}")
    return x_uint8.float()  # the one conversion; every op after this works in float32 pixel units
