"""CIFAR-10 loading (npz shards and the official python layout), the seeded split, device batches and augmentation."""
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from headsearch.errors import ConfigError, DataError
from headsearch.tasks.cifar_data import (
    AUGMENTATIONS,
    CIFAR_MEAN,
    CIFAR_STD,
    DeviceImages,
    GpuAugment,
    load_cifar10,
    split_train_val,
)

# make test-oldest runs this module on the floor: torchvision's CIFAR-10 reader and NumPy.
pytestmark = pytest.mark.floor

NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
MEAN = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
STD = torch.tensor(CIFAR_STD).view(3, 1, 1)


@pytest.fixture(scope="module")
def cifar(cifar_dir):
    return load_cifar10(cifar_dir)


def _by_hand(x_float: torch.Tensor) -> torch.Tensor:
    """(x / 255 - mean) / std, the textbook way."""
    return (x_float / 255 - MEAN) / STD


def _random_images(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)


# --------------------------------------------------------------------------------------------- loading


def test_real_npz_shards(cifar, cifar_dir):
    assert cifar.train_x.shape == (50000, 32, 32, 3) and cifar.train_x.dtype == np.uint8
    assert cifar.test_x.shape == (10000, 32, 32, 3) and cifar.test_x.dtype == np.uint8
    assert cifar.train_y.shape == (50000,) and cifar.train_y.dtype == np.int64
    assert cifar.test_y.shape == (10000,) and cifar.test_y.dtype == np.int64
    for y in (cifar.train_y, cifar.test_y):
        assert y.min() == 0 and y.max() == 9
    assert (np.bincount(cifar.train_y, minlength=10) == 5000).all()
    assert (np.bincount(cifar.test_y, minlength=10) == 1000).all()
    assert cifar.label_names == NAMES and "airplane" in cifar.label_names
    assert str(cifar_dir) in cifar.source


def _batch(x_nhwc: np.ndarray, y: np.ndarray, label: str) -> dict:
    """A batch dict as in the official release: bytes keys, data (N, 3072) uint8 in CHW order."""
    return {
        b"batch_label": label.encode(),
        b"labels": [int(v) for v in y],
        b"data": x_nhwc.transpose(0, 3, 1, 2).reshape(len(x_nhwc), -1),
        b"filenames": [f"img_{i}.png".encode() for i in range(len(x_nhwc))],
    }


def _write_python_layout(folder, cifar, per_batch: int = 8):
    folder.mkdir(parents=True)

    def dump(name, obj):
        with open(folder / name, "wb") as f:
            pickle.dump(obj, f, protocol=2)

    for k in range(5):
        rows = slice(k * per_batch, (k + 1) * per_batch)
        dump(f"data_batch_{k + 1}", _batch(cifar.train_x[rows], cifar.train_y[rows], f"training batch {k + 1} of 5"))
    dump("test_batch", _batch(cifar.test_x[:per_batch], cifar.test_y[:per_batch], "testing batch 1 of 1"))
    dump("batches.meta", {b"label_names": [n.encode() for n in cifar.label_names], b"num_vis": 3072})
    return folder


@pytest.mark.parametrize("point_at", ["folder", "parent"])
def test_official_python_layout_is_bit_identical(cifar, tmp_path, point_at):
    folder = _write_python_layout(tmp_path / "cifar-10-batches-py", cifar)
    got = load_cifar10(folder if point_at == "folder" else tmp_path)
    np.testing.assert_array_equal(got.train_x, cifar.train_x[:40])
    np.testing.assert_array_equal(got.train_y, cifar.train_y[:40])
    np.testing.assert_array_equal(got.test_x, cifar.test_x[:8])
    np.testing.assert_array_equal(got.test_y, cifar.test_y[:8])
    assert got.train_x.dtype == np.uint8 and got.train_y.dtype == np.int64
    assert got.train_x.flags.c_contiguous
    assert got.label_names == cifar.label_names
    assert str(folder) in got.source


