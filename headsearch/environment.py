"""headsearch's environment variables, each declared once: its meaning, its default and its check.

They are settings like the command's options: `check_environment` reads every one before a command creates a
file or a study, so a bad value is one line (what was wrong, what to give) and exit 2, never a half-made
study; the code that uses one reads it through `env_value`, which applies the same check.
"""
from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from headsearch.errors import HeadsearchError

ON, OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _flag(raw: str) -> bool | None:
    word = raw.strip().lower()
    return True if word in ON else False if word in OFF else None


def _seconds(minimum: float, above: bool) -> Callable[[str], float | None]:
    def parse(raw: str) -> float | None:
        try:
            seconds = float(raw)
        except ValueError:
            return None
        ok = math.isfinite(seconds) and (seconds > minimum if above else seconds >= minimum)
        return seconds if ok else None
    return parse


def _pool(raw: str) -> tuple[int, int] | None:
    """'KEPT+EXTRA' -> (KEPT >= 1, EXTRA >= 0): a database pool's connections kept, and opened beyond them at need."""
    kept, plus, extra = raw.replace(" ", "").partition("+")
    if not (plus and kept.isdigit() and extra.isdigit() and int(kept) >= 1):
        return None
    return int(kept), int(extra)


@dataclass(frozen=True)
class EnvSetting:
    name: str
    parse: Callable[[str], Any]  # the raw text -> the value, or None when the text is not a valid value
    default: Callable[[], Any]
    give: str  # what to give instead of a bad value, for the one line
    folder: str | None = None  # a folder's: what it holds (set, it must be, or become, a writable folder)

    def value(self) -> Any:
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default()
        value = self.parse(raw)
        if value is None:
            raise HeadsearchError(f"{self.name}={raw!r}: give {self.give}, or unset it")
        return value

    def check(self) -> None:
        """The value, and for a folder that is set, that it can be one."""
        from headsearch.io import folder_problem

        value = self.value()
        raw = os.environ.get(self.name, "").strip()
        if self.folder and raw and (problem := folder_problem(value, self.folder)):
            raise HeadsearchError(f"{self.name}={raw!r}{problem}, or unset it")


ENVIRONMENT = {s.name: s for s in (
    EnvSetting("HEADSEARCH_CACHE", Path, lambda: Path.home() / ".cache" / "headsearch",
               "a folder for compiled kernels, tokenizers and bench measurements", folder="headsearch's cache"),
    EnvSetting("HEADSEARCH_DEVICE_LOCKS", Path, lambda: Path(tempfile.gettempdir()) / f"headsearch-devices-{os.getuid()}",
               "a folder on a local disk for the workers' device locks", folder="the device locks"),
    EnvSetting("HEADSEARCH_STORAGE_PATIENCE", _seconds(0, above=False), lambda: 120.0,
               "the seconds a storage may be unreachable before the search stops, a number >= 0 (e.g. 120)"),
    EnvSetting("HEADSEARCH_WORKER_POOL", _pool, lambda: (1, 1),
               "a worker's database connections as KEPT+EXTRA, KEPT >= 1 (e.g. 1+1; SQLAlchemy's default is 5+10)"),
    EnvSetting("HEADSEARCH_STATUS_EVERY", _seconds(0, above=True), lambda: None,
               "the seconds between status lines, a number above 0"),
    EnvSetting("HEADSEARCH_UNHELD_WARM_UP", _flag, lambda: True, "0 to warm a GPU up inside the device hold, or 1 (the default)"),
    EnvSetting("HEADSEARCH_SHARED_GRAPH_POOL", _flag, lambda: False, "1 for one CUDA-graph memory pool a run, or 0"),
)}


def env_value(name: str) -> Any:
    """The value of headsearch's environment variable `name` (its default when unset), checked."""
    return ENVIRONMENT[name].value()


def check_environment() -> None:
    """Every headsearch environment variable, checked: before a command creates a file or a study."""
    for setting in ENVIRONMENT.values():
        setting.check()


def env_flag(name: str) -> bool:
    """Whether the flag `name` is on (1, true, yes or on, any case)."""
    return env_value(name)


def cache_root() -> Path:
    """headsearch's cache folder (compiled kernels, tokenizers, `headsearch bench` measurements):
    $HEADSEARCH_CACHE, else ~/.cache/headsearch."""
    return env_value("HEADSEARCH_CACHE")
