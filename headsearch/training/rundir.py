"""Run directories: every run gets its config, command, library versions and seed; files are written atomically."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

from headsearch.errors import HeadsearchError
from headsearch.io import hide_passwords, nearest_existing, write_atomic

LIBRARIES = ("headsearch", "torch", "torchvision", "numpy", "optuna", "sacrebleu", "tokenizers", "safetensors", "datasets")


def save_checkpoint(state_dict: Mapping[str, Any], path: Path, metadata_: Mapping[str, str] | None = None) -> None:
    """A safetensors checkpoint, written atomically; the same tensors and metadata give the same bytes."""
    from safetensors.torch import save

    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    write_atomic(path, canonical_safetensors(save(tensors, metadata=dict(metadata_ or {}))))


def canonical_safetensors(blob: bytes) -> bytes:
    """`blob` with its metadata keys in sorted order. safetensors writes the metadata from a Rust hash
    map, whose order changes from process to process, so two saves of the same checkpoint differ in
    bytes. The header keeps its length (the format pads it with spaces to align the data)."""
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    if len(text) > n:  # never, for the compact JSON safetensors writes; keep its bytes rather than break them
        return blob
    return blob[:8] + text.ljust(n, b" ") + blob[8 + n :]


def load_checkpoint(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path))


def default_run_dir(task: str, root: Path = Path("runs")) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = root / f"{task}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = root / f"{task}-{stamp}-{n}"
    return path


def check_run_dir(path: Path) -> None:
    """Fail early (before any data is loaded) when the run directory cannot be created."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise HeadsearchError(f"output directory {path} is a file, not a folder: choose another --out")
    if path.exists() and any(path.iterdir()):
        raise HeadsearchError(f"output directory {path} already exists and is not empty: choose another --out or remove it")
    parent = nearest_existing(path)
    if not parent.is_dir():
        raise HeadsearchError(f"output directory {path} is inside {parent}, which is a file: choose another --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise HeadsearchError(f"cannot write the output directory {path}: {parent} is not writable, choose another --out")


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "versions": library_versions(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def create_run_dir(path: Path, config_yaml: str, argv: list[str] | None = None) -> Path:
    """Create the directory with config.yaml, command.txt and env.json (versions, machine, date). command.txt is
    the command line with a URL's password hidden (`--storage postgresql://user:***@host/db`): run directories are
    shared and uploaded, and the study.json of a search trial says which storage it was anyway."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HeadsearchError(f"cannot create the output directory {path}: {e.strerror}") from None
    write_atomic(path / "config.yaml", config_yaml)
    argv = list(sys.argv if argv is None else argv)
    # A URL's password hidden in any argument: `--storage URL`, `--storage=URL`, a bare URL.
    write_atomic(path / "command.txt", shlex.join(hide_passwords(str(arg)) for arg in argv) + "\n")
    write_atomic(path / "env.json", json.dumps(environment(), indent=2) + "\n")
    return path