def _expect_data_error(path, match: str) -> str:
    with pytest.raises(DataError, match=match) as e:
        load_cifar10(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    return message


def test_missing_dir_names_expected_files(tmp_path):
    message = _expect_data_error(tmp_path / "absent", match=r"does not exist")
    assert "train_*.npz + test.npz" in message and "data_batch_1" in message and "batches.meta" in message


def test_empty_dir_names_expected_files(tmp_path):
    message = _expect_data_error(tmp_path, match=r"no CIFAR-10 files.*train_\*\.npz \+ test\.npz")
    assert "cifar-10-batches-py" in message and "test_batch" in message


def test_truncated_npz(cifar_dir, tmp_path):
    (tmp_path / "train_0.npz").write_bytes((cifar_dir / "train_0.npz").read_bytes()[:4096])
    (tmp_path / "test.npz").write_bytes((cifar_dir / "test.npz").read_bytes()[:4096])
    _expect_data_error(tmp_path, match=r"cannot read .*train_0\.npz.*truncated.*train_\*\.npz \+ test\.npz")


def _tiny_npz(path, n: int = 4, **overrides):
    arrays = {
        "x": np.zeros((n, 32, 32, 3), np.uint8),
        "y": np.arange(n, dtype=np.uint8) % 10,
        "label_names": np.array(NAMES),
    }
    np.savez(path, **{**arrays, **overrides})


def test_tiny_npz_shards_concatenate_in_name_order(tmp_path):
    _tiny_npz(tmp_path / "train_0.npz", n=3, x=np.full((3, 32, 32, 3), 1, np.uint8))
    _tiny_npz(tmp_path / "train_1.npz", x=np.full((2, 32, 32, 3), 2, np.uint8), y=np.array([9, 9], np.uint8))
    _tiny_npz(tmp_path / "test.npz")
    got = load_cifar10(tmp_path)
    assert got.train_x[:, 0, 0, 0].tolist() == [1, 1, 1, 2, 2]
    assert got.train_y.tolist() == [0, 1, 2, 9, 9] and got.train_y.dtype == np.int64
    assert got.test_x.shape == (4, 32, 32, 3) and got.label_names == NAMES


def test_npz_without_test_file(tmp_path):
    _tiny_npz(tmp_path / "train_0.npz")
    _expect_data_error(tmp_path, match=r"lacks test\.npz")


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"y": np.array([0, 1, 2, 10], np.uint8)}, r"labels span 0\.\.10, expected 0\.\.9"),
        ({"x": np.zeros((4, 3, 32, 32), np.uint8)}, r"expected uint8 \(N, 32, 32, 3\)"),
        ({"x": np.zeros((4, 32, 32, 3), np.float32)}, r"dtype float32"),
        ({"y": np.zeros(3, np.uint8)}, r"labels have shape \(3,\)"),
        ({"label_names": np.array(NAMES[:9])}, r"9 label names"),
    ],
)
def test_malformed_npz(tmp_path, override, match):
    _tiny_npz(tmp_path / "train_0.npz")
    _tiny_npz(tmp_path / "test.npz", **override)
    _expect_data_error(tmp_path, match=match)


def test_python_layout_missing_and_corrupt_files(cifar, tmp_path):
    folder = _write_python_layout(tmp_path / "cifar-10-batches-py", cifar, per_batch=2)
    (folder / "data_batch_3").unlink()
    message = _expect_data_error(tmp_path, match=r"lacks data_batch_3")
    assert "batches.meta" in message

    _write_python_layout(tmp_path / "other" / "cifar-10-batches-py", cifar, per_batch=2)
    test_batch = tmp_path / "other" / "cifar-10-batches-py" / "test_batch"
    test_batch.write_bytes(test_batch.read_bytes()[:100])
    _expect_data_error(test_batch.parent, match=r"cannot read .*test_batch.*truncated")


# ------------------------------------------------------------------------------------------- splitting


def test_split_train_val():
    train, val = split_train_val(1000, 100, seed=0)
    assert train.dtype == np.int64 and val.dtype == np.int64
    assert len(train) == 900 and len(val) == 100
    assert np.intersect1d(train, val).size == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([train, val])), np.arange(1000))
    assert (np.diff(train) > 0).all() and (np.diff(val) > 0).all()

    again_train, again_val = split_train_val(1000, 100, seed=0)
    np.testing.assert_array_equal(again_val, val)
    np.testing.assert_array_equal(again_train, train)
    assert not np.array_equal(split_train_val(1000, 100, seed=1)[1], val)

    train, val = split_train_val(10, 0, seed=0)
    np.testing.assert_array_equal(train, np.arange(10))
    assert val.shape == (0,) and val.dtype == np.int64


