"""Shared fixtures. Tests run on the CPU on small slices of the real data in ../shared/data."""
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _shared_data() -> Path:
    return Path(os.environ.get("HEADSEARCH_TEST_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def cifar_dir() -> Path:
    d = _shared_data() / "cifar10"
    if not (d / "test.npz").exists():
        pytest.skip(f"real CIFAR-10 npz shards not found at {d} (set HEADSEARCH_TEST_DATA)")
    return d


@pytest.fixture(scope="session")
def spa_file() -> Path:
    f = _shared_data() / "spa-eng" / "spa.txt"
    if not f.exists():
        pytest.skip(f"English-Spanish corpus not found at {f} (set HEADSEARCH_TEST_DATA)")
    return f
