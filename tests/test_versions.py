"""The declared floor is the tested floor.

pyproject.toml declares `package>=X` for each dependency; constraints/oldest.txt pins the same X, and
`make test-oldest` (run by CI after `make test`) installs exactly those pins and runs this suite. These
tests keep the two files equal, and, in the floor's run (HEADSEARCH_FLOOR names the constraints file),
check that the versions installed are the pinned ones, so a green floor run cannot have tested
something newer.
"""
from __future__ import annotations

import os
import re
from importlib.metadata import version
from pathlib import Path

import pytest

from headsearch.search.study import release as base  # '2.11.0+cu130' -> (2, 11, 0)

# make test-oldest runs this module on the floor: the installed versions themselves.
pytestmark = pytest.mark.floor

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints" / "oldest.txt"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_floors() -> dict[str, str]:
    """{package: X} for every `package>=X` in pyproject.toml's [project] dependencies."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {}
    for dep in deps:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*", dep)
        assert m, f"dependency {dep!r} has no plain `>=` floor: the floor run cannot test it"
        floors[canonical(m.group(1))] = m.group(2)
    return floors


def pinned(path: Path = CONSTRAINTS) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, v = line.partition("==")
            assert v, f"{path.name}: {line!r} is not an exact pin"
            pins[canonical(name)] = v.strip()
    return pins


def test_every_declared_floor_is_the_pinned_floor():
    assert declared_floors() == {k: v for k, v in pinned().items() if k in declared_floors()}
    assert set(declared_floors()) <= set(pinned()), "a dependency without a floor pin in constraints/oldest.txt"


def test_torch_and_torchvision_floors_are_a_released_pair():
    """torchvision 0.X pairs with torch 2.(X-15): a pin of another pair cannot install."""
    pins = pinned()
    assert base(pins["torchvision"])[1] == base(pins["torch"])[1] + 15


def test_the_floor_is_no_newer_than_the_gpu_machines_torch():
    """The floor reaches back at least to torch 2.11 (the GPU machine this project measures on)."""
    assert base(pinned()["torch"]) <= (2, 11, 0)


@pytest.mark.skipif(not os.environ.get("HEADSEARCH_FLOOR"), reason="only in the floor's run (make test-oldest)")
def test_the_floor_run_runs_the_floor():
    pins = pinned(Path(os.environ["HEADSEARCH_FLOOR"]))
    installed = {name: version(name) for name in pins}
    assert {n: base(v) for n, v in installed.items()} == {n: base(v) for n, v in pins.items()}, installed