@pytest.mark.parametrize("val_size", [-1, 10, 11])
def test_split_train_val_rejects_bad_sizes(val_size):
    with pytest.raises(ConfigError, match=r"val_size"):
        split_train_val(10, val_size, seed=0)


# ----------------------------------------------------------------------------------- on-device batches


def test_device_images_layout():
    x = _random_images(5).permute(0, 2, 3, 1).numpy()  # (5, 32, 32, 3)
    images = DeviceImages(x, np.arange(5, dtype=np.uint8), "cpu")
    assert len(images) == 5
    assert images.x.shape == (5, 3, 32, 32) and images.x.dtype == torch.uint8 and images.x.is_contiguous()
    assert images.y.dtype == torch.int64
    torch.testing.assert_close(images.x, torch.from_numpy(x).permute(0, 3, 1, 2))


def _indexed_images(n: int) -> DeviceImages:
    """Image i is filled with i % 256 and labelled i, so a batch shows whether x and y stayed together."""
    x = np.broadcast_to((np.arange(n) % 256).astype(np.uint8)[:, None, None, None], (n, 32, 32, 3))
    return DeviceImages(np.ascontiguousarray(x), np.arange(n), "cpu")


def test_batches_shuffled_cover_every_index_once():
    images = _indexed_images(300)
    seen = []
    for x, y in images.batches(64, shuffle=True, generator=torch.Generator().manual_seed(0)):
        assert x.shape == (len(y), 3, 32, 32) and x.dtype == torch.uint8
        assert (x == (y % 256).to(torch.uint8)[:, None, None, None]).all()  # labels travel with their images
        seen.append(y)
    assert [len(y) for y in seen] == [64, 64, 64, 64, 44]
    order = torch.cat(seen)
    assert sorted(order.tolist()) == list(range(300))
    assert order.tolist() != list(range(300))

    replay = torch.cat([y for _, y in images.batches(64, shuffle=True, generator=torch.Generator().manual_seed(0))])
    assert torch.equal(replay, order)


def test_batches_drop_last_and_unshuffled_order():
    images = _indexed_images(300)
    sizes = [len(y) for _, y in images.batches(64, shuffle=True, drop_last=True)]
    assert sizes == [64, 64, 64, 64]
    assert list(images.batches(400, shuffle=False, drop_last=True)) == []
    order = torch.cat([y for _, y in images.batches(128, shuffle=False)])
    assert order.tolist() == list(range(300))
    with pytest.raises(ValueError):
        images.batches(0, shuffle=False)


# ---------------------------------------------------------------------------------------- augmentation


