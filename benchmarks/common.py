"""What every benchmark script shares: arguments, alternating timing, tables, and RESULTS.md.

Timings follow one discipline: the thing measured and its reference run in the same process,
alternating (the start order rotates each round, so neither side always runs on a warm or cold
cache), each timed round is synchronised with the device, and the figure is the median of the rounds (a ratio: the median of the rounds' ratios).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
# The real CIFAR-10 and English-Spanish files: beside the checkout, or wherever HEADSEARCH_DATA says.
DATA = Path(os.environ.get("HEADSEARCH_DATA", ROOT.parent / "shared" / "data"))

if str(ROOT) not in sys.path:  # run as `python benchmarks/x.py` from a checkout without installing
    sys.path.insert(0, str(ROOT))


def quantile(values: Sequence[float], q: float) -> float:
    """The replays' order statistic: the sorted values' entry at index int(q * n) (the 10th percentile of 100: the
    11th smallest), as every search-quality row takes it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def search_space(quick: bool) -> str:
    """The space benchmark searches use: deep-head on a CPU-sized slice of CIFAR-10 with --quick."""
    return str(ROOT / "benchmarks" / "spaces" / "deep-head-quick.yaml") if quick else "deep-head"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes: a few minutes on a CPU")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1 ...")
    p.add_argument("--no-write", action="store_true", help="print the table only; leave RESULTS.md alone")
    p.add_argument("--results", type=Path, default=RESULTS, help="the Markdown file the results are appended to")
    return p


def resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate(cases: Mapping[str, Callable[[], int]], repeats: int, device, warmup: int = 1) -> dict[str, list[float]]:
    """Run every case `repeats` times, interleaved; return units per second of each round, by case.

    A case is a callable doing a fixed amount of work and returning how many units it processed
    (samples, images, tokens). `warmup` untimed rounds come first (allocator, caches, autotuning).
    """
    names = list(cases)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        order = names[r % len(names):] + names[: r % len(names)]  # rotate who goes first
        for name in order:
            synchronize(device)
            t0 = time.perf_counter()
            units = cases[name]()
            synchronize(device)
            if r >= warmup:
                rates[name].append(units / (time.perf_counter() - t0))
    return rates


def paired_ratio(rates: Mapping[str, Sequence[float]], num: str, den: str) -> float:
    """Median over rounds of rates[num][i] / rates[den][i]: each ratio pairs two runs of the same round,
    so a machine that slows down for a while moves both sides and not the ratio."""
    return statistics.median(a / b for a, b in zip(rates[num], rates[den]))


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float]) -> str:
    """Relative half-range of the rounds, e.g. '±3%': how far to trust a ratio."""
    m = median(values)
    return f"±{50 * (max(values) - min(values)) / m:.0f}%" if m else "n/a"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "| " + " | ".join("-" * w for w in widths) + " |"] + [line(r) for r in cells[1:]])


def _fmt(c: object) -> str:
    if isinstance(c, float):
        return f"{c:,.0f}" if abs(c) >= 100 else f"{c:.3g}" if abs(c) < 10 else f"{c:.1f}"
    return str(c)


def device_description(device) -> str:
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}"
    return f"CPU: {cpu_model()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> str:
    import torch

    parts = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    for mod in ("torchvision", "optuna"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            pass
    parts.append(f"headsearch {git_revision()}")
    return ", ".join(parts)


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return rev + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line() -> str:
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return " ".join(["python", shlex.quote(str(script))] + [shlex.quote(a) for a in sys.argv[1:]])


def report(title: str, table: str, device, args, notes: Sequence[str] = (), machine: str | None = None) -> None:
    """Print the table, then append it to RESULTS.md with the command, device (or `machine`: a benchmark that
    loads no torch describes its machine itself), versions and date."""
    print(f"\n{title}\n\n{table}\n")
    for n in notes:
        print(f"- {n}")
    if args.no_write:
        return
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = [
        f"\n## {title} ({'quick' if args.quick else 'full'}, {stamp})\n",
        f"- command: `{command_line()}`",
        f"- device: {machine or device_description(device)}",
        f"- versions: {versions()}",
        "",
        table,
        "",
    ] + [f"- {n}" for n in notes] + [""] * bool(notes)
    path = Path(args.results)
    if not path.exists():
        path.write_text("# Benchmark results\n\nEach section is appended by a script in `benchmarks/`; see benchmarks/README.md.\n")
    with open(path, "a") as f:
        f.write("\n".join(section))
    print(f"appended to {path}")