def test_normalize_by_hand():
    x = _random_images(2)
    out = GpuAugment().normalize(x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    for b, c, i, j in [(0, 0, 0, 0), (0, 1, 5, 7), (1, 2, 31, 31), (1, 0, 16, 3)]:
        expected = (x[b, c, i, j].item() / 255 - CIFAR_MEAN[c]) / CIFAR_STD[c]
        assert abs(out[b, c, i, j].item() - expected) < 1e-5
    torch.testing.assert_close(out, _by_hand(x.float()), atol=1e-5, rtol=0)


def test_flip_mirrors_some_images_and_keeps_the_rest():
    x = _random_images(64)
    out = GpuAugment(["flip"])(x, torch.Generator().manual_seed(0))
    plain, mirrored = _by_hand(x.float()), _by_hand(x.float().flip(-1))
    is_plain = (out - plain).abs().amax(dim=(1, 2, 3)) < 1e-5
    is_mirrored = (out - mirrored).abs().amax(dim=(1, 2, 3)) < 1e-5
    assert (is_plain ^ is_mirrored).all()  # random images are never their own mirror
    assert 10 < is_mirrored.sum() < 54


def test_pad_crop_takes_a_window_of_the_zero_padded_image():
    x = _random_images(32)
    out = GpuAugment(["pad_crop"], padding=4)(x, torch.Generator().manual_seed(0))
    padded = _by_hand(F.pad(x.float(), (4, 4, 4, 4)))  # black padding, then normalised
    offsets = set()
    for b in range(len(x)):
        matches = [
            (dy, dx)
            for dy in range(9)
            for dx in range(9)
            if (out[b] - padded[b, :, dy : dy + 32, dx : dx + 32]).abs().max() < 1e-5
        ]
        assert len(matches) == 1, f"image {b} matches windows {matches}"
        offsets.add(matches[0])
    assert len(offsets) > 10  # per-image offsets, not one for the batch


def test_resized_crop_full_scale_square_is_identity():
    x = _random_images(8)
    out = GpuAugment(["resized_crop"], scale=(1, 1), ratio=(1, 1))(x, torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, _by_hand(x.float()), atol=1e-5, rtol=0)


def test_resized_crop_of_a_constant_image_is_constant():
    x = torch.tensor([17, 128, 240], dtype=torch.uint8).view(1, 3, 1, 1).expand(16, 3, 32, 32).contiguous()
    out = GpuAugment(["resized_crop"], scale=(0.08, 1.0))(x, torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, _by_hand(x.float()), atol=1e-5, rtol=0)


def test_resized_crop_matches_torchvision_crop_then_resize():
    import torchvision.transforms.functional as tvf  # a dependency of headsearch: never skipped
    x = _random_images(32)
    aug = GpuAugment(["resized_crop"], scale=(0.08, 1.0))
    out = aug(x, torch.Generator().manual_seed(5))
    # resized_crop is the only op, so the same seed redraws the same boxes.
    boxes = aug._boxes(aug.draw(32, torch.Generator().manual_seed(5)), 32, 32)
    expected = torch.stack(
        [tvf.resized_crop(x[i].float(), *(int(v[i]) for v in boxes), [32, 32], antialias=False) for i in range(32)]
    )
    torch.testing.assert_close(out, _by_hand(expected), atol=1e-4, rtol=0)


def test_resized_crop_boxes_follow_torchvision():
    aug = GpuAugment(["resized_crop"], scale=(0.3, 1.0), ratio=(3 / 4, 4 / 3))
    top, left, h, w = aug._boxes(aug.draw(4096, torch.Generator().manual_seed(0)), 32, 32)
    assert (h >= 1).all() and (w >= 1).all() and (top >= 0).all() and (left >= 0).all()
    assert (top + h <= 32).all() and (left + w <= 32).all()
    assert (h == h.round()).all() and (top == top.round()).all()
    area = h * w / 1024
    assert area.min() > 0.3 - 0.05 and area.max() <= 1.0  # rounding to whole pixels moves the area a little
    assert (w / h).min() > 3 / 4 - 0.1 and (w / h).max() < 4 / 3 + 0.1
    assert top.max() > 10 and (h < 32).any()  # crops really move and shrink

    # No draw can fit (w = sqrt(1024 * 2) > 32): torchvision's central fallback, 32 wide and 16 high.
    never_fits = GpuAugment(["resized_crop"], scale=(1, 1), ratio=(2, 2))
    top, left, h, w = never_fits._boxes(never_fits.draw(3, torch.Generator().manual_seed(0)), 32, 32)
    assert w.tolist() == [32] * 3 and h.tolist() == [16] * 3
    assert top.tolist() == [8] * 3 and left.tolist() == [0] * 3


def test_augment_is_reproducible_from_the_generator_seed():
    x = _random_images(16)
    aug = GpuAugment(["resized_crop", "flip", "pad_crop"])
    a = aug(x, torch.Generator().manual_seed(1))
    b = aug(x, torch.Generator().manual_seed(1))
    c = aug(x, torch.Generator().manual_seed(2))
    assert a.dtype == torch.float32 and a.shape == (16, 3, 32, 32) and a.device == x.device
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_default_ops_and_unknown_op():
    assert GpuAugment().ops == ("resized_crop", "flip")
    with pytest.raises(ConfigError, match=r"'cutout'.*" + ", ".join(AUGMENTATIONS)):
        GpuAugment(["flip", "cutout"])
    with pytest.raises(ConfigError, match="scale"):
        GpuAugment(scale=(0.5, 1.5))


def test_the_task_accepts_exactly_the_augmentations_the_data_module_implements():
    from headsearch.tasks import vit_cifar10

    assert vit_cifar10.AUGMENTATIONS == AUGMENTATIONS
